"""Memory snapshots of a process with children of its own: a child's high-water mark is its own, live children
are summed and vanished ones survived, and DataLoader workers count where compile workers do not."""

from __future__ import annotations

import multiprocessing
import sys
import time

import numpy as np
import psutil
import pytest

from lowmem.memory import take_snapshot

MB = 1024**2


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def test_a_child_high_water_is_its_own_not_its_parents():
    """A process started by a big one reports its own peak: on Linux `ru_maxrss` would start at the parent's."""
    import subprocess

    held = np.ones(400 * MB, dtype=np.uint8)  # 400 MB resident in this process before the child starts
    code = "from lowmem.memory.probe import own_high_water; print(own_high_water())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert held.sum() == 400 * MB and 5 * MB < child < 300 * MB, child / MB
    assert take_snapshot().rss_high_water >= 400 * MB


def test_snapshot_sums_live_children_and_survives_vanished_ones():
    worker = multiprocessing.get_context("fork").Process(target=_sleep, args=(5,))
    worker.start()
    try:
        real_child = psutil.Process(worker.pid)

        class Gone:
            def memory_info(self):
                raise psutil.NoSuchProcess(999_999)

        class Parent(psutil.Process):
            def children(self, recursive=False):
                return [Gone(), real_child]

        snap = take_snapshot(Parent())
        assert snap.workers == 1
        assert snap.workers_rss == real_child.memory_info().rss or snap.workers_rss > 0
        # A forked worker shares the parent's pages: its own (unique) memory is far below its RSS.
        if snap.workers_uss is not None:
            assert 0 < snap.workers_uss < snap.workers_rss
            assert snap.footprint == snap.rss + snap.workers_uss
    finally:
        worker.terminate()
        worker.join()


HELPER_WITH_A_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_snapshot_counts_dataloader_workers_not_compile_workers():
    import os
    import subprocess

    # A process with the command line of inductor's compile-worker pool, which starts a child of its own.
    script = os.path.join(os.sep, "venv", "site-packages", "torch", "_inductor", "compile_worker", "__main__.py")
    helper = subprocess.Popen([sys.executable, "-c", HELPER_WITH_A_CHILD, script, "--workers=2"],
                              stdout=subprocess.PIPE, text=True)
    worker = multiprocessing.get_context("fork").Process(target=_sleep, args=(30,))
    worker.start()
    grandchild_pid = int(helper.stdout.readline())
    processes = [psutil.Process(pid) for pid in (helper.pid, grandchild_pid, worker.pid)]
    try:
        class Parent(psutil.Process):
            def children(self, recursive=False):
                return processes

        snap = take_snapshot(Parent(), include_uss=False)
        assert snap.workers == 1
        assert snap.workers_rss == pytest.approx(processes[2].memory_info().rss, rel=0.2)  # the worker's alone
    finally:
        for pid in (grandchild_pid, helper.pid):
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        helper.wait()
        helper.stdout.close()
        worker.terminate()
        worker.join()
