"""Workers stop when their launcher dies.

`accelerate launch` (torch's elastic launcher) starts each worker in a session of its own, so a SIGKILL of the
launcher (a hung run killed by hand, the out-of-memory killer) does not reach the workers: they would train
on, orphaned, and race a restarted run in the same folder. Each worker started by a launcher therefore asks
to receive SIGHUP when its parent dies (Linux: `prctl(PR_SET_PDEATHSIG)`; elsewhere a thread watches the
parent's PID once a second), which `lowmem.train.stop.GracefulStop` turns into the graceful stop: every rank
saves a checkpoint together, then exits. Not SIGTERM: the kernel sends the parent-death signal once for each
thread that inherited the setting, and a second SIGTERM means "exit at once".
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time


_PR_SET_PDEATHSIG = 1
LAUNCHER_GONE_SIGNAL = signal.SIGHUP
_watched: list[bool] = []


def started_by_a_launcher() -> bool:
    """True under torch's launcher (`accelerate launch`, torchrun), which sets TORCHELASTIC_RUN_ID."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _watch_parent(parent: int, interval: float) -> None:
    while os.getppid() == parent:
        time.sleep(interval)
    os.kill(os.getpid(), LAUNCHER_GONE_SIGNAL)


def launcher_watched() -> bool:
    """True once `stop_when_launcher_dies` set this process up to hear of its launcher's end."""
    return bool(_watched)


def stop_when_launcher_dies(interval: float = 1.0) -> bool:
    """If this process was started by a launcher, have it receive SIGHUP when the launcher dies; True if so.

    A process started directly (`python train_low_mem.py ...`, under nohup or not) is left alone: its parent is
    a shell, whose end must not stop the training.
    """
    if not started_by_a_launcher():
        return False
    if _watched:
        return True
    parent = os.getppid()
    _watched.append(True)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(LAUNCHER_GONE_SIGNAL), 0, 0, 0) == 0:
            if os.getppid() != parent:  # the launcher died before the request took effect
                os.kill(os.getpid(), LAUNCHER_GONE_SIGNAL)
            return True
    threading.Thread(target=_watch_parent, args=(parent, interval), name="launcher-watch", daemon=True).start()
    return True
