"""Helpers for tests that run the training command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
_SYLLABLES = list("春风明月江南归去相思落花流水千里故人长亭夜雨西楼山青云白酒醉梦")


def write_chat_rows(path: Path, rows: int, seed: int, row_group_rows: int = 64) -> Path:
    """Unique prompt/response rows of made-up text from a small alphabet (so a small vocabulary fits)."""
    import random

    rng = random.Random(seed)
    prompts = [f"题{seed}-{i}：" + "".join(rng.choices(_SYLLABLES, k=rng.randint(4, 12))) for i in range(rows)]
    responses = ["".join(rng.choices(_SYLLABLES, k=rng.randint(6, 30))) + "。" for _ in range(rows)]
    pq.write_table(pa.table({"prompt": prompts, "response": responses}), path, row_group_size=row_group_rows)
    return path


def tiny_overrides(tmp_path: Path, train_file: Path, valid_file: Path) -> list[str]:
    """Command-line overrides for a model that trains in seconds."""
    return [
        f"--train_file={train_file}", f"--validation_file={valid_file}", f"--test_file={valid_file}",
        f"--tokenizer_dir={tmp_path / 'tok'}", f"--output_dir={tmp_path / 'run'}", "--vocab_size=400",
        "--n_layer=2", "--n_head=2", "--n_embd=32", "--max_seq_len=64", "--batch_size_per_gpu=8",
        "--dataloader_buffer_size=50", "--logging_steps=5", "--warmup_steps=2", "--sample_max_new_tokens=8",
        "--eval_bleu_samples=8", "--eval_max_new_tokens=8", "--epochs=1",  # later flags win: tests may change it
    ]


HARNESS = ROOT / "tests" / "train_with_faults.py"


def command_line(args: list[str], env: dict[str, str] | None = None,
                 launcher: list[str] | None = None) -> list[str]:
    """`train_low_mem.py ARGS`, or the test harness when `env` asks for test callbacks (LOWMEM_* variables),
    optionally under a launcher."""
    script = HARNESS if any(name.startswith("LOWMEM_") for name in env or {}) else ROOT / "train_low_mem.py"
    return (launcher if launcher is not None else [sys.executable]) + [str(script), *args]


def run_command(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 600,
                launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `train_low_mem.py` or the harness (optionally under a launcher) and return the finished process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(command_line(args, env, launcher), cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def three_cpu_processes(rank_logs: Path) -> list[str]:
    """`accelerate launch` for 3 processes on the CPU (gloo). `--tee 3` also writes each rank's stderr to a file
    of its own under `rank_logs`, where its lines cannot interleave with the other ranks' (see `rank_matches`)."""
    return ["accelerate", "launch", "--multi_gpu", "--num_processes", "3", "--main_process_port", "0",
            "--tee", "3", "--log_dir", str(rank_logs)]


def rank_matches(rank_logs: Path, pattern: str) -> list[str]:
    """Every match of `pattern` in each rank's own stderr file written by `three_cpu_processes`."""
    matches: list[str] = []
    for rank_stderr in sorted(rank_logs.glob("*/attempt_*/*/stderr.log")):
        matches += re.findall(pattern, rank_stderr.read_text())
    return matches
