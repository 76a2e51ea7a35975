"""Checkpoints and --is_keep_training=True: a resumed run continues exactly as if never stopped."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from training_helpers import chat_data as chat_data  # the resume tests' data, made once per module
from training_helpers import (assert_losses_match, kill_all, resume_overrides, resumed_from, run_command, start_run,
                              tiny_overrides, traced_losses, traced_run, wait_for_step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, chat_data):
    folder = tmp_path_factory.mktemp("reference")
    _, trace = traced_run(folder, chat_data)
    return traced_losses(trace), json.loads((trace / "trace-rank0.json").read_text())


# The epoch's last step and the next epoch's first: a stop mid-epoch is resumed by the SIGTERM test below, and
# in-process by tests/unit/test_trainer.py::test_a_resumed_trainer_continues_exactly.
@pytest.mark.parametrize("stop_at", [56, 57])
def test_resume_continues_exactly(tmp_path, chat_data, reference, stop_at):
    reference_losses, reference_trace = reference
    first = run_command(["train", *resume_overrides(tmp_path, chat_data)], cwd=tmp_path,
                        env={"LOWMEM_STOP_AFTER_STEP": str(stop_at)})
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"Stopped by LOWMEM_STOP_AFTER_STEP={stop_at} at step {stop_at}" in first.stderr
    assert (tmp_path / "run" / f"checkpoint-{stop_at}" / "COMPLETE.json").is_file()

    resumed, trace = traced_run(tmp_path, chat_data, extra=["--is_keep_training=True"])
    assert resumed_from(resumed.stderr) == stop_at
    assert_losses_match(traced_losses(trace), reference_losses, stop_at)
    resumed_trace = json.loads((trace / "trace-rank0.json").read_text())
    rows_before = stop_at * 2 * 8  # steps × micro-batches × rows
    assert resumed_trace["rows"] == reference_trace["rows"][rows_before:], "the data order after the resume differs"
    assert resumed_trace["weights"] == reference_trace["weights"]


def test_no_checkpoint_says_so_and_starts_fresh(tmp_path, chat_data):
    done = run_command(["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=3", "--is_keep_training=True"],
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"No complete checkpoint in {tmp_path / 'run'}: starting fresh." in done.stderr


def test_damaged_latest_checkpoint_falls_back_to_the_previous(tmp_path, chat_data):
    first = run_command(["train", *resume_overrides(tmp_path, chat_data)], cwd=tmp_path,
                        env={"LOWMEM_STOP_AFTER_STEP": "30"})
    assert first.returncode == 0
    weights = tmp_path / "run" / "checkpoint-30" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    resumed = run_command(["train", *resume_overrides(tmp_path, chat_data), "--is_keep_training=True"],
                          cwd=tmp_path, env={"LOWMEM_STOP_AFTER_STEP": "26"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"WARNING.*checkpoint-30", resumed.stderr)
    assert "checkpoint-25: epoch 0, step 25" in resumed.stderr


def test_changed_batch_size_needs_an_explicit_flag(tmp_path, chat_data):
    first = run_command(["train", *resume_overrides(tmp_path, chat_data)], cwd=tmp_path,
                        env={"LOWMEM_STOP_AFTER_STEP": "10"})
    assert first.returncode == 0
    refused = run_command(["train", *resume_overrides(tmp_path, chat_data, "--batch_size_per_gpu=4"),
                           "--is_keep_training=True"], cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "batch_size_per_gpu: 8 → 4" in refused.stderr and "--allow_config_change=True" in refused.stderr
    allowed = run_command(["train", *resume_overrides(tmp_path, chat_data, "--batch_size_per_gpu=4",
                                                      "--max_steps=12"),
                           "--is_keep_training=True", "--allow_config_change=True"], cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "changed: batch_size_per_gpu: 8 → 4" in allowed.stderr


# In the second epoch (56 steps each): a SIGKILL in the first is resumed on 3 processes below, and a stop there by the
# tests above.
@pytest.mark.parametrize("kill_after", [90])
def test_sigkill_then_resume_is_exact(tmp_path, chat_data, reference, kill_after):
    reference_losses, _ = reference
    process = start_run(tmp_path, chat_data, env={"LOWMEM_TEST_STEP_SECONDS": "0.03"})
    wait_for_step(process, kill_after)
    kill_all(process)
    resumed, trace = traced_run(tmp_path, chat_data, extra=["--is_keep_training=True"])
    start = resumed_from(resumed.stderr)
    assert start in (25, 50, 56, 75) and start <= kill_after
    assert_losses_match(traced_losses(trace), reference_losses, start)


def test_kill_during_a_save_loses_nothing(tmp_path, chat_data):
    for attempt, delay in enumerate([0.2, 0.9, 1.6]):
        folder = tmp_path / f"attempt{attempt}"
        folder.mkdir()
        # Each save sleeps 2 s inside its write: the kill lands while checkpoint-50 is being written.
        process = start_run(folder, chat_data, env={"LOWMEM_TEST_SAVE_SECONDS": "2"})
        wait_for_step(process, 50)
        time.sleep(delay)
        kill_all(process)
        assert not (folder / "run" / "checkpoint-50" / "COMPLETE.json").exists()
        # The resume is what is tested, not the rest of the run: it stops (and saves) after one more step.
        resumed = run_command(["train", *resume_overrides(folder, chat_data), "--is_keep_training=True"], cwd=folder,
                              env={"LOWMEM_STOP_AFTER_STEP": "26"})
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert resumed_from(resumed.stderr) == 25
        assert not list((folder / "run").glob(".checkpoint-*")), "the interrupted save's leftovers are removed"


def test_sigterm_mid_epoch_saves_exits_cleanly_and_resumes_exactly(tmp_path, chat_data, reference):
    reference_losses, _ = reference
    process = start_run(tmp_path, chat_data, env={"LOWMEM_TEST_STEP_SECONDS": "0.03"})
    wait_for_step(process, 30)
    process.send_signal(signal.SIGTERM)
    rest = process.stderr.read()
    assert process.wait(timeout=120) == 0, rest[-3000:]
    stopped_at = int(re.search(r"Stopped by SIGTERM at step (\d+)", rest).group(1))
    assert 30 <= stopped_at < 56, "mid-epoch"
    assert (tmp_path / "run" / f"checkpoint-{stopped_at}" / "COMPLETE.json").is_file()
    resumed, trace = traced_run(tmp_path, chat_data, extra=["--is_keep_training=True"])
    assert resumed_from(resumed.stderr) == stopped_at
    assert_losses_match(traced_losses(trace), reference_losses, stopped_at)


THREE_PROCESSES = ["accelerate", "launch", "--multi_gpu", "--num_processes", "3", "--main_process_port", "0"]
THREE_PROCESS_ENV = {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
THREE_PROCESS_EXTRA = ["--epochs=2", "--save_steps=5"]  # 18 steps per epoch with 3 ranks


@pytest.fixture(scope="module")
def three_process_reference(tmp_path_factory, chat_data):
    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate launcher is not on PATH")
    folder = tmp_path_factory.mktemp("reference3")
    _, trace = traced_run(folder, chat_data, env=THREE_PROCESS_ENV, extra=THREE_PROCESS_EXTRA, launcher=THREE_PROCESSES)
    return trace


@pytest.mark.over_a_minute("the three-process reference run (the module's fixture, paid by the first of its tests), "
                           "a launch killed mid-run and its resume")
def test_three_processes_resume_exactly_after_sigkill(tmp_path, chat_data, three_process_reference):
    reference_trace = three_process_reference
    reference_losses = traced_losses(reference_trace)
    env, extra, launcher = THREE_PROCESS_ENV, THREE_PROCESS_EXTRA, THREE_PROCESSES
    process = start_run(tmp_path, chat_data, env={**env, "LOWMEM_TEST_STEP_SECONDS": "0.05"}, launcher=launcher,
                        extra=extra)
    wait_for_step(process, 23)  # in the second epoch
    kill_all(process)
    resumed, trace = traced_run(tmp_path, chat_data, env=env, extra=[*extra, "--is_keep_training=True"],
                                launcher=launcher)
    start = resumed_from(resumed.stderr)
    assert 19 <= start <= 23, "resumed in the second epoch (19 steps each), before the kill"
    for rank in range(3):
        expected = json.loads((reference_trace / f"trace-rank{rank}.json").read_text())
        got = json.loads((trace / f"trace-rank{rank}.json").read_text())
        # Each rank's share ends with a short batch, so compare with the tail rather than count rows per step.
        assert len(got["rows"]) > 0 and got["rows"] == expected["rows"][-len(got["rows"]):], rank
        assert got["steps"] == expected["steps"]
    # Bit-for-bit weights are not promised across processes: DDP rebuilds its gradient buckets after each
    # process's first step, so the resumed run's first all-reduce adds in another order than the
    # uninterrupted run's, a difference at float rounding. Losses agree to 1e-6.
    assert_losses_match(traced_losses(trace), reference_losses, start)


# The workers notice the launcher's end at once (a parent-death signal) and save at the end of their step.
LAUNCHER_GONE_BOUND_SECONDS = 20


def _three_processes_at_step(tmp_path, chat_data, step: int):
    """A 3-process run (slowed) that has logged `step`, with its stderr drained; the launcher and its workers."""
    import psutil

    process = start_run(tmp_path, chat_data, env={**THREE_PROCESS_ENV, "LOWMEM_TEST_STEP_SECONDS": "0.05"},
                        launcher=THREE_PROCESSES, extra=THREE_PROCESS_EXTRA)
    wait_for_step(process, step)
    threading.Thread(target=process.stderr.read, daemon=True).start()  # a full pipe must not block anyone
    workers = psutil.Process(process.pid).children(recursive=True)
    assert len(workers) >= 3
    return process, workers


def _resume_three_processes(tmp_path, chat_data):
    """Resume the run in `tmp_path` on 3 processes to its end; the step it resumed from and its trace."""
    resumed, trace = traced_run(tmp_path, chat_data, env=THREE_PROCESS_ENV,
                                extra=[*THREE_PROCESS_EXTRA, "--is_keep_training=True"], launcher=THREE_PROCESSES)
    return resumed_from(resumed.stderr), trace


@pytest.mark.machine  # a bound on how soon the others stop, and the OOM-kill count the report reads
@pytest.mark.over_a_minute("a launch whose launcher is killed, the workers' own save and stop, and the resume; "
                           "with the three-process reference run when it is the module's first")
def test_sigkill_of_the_launcher_alone_stops_every_worker_after_a_save(tmp_path, chat_data, three_process_reference):
    import psutil

    process, workers = _three_processes_at_step(tmp_path, chat_data, 8)
    process.send_signal(signal.SIGKILL)  # the launcher only: its workers live in sessions of their own
    _, alive = psutil.wait_procs(workers, timeout=LAUNCHER_GONE_BOUND_SECONDS)
    assert not alive, [worker.pid for worker in alive]
    process.wait(timeout=30)
    saved = {int(marker.parent.name.split("-")[1]) for marker in (tmp_path / "run").glob("checkpoint-*/COMPLETE.json")}
    assert saved and max(saved) >= 8, "the workers saved before they exited"
    start, trace = _resume_three_processes(tmp_path, chat_data)
    assert start == max(saved)
    assert_losses_match(traced_losses(trace), traced_losses(three_process_reference), start)

def _can_drop_privileges() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-U", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_drop_privileges(), reason="needs root and `unshare -U` to run a process that a "
                                                       "read-only folder really stops")
def test_save_into_a_read_only_folder_fails_with_a_message_and_keeps_older_checkpoints(chat_data):
    import stat
    import tempfile

    # A folder every user can enter: the second run is `nobody` (an unprivileged user namespace), for
    # whom the read-only run folder is really read-only, as it is not for root.
    folder = Path(tempfile.mkdtemp(prefix="lowmem-readonly-"))
    try:
        folder.chmod(0o777)
        for path in chat_data:
            shutil.copy(path, folder)
        data_files = (folder / "train.parquet", folder / "valid.parquet")
        for path in data_files:
            path.chmod(0o644)
        first = run_command(["train", *resume_overrides(folder, data_files)], cwd=folder,
                            env={"LOWMEM_STOP_AFTER_STEP": "10"})
        assert first.returncode == 0, first.stderr[-3000:]
        for path in folder.rglob("*"):
            path.chmod(path.stat().st_mode | stat.S_IROTH | stat.S_IWOTH | (stat.S_IXOTH if path.is_dir() else 0))
        run_dir = folder / "run"
        before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        run_dir.chmod(0o555)
        second = run_command(["train", *resume_overrides(folder, data_files), "--is_keep_training=True"],
                             cwd=folder, launcher=["unshare", "-U", sys.executable])
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        # Refused at the start, before anything is built or trained (a save-time failure has its own tests).
        assert "cannot be written" in second.stderr and "--output_dir" in second.stderr, second.stderr[-2000:]
        assert "Training:" not in second.stderr
        after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        assert after == before, "the existing checkpoints changed"
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", str(folder)])
        shutil.rmtree(folder, ignore_errors=True)


# A rank killed outright: the others fail in their next collective (gloo sees the peer's socket close) and the
# launcher ends the rest of the group; the process-group timeout bounds a hang where nothing fails.
ONE_RANK_KILLED_BOUND_SECONDS = 60


@pytest.mark.machine  # a bound on how soon the others stop, and the OOM-kill count the report reads
@pytest.mark.slow
def test_sigkill_of_one_worker_ends_the_others_and_the_resume_is_exact(tmp_path, chat_data, three_process_reference):
    import psutil

    process, workers = _three_processes_at_step(tmp_path, chat_data, 8)
    workers[-1].send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs([psutil.Process(process.pid), *workers[:-1]], timeout=ONE_RANK_KILLED_BOUND_SECONDS)
    assert not alive, [proc.pid for proc in alive]
    process.wait(timeout=30)
    start, trace = _resume_three_processes(tmp_path, chat_data)
    assert_losses_match(traced_losses(trace), traced_losses(three_process_reference), start)
