"""Weighted mixtures of training sources through the training command: a run killed with SIGKILL resumes
exactly, and a mixture resumed on two processes (`accelerate launch`) reads every remaining row once."""

from __future__ import annotations

import collections
import json
import re
import shutil
from pathlib import Path

import pytest
from training_helpers import (assert_losses_match, kill_all, resumed_from, run_command, start_run, traced_losses,
                              traced_run, wait_for_step, write_chat_rows)


# ----- the training command ------------------------------------------------------------------------------------
def _mixture_data(folder: Path) -> tuple[Path, Path]:
    """Two sources (600 and 120 rows) and a validation file; the first is what --train_file points at."""
    write_chat_rows(folder / "big.parquet", 600, seed=1)
    write_chat_rows(folder / "small.parquet", 120, seed=3)
    write_chat_rows(folder / "small_valid.parquet", 20, seed=4)
    return folder / "big.parquet", write_chat_rows(folder / "valid.parquet", 60, seed=2)


def _mixture_flags(folder: Path) -> tuple[str, ...]:
    return (f"--train_sources={folder / 'big.parquet'}:0.6,{folder / 'small.parquet'}:0.4",
            "--train_file=data/train.parquet",  # the default: the sources replace it
            f"--validation_sources={folder / 'valid.parquet'},{folder / 'small_valid.parquet'}")


@pytest.mark.slow
def test_training_on_a_mixture_resumes_exactly_after_sigkill(tmp_path):
    reference_folder, folder = tmp_path / "reference", tmp_path / "killed"
    for path in (reference_folder, folder):
        path.mkdir()
    data = _mixture_data(reference_folder), _mixture_data(folder)
    reference, trace = traced_run(reference_folder, data[0], extra=_mixture_flags(reference_folder))
    assert "Training sources:" in reference.stderr and "an epoch is 720 rows" in reference.stderr
    rows = json.loads((trace / "trace-rank0.json").read_text())["rows"]  # a hash of each row's tokens
    assert len(rows) == 2 * 720
    by_source = re.findall(r"Validation at step \d+: loss ([\d.]+).*; by source: valid ([\d.]+), small_valid ([\d.]+)",
                           reference.stderr)
    assert by_source and all(whole == valid for whole, valid, _ in by_source)  # the same file scored twice

    process = start_run(folder, data[1], env={"LOWMEM_TEST_STEP_SECONDS": "0.03"}, extra=_mixture_flags(folder))
    wait_for_step(process, 30)
    kill_all(process)
    resumed, resumed_trace = traced_run(folder, data[1], extra=[*_mixture_flags(folder), "--is_keep_training=True"])
    start = resumed_from(resumed.stderr)
    assert start == 25
    assert_losses_match(traced_losses(resumed_trace), traced_losses(trace), start)
    resumed_rows = json.loads((resumed_trace / "trace-rank0.json").read_text())["rows"]
    assert resumed_rows == rows[-len(resumed_rows):]


@pytest.mark.slow
def test_a_mixture_resumed_on_two_processes_reads_every_remaining_row_once(tmp_path):
    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate launcher is not on PATH")
    chat_data = _mixture_data(tmp_path)
    launch = ["accelerate", "launch", "--multi_gpu", "--main_process_port", "0", "--num_processes"]
    env = {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    flags = [*_mixture_flags(tmp_path), "--epochs=1"]
    first = run_command(["train", *_resume_flags(tmp_path, chat_data, flags)], cwd=tmp_path,
                        env={**env, "LOWMEM_TRACE_DIR": str(tmp_path / "trace3"), "LOWMEM_STOP_AFTER_STEP": "5"},
                        launcher=[*launch, "3"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_command(["train", *_resume_flags(tmp_path, chat_data, [*flags, "--is_keep_training=True"])],
                         cwd=tmp_path, env={**env, "LOWMEM_TRACE_DIR": str(tmp_path / "trace2")},
                         launcher=[*launch, "2"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "is shared out anew" in second.stderr
    before, after = (_traced_rows(tmp_path / name) for name in ("trace3", "trace2"))
    seen = collections.Counter(before + after)  # a hash of each row's tokens: every row of the data differs
    # 720 rows at 0.6/0.4: 432 of the big source's 600 (none twice) and 288 of the small one's, 2 whole epochs
    # of 120 rows and 48 of a third; equal shares per reader may leave a few rows of an epoch out.
    repeated = [row for row, count in seen.items() if count > 1]
    assert max(seen.values()) <= 3 and 120 - 6 <= len(repeated) <= 120, "a row was trained on too often"
    assert 720 - 3 * 16 - 2 * 16 <= sum(seen.values()) <= 720  # short last steps leave rows out, none twice


def _resume_flags(folder: Path, chat_data, extra: list[str]) -> list[str]:
    from training_helpers import resume_overrides

    return resume_overrides(folder, chat_data, *extra)


def _traced_rows(trace: Path) -> list[str]:
    return [row for path in sorted(trace.glob("trace-rank*.json")) for row in json.loads(path.read_text())["rows"]]
