"""When a rank dies: which one, and whether the kernel's OOM killer is the likely cause.

A rank killed by SIGKILL (the OOM killer's signal) leaves no message: the others fail in their next
collective (gloo: "Connection closed by peer", NCCL: a remote process exited) and each prints a traceback
that names none of that. So every rank learns at start who the others are (rank, PID, machine), and the
kernel's OOM-kill counts (/proc/vmstat and its own memory cgroup's). When a collective fails, a survivor looks
for a rank of its own machine that is gone; the lowest surviving rank then says, in one line, which rank it
was, whether the OOM killer counted a kill since the start, and what the memory plan predicted. The others
note that they stop after the loss (a file per rank in the machine's temporary folder) and stop quietly: the
reporter, whose own collective may wait on one of them and fail only once it has gone, does not count a rank
that left such a note among the dead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from lowmem.errors import LowmemError
from lowmem.memory.cgroup import find_own_cgroup, machine_oom_kills
from lowmem.program import command_line

logger = logging.getLogger(__name__)
# A killed rank's sockets close while the kernel is still tearing it down: a survivor may see the error a
# moment before the process is gone from the process table.
GONE_WAIT_SECONDS = 3.0
# Where its note cannot be written, the most a survivor that does not report stays alive after it saw the loss,
# until the reporter has gone: the reporter may meet its failed collective later (a long step), and a survivor
# already gone by then would be named among the dead. Below the 30 s the launcher gives the survivors after its
# SIGTERM before it kills them.
SURVIVOR_WAIT_SECONDS = 20.0


class ProcessLostError(LowmemError):
    """Another rank of the run died; `PeerWatch.check` has logged which and why (on one survivor)."""


@dataclass(frozen=True)
class Peer:
    """One rank of the run: where it runs and which process it is."""

    rank: int
    pid: int
    host: str
    started: float  # the process's creation time, which tells it from a later process with its PID

    def is_gone(self) -> bool:
        """True when the process has exited (a zombie waiting for its launcher counts as exited)."""
        try:
            process = psutil.Process(self.pid)
            return (abs(process.create_time() - self.started) > 1.0
                    or process.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD))
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False


def _oom_counts() -> tuple[int | None, int | None]:
    """(OOM kills on this machine since boot, OOM kills in this process's memory cgroup)."""
    cgroup = find_own_cgroup()
    return machine_oom_kills(), None if cgroup is None else cgroup.oom_kills()


def _this_process(rank: int) -> Peer:
    return Peer(rank=rank, pid=os.getpid(), host=socket.gethostname(), started=psutil.Process().create_time())


class PeerWatch:
    """The run's ranks as seen at start, and the OOM-kill counts then; `explain` turns a failed collective into
    one line when a rank of this machine is gone."""

    def __init__(self, rank: int, peers: list[Peer], plan_line: str = "") -> None:
        self.rank, self.peers, self.plan_line = rank, peers, plan_line
        self.host = socket.gethostname()
        self.oom_at_start = _oom_counts()
        # One folder per run and machine, the same on every rank: named after the processes of the run.
        key = repr(sorted((peer.host, peer.pid, round(peer.started, 2)) for peer in peers))
        self.notes = Path(tempfile.gettempdir()) / f"lowmem-ranks-{hashlib.sha1(key.encode()).hexdigest()[:16]}"

    @classmethod
    def gather(cls, accelerator: Any, plan_line: str = "") -> PeerWatch:
        """Learn every rank's process (a collective: every rank calls it together)."""
        me = _this_process(accelerator.process_index)
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            peers = list(gather_object([me]))
        else:
            peers = [me]
        return cls(accelerator.process_index, peers, plan_line)

    def lost_here(self, wait_seconds: float = GONE_WAIT_SECONDS) -> list[Peer]:
        """The ranks of this machine whose process is gone, waiting a moment for one to be; a rank that noted it
        stopped after a loss is a survivor, not one of the lost."""
        others = [peer for peer in self.peers if peer.host == self.host and peer.rank != self.rank]
        deadline = time.monotonic() + wait_seconds
        while True:
            gone = [peer for peer in others if peer.is_gone() and not self.stopped_after_loss(peer)]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.1)

    def explain(self, lost: list[Peer]) -> str:
        """The line for lost ranks: which, whether the OOM killer counted kills since the start, the plan."""
        names = ", ".join(f"rank {peer.rank} (PID {peer.pid})" for peer in lost)
        machine_before, cgroup_before = self.oom_at_start
        machine_now, cgroup_now = _oom_counts()
        kills = None
        if cgroup_before is not None and cgroup_now is not None and cgroup_now > cgroup_before:
            kills = f"this run's memory cgroup counts {cgroup_now - cgroup_before} OOM kill(s) since the start"
        elif machine_before is not None and machine_now is not None and machine_now > machine_before:
            kills = f"the kernel counts {machine_now - machine_before} OOM kill(s) on this machine since the start"
        if kills:
            cause = f"the kernel's OOM killer ended it ({kills})"
        elif machine_now is not None:
            cause = ("it was killed or exited without a word; the kernel counts no OOM kill since the start, "
                     "so look for what else ended it (a signal sent by hand or by a scheduler, its own output)")
        else:
            cause = "it ended without a word, as a process killed with SIGKILL (the OOM killer's signal) does"
        died = "died" if len(lost) == 1 else "died (and so did the ranks after them)"
        text = f"{names[0].upper()}{names[1:]} {died} during training: {cause}. The other ranks stop."
        if self.plan_line:
            text += f" {self.plan_line}"
        return (text + " The checkpoints already saved are kept: resume with "
                f"`{command_line('train ... --is_keep_training=True')}` (your flags, and that one).")

    def check(self, error: BaseException) -> None:
        """After `error` broke training: when a rank of this machine is gone, log the line (on the lowest
        surviving rank) and raise a quiet ProcessLostError; else return (the error is this process's own, and
        the caller re-raises it).

        The line is logged here, not carried by the exception: the launcher sends the survivors SIGTERM, and
        once the training loop's signal handlers are gone a survivor may not live to print its error.
        """
        if isinstance(error, LowmemError) or len(self.peers) < 2:
            return
        lost = self.lost_here()
        if not lost:
            return
        reporter = self._reporter_peer(lost)  # the lowest surviving rank of this machine says it
        if reporter is not None and reporter.rank == self.rank:
            logger.error(self.explain(lost), extra={"all_ranks": True})
            shutil.rmtree(self.notes, ignore_errors=True)
        elif reporter is not None and not self.note_stopping():
            wait_while_alive(reporter, SURVIVOR_WAIT_SECONDS)
        raise ProcessLostError("") from None

    def note_stopping(self) -> bool:
        """Leave the note that this rank stops after a loss (it is a survivor); False when it cannot be written.

        Once noted, the rank may go at once: a reporter whose collective waits on it fails then, instead of after a
        survivor's wait, and does not name it."""
        try:
            self.notes.mkdir(exist_ok=True)
            (self.notes / f"rank-{self.rank}").write_text(str(os.getpid()))
        except OSError:
            return False
        return True

    def stopped_after_loss(self, peer: Peer) -> bool:
        """True when `peer` left the note that it stopped after a loss."""
        try:
            return (self.notes / f"rank-{peer.rank}").read_text() == str(peer.pid)
        except OSError:
            return False

    def _reporter_peer(self, lost: list[Peer]) -> Peer | None:
        """The lowest surviving rank of this machine, or None when none is left."""
        dead = {peer.rank for peer in lost}
        alive = [peer for peer in self.peers if peer.host == self.host and peer.rank not in dead]
        return min(alive, key=lambda peer: peer.rank) if alive else None


def wait_while_alive(peer: Peer, seconds: float) -> None:
    """Return once `peer`'s process is gone (it has said what it had to), or after `seconds`."""
    deadline = time.monotonic() + seconds
    while not peer.is_gone() and time.monotonic() < deadline:
        time.sleep(0.1)
