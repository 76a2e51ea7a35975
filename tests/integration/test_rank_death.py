"""A rank that dies mid-training: the others stop with one line that names it, not a wall of gloo tracebacks;
inside a real memory cgroup that the run outgrows, the line names the kernel's OOM killer.

3 processes on gloo, each rank's stderr kept apart (`accelerate launch --tee`), so that what each rank
printed can be read on its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from training_helpers import (command_line, resume_chat_data, resume_overrides, three_cpu_processes,
                              wait_for_step)

pytestmark = [pytest.mark.slow, pytest.mark.machine]  # kills, and the kernel's OOM-kill count
ENV = {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
DIED = re.compile(r"Rank (\d) \(PID \d+\) died during training: (.*)")


def rank_outputs(rank_logs: Path) -> list[str]:
    return [path.read_text() for path in sorted(rank_logs.glob("*/attempt_*/*/stderr.log"))]


def start(folder: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    chat_data = resume_chat_data(folder)
    # Epochs enough that the kill lands mid-training however late the launcher's copy of the log comes in.
    command = command_line(["train", *resume_overrides(folder, chat_data, "--epochs=50", "--save_steps=5", *extra)],
                           env, three_cpu_processes(folder / "rank-logs"))
    return subprocess.Popen(command, cwd=folder, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True, env={**os.environ, **ENV, **env})


def test_one_line_names_the_rank_that_was_killed(tmp_path):
    import psutil

    process = start(tmp_path, {"LOWMEM_TEST_STEP_SECONDS": "0.05"})
    wait_for_step(process, 8)
    workers = [child for child in psutil.Process(process.pid).children(recursive=True)
               if child.environ().get("RANK") == "2"]
    assert len(workers) == 1
    workers[0].send_signal(signal.SIGKILL)
    process.communicate(timeout=120)
    outputs = rank_outputs(tmp_path / "rank-logs")
    assert len(outputs) == 3
    lines = [match for output in outputs for match in DIED.findall(output)]
    tails = "\n".join(output[-2500:] for output in outputs)
    assert len(lines) == 1 and lines[0][0] == "2", tails  # said once, by one survivor, of rank 2
    assert "the kernel counts no OOM kill since the start" in lines[0][1]
    assert "The memory plan predicted" in lines[0][1] and "--is_keep_training=True" in lines[0][1]
    for output in outputs[:2]:  # the survivors: no traceback of their own
        assert "Traceback" not in output and "Connection closed by peer" not in output, output[-3000:]


def _memory_cgroup_root() -> Path | None:
    root = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (root / "memory.limit_in_bytes").is_file() or not os.access(root, os.W_OK):
        return None
    return root


@pytest.mark.skipif(_memory_cgroup_root() is None, reason="needs root and a writable cgroup v1 memory hierarchy")
def test_a_rank_the_oom_killer_ends_is_named_as_such(tmp_path):
    group = _memory_cgroup_root() / f"lowmem-oom-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(2 * 2**30))
        env = {"LOWMEM_TEST_LEAK_MB_PER_STEP": "100:2", "LOWMEM_TEST_STEP_SECONDS": "0.05"}  # rank 2 outgrows it
        chat_data = resume_chat_data(tmp_path)
        args = resume_overrides(tmp_path, chat_data, "--epochs=2", "--save_steps=5")
        launch = " ".join(command_line(["train", *args], env, three_cpu_processes(tmp_path / "rank-logs")))
        # The shell puts itself in the cgroup, then becomes the launcher: every rank starts inside it.
        done = subprocess.run(["sh", "-c", f"echo $$ > {group / 'cgroup.procs'} && exec {launch}"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600, env={**os.environ, **ENV, **env})
        assert done.returncode != 0
        assert "oom_kill 0" not in (group / "memory.oom_control").read_text(), "the OOM killer never acted"
        lines = [match for output in rank_outputs(tmp_path / "rank-logs") for match in DIED.findall(output)]
        assert len(lines) == 1 and lines[0][0] == "2", lines
        assert "the kernel's OOM killer ended it (this run's memory cgroup counts" in lines[0][1]
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        for _ in range(100):  # the killed processes leave the group as they are reaped
            if not (group / "cgroup.procs").read_text().split():
                break
            time.sleep(0.1)
        group.rmdir()
