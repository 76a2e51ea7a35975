"""When a rank dies, in-process: the lowest surviving rank names the dead one at once; a survivor that does not report
notes that it stops, so that the reporter, checking after it has gone, does not count it among the dead (or, where
the note cannot be written, stays alive a moment first). The 3-process runs: tests/integration/test_rank_death.py."""

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


def _me(rank: int) -> Peer:
    return Peer(rank=rank, pid=os.getpid(), host=socket.gethostname(), started=psutil.Process().create_time())


@pytest.mark.parametrize("own_rank", [0, 1])
def test_only_the_lowest_survivor_reports_and_the_others_note_that_they_stop(monkeypatch, caplog, tmp_path, own_rank):
    watch = PeerWatch(own_rank, sorted([_me(own_rank), _alive_peer(1 - own_rank), _gone_peer(2)],
                                       key=lambda peer: peer.rank))
    watch.notes = tmp_path / "notes"
    waits: list[tuple[int, float]] = []
    monkeypatch.setattr(peers_module, "wait_while_alive", lambda peer, seconds: waits.append((peer.rank, seconds)))
    with caplog.at_level(logging.ERROR), pytest.raises(ProcessLostError):
        watch.check(RuntimeError("Connection closed by peer"))
    assert waits == []
    if own_rank == 0:  # the reporter: one line naming rank 2 alone
        assert "Rank 2 (PID" in caplog.text and "rank 1" not in caplog.text
    else:  # a survivor that does not report: silent, with its note left for the reporter
        assert caplog.text == "" and (watch.notes / "rank-1").read_text() == str(os.getpid())


def test_a_survivor_gone_before_the_reporter_checks_is_not_named_among_the_dead(monkeypatch, caplog, tmp_path):
    """Rank 1 saw the loss first and left; rank 0's collective, which waited on rank 1, failed only then: rank 0
    finds ranks 1 and 2 gone, and names rank 2 alone because rank 1 left its note."""
    survivor, killed = _gone_peer(1), _gone_peer(2)
    peers = [_me(0), survivor, killed]
    reporter, noted = PeerWatch(0, peers), PeerWatch(1, peers)
    assert reporter.notes == noted.notes  # the ranks of a run agree on the folder
    reporter.notes = noted.notes = tmp_path / "notes"
    with monkeypatch.context() as patch:  # rank 1's own process wrote it
        patch.setattr(peers_module.os, "getpid", lambda: survivor.pid)
        assert noted.note_stopping()
    with caplog.at_level(logging.ERROR), pytest.raises(ProcessLostError):
        reporter.check(RuntimeError("Connection closed by peer"))
    assert "Rank 2 (PID" in caplog.text and "rank 1" not in caplog.text and "so did the ranks" not in caplog.text
    assert not reporter.notes.exists()  # the reporter cleans the notes up


def test_a_survivor_whose_note_cannot_be_written_stays_until_the_reporter_has_gone(monkeypatch, caplog, tmp_path):
    watch = PeerWatch(1, [_alive_peer(0), _me(1), _gone_peer(2)])
    (tmp_path / "file").write_text("")
    watch.notes = tmp_path / "file" / "notes"  # under a file: cannot be made
    waits: list[tuple[int, float]] = []
    monkeypatch.setattr(peers_module, "wait_while_alive", lambda peer, seconds: waits.append((peer.rank, seconds)))
    with caplog.at_level(logging.ERROR), pytest.raises(ProcessLostError):
        watch.check(RuntimeError("Connection closed by peer"))
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
