"""When a rank dies, in-process: the lowest surviving rank names the dead one at once, and a survivor that does not
report stays alive a moment first, so that the reporter, checking after it, does not count it among the dead (the
3-process runs: tests/integration/test_rank_death.py)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import psutil
import pytest

from lowmem.distributed import peers as peers_module
from lowmem.distributed.peers import Peer, PeerWatch, ProcessLostError


def _gone_peer(rank: int) -> Peer:
    """A rank whose process has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(child.pid).create_time()
    child.wait()
    return Peer(rank=rank, pid=child.pid, host=socket.gethostname(), started=started)


def _alive_peer(rank: int) -> Peer:
    parent = psutil.Process(os.getppid())
    return Peer(rank=rank, pid=parent.pid, host=socket.gethostname(), started=parent.create_time())


@pytest.mark.parametrize("own_rank", [0, 1])
def test_only_the_lowest_survivor_reports_and_the_others_wait_before_they_stop(monkeypatch, caplog, own_rank):
    me = Peer(rank=own_rank, pid=os.getpid(), host=socket.gethostname(), started=psutil.Process().create_time())
    other = _alive_peer(1 - own_rank)
    watch = PeerWatch(own_rank, sorted([me, other, _gone_peer(2)], key=lambda peer: peer.rank))
    waits: list[tuple[int, float]] = []
    monkeypatch.setattr(peers_module, "wait_while_alive", lambda peer, seconds: waits.append((peer.rank, seconds)))
    with caplog.at_level(logging.ERROR), pytest.raises(ProcessLostError):
        watch.check(RuntimeError("Connection closed by peer"))
    if own_rank == 0:  # the reporter: one line naming rank 2 alone, no wait
        assert "Rank 2 (PID" in caplog.text and "rank 1" not in caplog.text and waits == []
    else:  # a survivor that does not report: silent, and alive until the reporter (rank 0) has gone
        assert caplog.text == "" and waits == [(0, peers_module.SURVIVOR_WAIT_SECONDS)]


def test_waiting_for_a_peer_ends_when_it_is_gone_or_at_the_limit(monkeypatch):
    clock = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(peers_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(peers_module.time, "sleep", sleep)
    peers_module.wait_while_alive(_gone_peer(0), 5.0)
    assert sleeps == []  # gone already: no wait
    peers_module.wait_while_alive(_alive_peer(0), 1.0)
    assert 9 <= len(sleeps) <= 11 and clock[0] >= 1.0  # alive: polled until the limit
