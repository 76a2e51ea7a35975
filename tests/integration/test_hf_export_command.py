"""`train_low_mem.py export` run as a command: a model folder written before the architecture field exports
as gpt2. The tokenizer and the run folder are those of tests/unit/test_hf_export.py (tests/export_helpers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Imports transformers offline (or skips this module without it); the fixtures, imported as themselves so that
# pytest finds them here (one_thread is autouse).
from export_helpers import gpt2_run as gpt2_run, one_thread as one_thread, tokenizer_dir as tokenizer_dir
from export_helpers import transformers
from training_helpers import ROOT

from lowmem.config import TrainConfig
from lowmem.model.weights import MODEL_CONFIG_FILE


def test_an_old_model_folder_exports_as_gpt2_through_the_command_line(gpt2_run: TrainConfig, tmp_path: Path):
    """model_config.json written before the architecture field; `train_low_mem.py export` wired to the command."""
    folder = Path(gpt2_run.output_dir) / "final"
    old = {key: value for key, value in json.loads((folder / MODEL_CONFIG_FILE).read_text()).items()
           if key not in ("architecture", "rope_theta", "norm_eps")}
    (folder / MODEL_CONFIG_FILE).write_text(json.dumps(old))
    done = subprocess.run([sys.executable, str(ROOT / "train_low_mem.py"), "export", str(tmp_path / "hf"),
                           f"--checkpoint={folder}"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert "AutoModelForCausalLM.from_pretrained" in done.stdout
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf_model).__name__ == "GPT2LMHeadModel"
