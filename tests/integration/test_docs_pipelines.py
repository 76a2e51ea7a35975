"""The stage pipelines of docs/training.md run as written: every `lowmem` command of the bash blocks in its sections
on starting from a model, adapters and preference training, block after block in the page's order, each exits 0.

A block whose first command starts from no model (a pretraining) begins a new project folder; the blocks after it go
on in that folder, from what the commands before them left there. The test adds to each command only flags that
make the model and the run tiny (`SHRINK`); the published model's path is a tiny Qwen2's. Each command runs as
`python -m lowmem` would run it, in the test's process (`in_process.run_in_process`): what is checked is what the
commands do and leave, not their processes."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from data_helpers import write_text_rows  # noqa: E402
from hf_models import qwen as qwen  # noqa: E402  (the fixture)
from in_process import run_in_process  # noqa: E402
from training_helpers import ROOT, write_chat_rows, write_preference_rows  # noqa: E402

SECTIONS = ("From one stage to the next", "Adapters (LoRA)", "Preference training (DPO)")
PUBLISHED_MODEL = "/models/Qwen2.5-0.5B-Instruct"
# What makes each command tiny; a new model's shape only where the command does not start from one.
NEW_MODEL = ["--vocab_size=300", "--n_layer=2", "--n_head=2", "--n_embd=32", "--max_seq_len=64"]
SHRINK = {
    "train": ["--max_steps=3", "--batch_size_per_gpu=8", "--warmup_steps=1", "--eval_steps=3", "--save_steps=3",
              "--eval_bleu_samples=2", "--eval_max_new_tokens=4", "--sample_max_new_tokens=4",
              "--dataloader_buffer_size=50"],
    "dpo_reference": ["--batch_size_per_gpu=8"],
    "evaluate": ["--bleu_samples=2", "--batch_size_per_gpu=8"],
    "generate": ["--max_new_tokens=4"],
    "export": [],
}
ENV = {"OMP_NUM_THREADS": "1"}


def pipeline_blocks(page: Path) -> list[list[list[str]]]:
    """The commands (as argument lists, `lowmem` left out) of each bash block in SECTIONS, in the page's order."""
    blocks, section = [], ""
    for part in re.split(r"^(## .*|```bash\n(?:.*\n)*?```)$", page.read_text(), flags=re.MULTILINE):
        if part.startswith("## "):
            section = part[3:].strip()
        elif part.startswith("```bash") and section.startswith(SECTIONS):
            text = part.removeprefix("```bash\n").removesuffix("```").replace("\\\n", " ")
            commands = [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]
            blocks.append([command[1:] for command in commands if command[:1] == ["lowmem"]])
    return blocks


def project(folder: Path) -> Path:
    """A folder holding every file the blocks name: text, chat rows and preference pairs."""
    folder.mkdir(parents=True)
    write_text_rows(folder / "books.parquet", 300, seed=1)
    write_text_rows(folder / "books_valid.parquet", 32, seed=10)
    (folder / "data").mkdir()
    for name, rows, seed in (("data/train", 200, 2), ("data/valid", 32, 3), ("data/test", 32, 4), ("chat", 200, 5),
                             ("more", 200, 6)):
        write_chat_rows(folder / f"{name}.parquet", rows, seed=seed)
    for name, rows, seed in (("pairs", 64, 7), ("pairs_valid", 32, 8), ("pairs_test", 32, 9)):
        write_preference_rows(folder / f"{name}.parquet", rows, seed=seed)
    return folder


def as_run_here(command: list[str], models: Path) -> list[str]:
    """`command` with the published model's path moved to the tiny one and the flags that shrink it added."""
    command = [argument.replace(PUBLISHED_MODEL, str(models / Path(PUBLISHED_MODEL).name)) for argument in command]
    starts_new_model = command[0] == "train" and not any(flag.startswith("--init_from=") for flag in command)
    return [*command, *(NEW_MODEL if starts_new_model else []), *SHRINK[command[0]]]


@pytest.mark.over_a_minute("every pipeline the pages show, run as written: converting, training, DPO and exporting")
def test_the_pages_pipelines_run_as_written(tmp_path, qwen):
    blocks = pipeline_blocks(ROOT / "docs" / "training.md")
    commands = [command[0] for block in blocks for command in block]
    # The page's pipelines: pretrain → SFT → DPO with and without adapters, the reference precomputed, and the tuned
    # model scored, asked and exported.
    assert {"train", "dpo_reference", "evaluate", "generate", "export"} <= set(commands), commands
    models = tmp_path / "models"
    shutil.copytree(qwen, models / Path(PUBLISHED_MODEL).name)
    folder, projects, printed = tmp_path, 0, {}
    for block in blocks:
        if not any(flag.startswith("--init_from=") or flag.startswith("--output_dir=") for flag in block[0]):
            projects += 1
            folder = project(tmp_path / f"project{projects}")
        for command in block:
            args = as_run_here(command, models)
            done = run_in_process([str(ROOT / "lowmem" / "__main__.py"), *args], args, folder, ENV)
            assert done.returncode == 0, f"lowmem {shlex.join(command)}\n{done.stderr[-3000:]}"
            assert "Traceback" not in done.stderr, done.stderr[-3000:]
            printed[command[0]] = done.stdout + done.stderr
    assert projects == 2  # the stages' block and the preference pipeline's, each from its pretraining
    # The two DPO variants on the same pairs went to folders of their own; evaluate read the DPO run's objective and
    # scored the held-out pairs.
    runs = folder / "model_save"
    assert (runs / "pairs_dpo_lora16_from_chat_from_books" / "final").is_dir()
    assert (runs / "pairs_dpo_precomputed_from_chat_from_books" / "final").is_dir()
    summary = json.loads((runs / "pairs_dpo_lora16_from_chat_from_books" / "eval" / "test_summary.json").read_text())
    assert summary["preference"]["pairs"] == 32 and "rewards/accuracy" in printed["evaluate"]
    assert (folder / "chat_dpo" / "config.json").is_file() and (folder / "chat_dpo_adapters" / "adapter_config.json")\
        .is_file()

