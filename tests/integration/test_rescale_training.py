"""Resuming a run on another number of processes, through `accelerate launch`: 3 processes, then 2, then 1 with
two workers; the rest of the epoch is shared out, each row once, and steps, schedule and checkpoints
continue."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from training_helpers import resume_chat_data, run_command, resume_overrides

ROWS = 900  # resume_chat_data's training rows
ROWS_PER_STEP = 8 * 2  # per process: batch_size_per_gpu × gradient_accumulation_steps of resume_overrides


def launcher(processes: int) -> list[str]:
    return ["accelerate", "launch", "--multi_gpu", "--num_processes", str(processes), "--main_process_port", "0"]


def traced_rows(trace: Path) -> list[str]:
    return [row for path in sorted(trace.glob("trace-rank*.json")) for row in json.loads(path.read_text())["rows"]]


@pytest.mark.slow
def test_three_processes_resumed_on_two_then_on_one_with_two_workers_train_every_row_of_the_epoch_once(tmp_path):
    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate launcher is not on PATH")
    chat_data = resume_chat_data(tmp_path)
    env = {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    # One epoch: 300 rows per process with 3, in steps of 16 rows; the run stops and saves after step 7. The
    # first two runs pad their batches to fixed shapes (a GPU's default), the third shapes each batch to fit:
    # the positions saved and shared out are the same either way.
    fixed = "--static_shapes=True"
    first = run_command(["train", *resume_overrides(tmp_path, chat_data, "--epochs=1", fixed)], cwd=tmp_path,
                        env={**env, "LOWMEM_TRACE_DIR": str(tmp_path / "trace3"), "LOWMEM_STOP_AFTER_STEP": "7"},
                        launcher=launcher(3))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Batch shapes: " in first.stderr  # the fixed shapes were on
    assert (tmp_path / "run" / "checkpoint-7" / "COMPLETE.json").is_file()

    # On 2 processes: 282 rows each are left; stopped and saved again after step 12.
    second = run_command(["train", *resume_overrides(tmp_path, chat_data, "--epochs=1", "--is_keep_training=True",
                                                     fixed)],
                         cwd=tmp_path, env={**env, "LOWMEM_TRACE_DIR": str(tmp_path / "trace2"),
                                            "LOWMEM_STOP_AFTER_STEP": "12"}, launcher=launcher(2))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Resumed from" in second.stderr and "checkpoint-7" in second.stderr
    assert "Resuming on 2 process(es) × 1 reader(s) where the run had 3 × 1" in second.stderr
    assert "global batch is now 32 rows per optimizer step (it was 48)" in second.stderr
    assert "--gradient_accumulation_steps=3" in second.stderr
    assert (tmp_path / "run" / "checkpoint-12" / "COMPLETE.json").is_file()

    # On 1 process × 2 DataLoader workers: as many readers as 2 × 1, split otherwise. The one process reads the
    # rest of both shares, so its rows, the steps left and the schedule must count what is really left.
    third = run_command(["train", *resume_overrides(tmp_path, chat_data, "--epochs=1", "--is_keep_training=True",
                                                    "--dataloader_num_workers=2")],
                        cwd=tmp_path, env={**env, "LOWMEM_TRACE_DIR": str(tmp_path / "trace1")})
    assert third.returncode == 0, third.stderr[-3000:]
    assert "Batch shapes: " not in third.stderr
    assert "Resumed from" in third.stderr and "checkpoint-12" in third.stderr

    before, middle, after = (traced_rows(tmp_path / name) for name in ("trace3", "trace2", "trace1"))
    assert len(before) == 3 * 7 * ROWS_PER_STEP and len(middle) == 2 * 5 * ROWS_PER_STEP
    rows_left = ROWS - len(before) - len(middle)  # 404: 202 for each worker, in 26 batches of 8 (the last short)
    steps_left = 2 * -(-(rows_left // 2) // 8) // 2
    assert (f"Resuming on 1 process(es) × 2 reader(s) where the run had 2 × 1: the rows left in this epoch are "
            f"shared out anew ({rows_left:,} per process), and {steps_left:,} steps remain.") in third.stderr
    seen = before + middle + after
    assert len(set(seen)) == len(seen), "a row was trained on twice"
    assert len(after) == rows_left  # 900 rows, 3 then 2 then 2 readers: none left out, none in a short step

    # Steps continue from each save; the learning rate goes on from where it was, down to its floor at the
    # planned last step.
    old, trace = (json.loads((tmp_path / name / "trace-rank0.json").read_text()) for name in ("trace3", "trace2"))
    assert sorted(int(step) for step in trace["lrs"]) == list(range(8, 13))
    assert 0.8 < trace["lrs"]["8"] / old["lrs"]["7"] <= 1.0
    last = json.loads((tmp_path / "trace1" / "trace-rank0.json").read_text())
    steps = sorted(int(step) for step in last["lrs"])
    assert steps == list(range(13, 12 + steps_left + 1))
    lrs = [trace["lrs"][str(step)] for step in range(8, 13)] + [last["lrs"][str(step)] for step in steps]
    assert lrs == sorted(lrs, reverse=True)
    assert lrs[-1] == pytest.approx(2e-3 * 0.1, rel=0.05)  # at the floor at the end (2.02e-4 measured)

    # The run's checkpoints and memory logs are whole.
    final = tmp_path / "run" / f"checkpoint-{steps[-1]}"
    assert (final / "COMPLETE.json").is_file() and (tmp_path / "run" / "final").is_dir()
    state = json.loads((final / "trainer_state.json").read_text())
    assert (state["world_size"], state["workers_per_rank"]) == (1, 2)
    assert state["train"]["step"] == state["schedule"]["total_steps"] == steps[-1]
    memory_logs = sorted((tmp_path / "logs").glob("*memory*rank1*"))
    assert memory_logs, list((tmp_path / "logs").iterdir())
    for path in memory_logs:
        for line in path.read_text().splitlines():
            json.loads(line)
