"""One run per folder: a second training (or evaluation) into a folder in use is refused, the lock goes with
its process, and a bad --output_dir is refused before anything is built."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from training_helpers import resume_chat_data, run_command, tiny_overrides

from lowmem.checkpoint.run_lock import LOCK_NAME, acquire_run_lock
from lowmem.errors import ConfigError

# A lock held by one process, found held by another: the commands of the tests on the lock run in processes of their
# own (this process holds the lock they must find held); the others check what a command refuses and leaves.
LOCK_HELD_ELSEWHERE = pytest.mark.own_process


def listing(folder):
    return sorted((path.relative_to(folder).as_posix(), path.stat().st_mtime_ns) for path in folder.rglob("*"))


@LOCK_HELD_ELSEWHERE
def test_a_second_training_into_a_folder_in_use_is_refused_and_touches_nothing(tmp_path):
    chat_data = resume_chat_data(tmp_path)
    args = ["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=2"]
    first = run_command(args, cwd=tmp_path)  # a run folder with a checkpoint and a model
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "run"
    held = acquire_run_lock(run, "training")  # as a live training in this folder holds it
    before = listing(tmp_path)
    refused = run_command([*args, "--is_keep_training=True"], cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"is in use: training by PID {os.getpid()}" in refused.stderr
    assert f"kill -TERM {os.getpid()}" in refused.stderr and "another --output_dir" in refused.stderr
    evaluation = run_command(["evaluate", *tiny_overrides(tmp_path, *chat_data)], cwd=tmp_path)
    assert evaluation.returncode == 2 and "is in use: training" in evaluation.stderr
    assert listing(run) == before_run(before), "the refused commands touched the run folder"
    held.release()
    again = run_command([*args, "--is_keep_training=True"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]


def before_run(before):
    return [(name[len("run/"):], mtime) for name, mtime in before if name.startswith("run/")]


@LOCK_HELD_ELSEWHERE
def test_the_lock_goes_with_a_killed_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from lowmem.checkpoint.run_lock import acquire_run_lock; "
        f"lock = acquire_run_lock({str(tmp_path)!r}, 'training'); print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=f"PID {holder.pid}"):
        acquire_run_lock(tmp_path, "training")
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    acquire_run_lock(tmp_path, "training").release()  # no stale lock
    assert (tmp_path / LOCK_NAME).is_file()


def test_an_output_dir_that_is_a_file_fails_before_training(tmp_path):
    chat_data = resume_chat_data(tmp_path)
    not_a_folder = tmp_path / "run"
    not_a_folder.write_text("a file")
    done = run_command(["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=2"], cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "is a file, not a folder" in done.stderr
    assert not (tmp_path / "tok").exists(), "nothing was built: not even the tokenizer"
    assert not_a_folder.read_text() == "a file"


def test_a_new_run_into_a_folder_with_checkpoints_is_refused_unless_told_to_overwrite(tmp_path):
    chat_data = resume_chat_data(tmp_path)
    args = ["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=4", "--save_steps=2", "--eval_bleu_samples=2"]
    first = run_command(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "run"
    kept = [entry for entry in listing(run) if entry[0] != LOCK_NAME]  # the lock records each run that takes it
    assert {"checkpoint-2", "checkpoint-4", "final"} <= {path.split("/")[0] for path, _ in kept}

    again = run_command(args, cwd=tmp_path)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "holds an earlier run" in again.stderr and "--is_keep_training=True" in again.stderr
    assert "--overwrite=True" in again.stderr
    assert [entry for entry in listing(run) if entry[0] != LOCK_NAME] == kept, "a refused run touches nothing"

    fresh = run_command([*args, "--overwrite=True"], cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "--overwrite=True: the earlier run's" in fresh.stderr
    assert "Resumed from" not in fresh.stderr


def test_resuming_when_every_checkpoint_is_damaged_stops_and_deletes_nothing(tmp_path):
    chat_data = resume_chat_data(tmp_path)
    args = ["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=4", "--save_steps=2", "--eval_bleu_samples=0"]
    assert run_command(args, cwd=tmp_path).returncode == 0
    run = tmp_path / "run"
    for weights in run.glob("checkpoint-*/model.safetensors"):
        data = bytearray(weights.read_bytes())
        data[-10] ^= 0xFF  # one flipped byte in every checkpoint
        weights.write_bytes(bytes(data))
    def checkpoints() -> list:  # the run's log gets the refused attempt's lines: everything else stays as it was
        return [entry for entry in listing(run) if entry[0] != LOCK_NAME and not entry[0].startswith("logs")]

    before = checkpoints()
    resumed = run_command([*args, "--max_steps=8", "--is_keep_training=True"], cwd=tmp_path)
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert "found no usable checkpoint" in resumed.stderr and "starting fresh" not in resumed.stderr
    assert "checkpoint-2: model.safetensors has CRC-32" in resumed.stderr and "checkpoint-4: " in resumed.stderr
    assert checkpoints() == before, "nothing changed or deleted"
