"""A clean stop on a signal, in-process: a second signal exits at once, and the signal handlers are restored
(resumed runs: tests/integration/test_resume_runs.py)."""

from __future__ import annotations

import signal


def test_second_signal_exits_at_once(monkeypatch):
    from lowmem.train import stop as signals

    exits = []
    monkeypatch.setattr(signals.os, "_exit", lambda code: exits.append(code))
    stop = signals.GracefulStop()
    assert not stop.requested
    stop._handle(signal.SIGINT, None)
    assert stop.requested and stop.requested_by == "SIGINT" and exits == []
    stop._handle(signal.SIGINT, None)  # the second: at once, nothing saved or deleted on the way out
    assert exits == [128 + signal.SIGINT]


def test_signal_handlers_are_restored():
    from lowmem.train.stop import GracefulStop

    before = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop().install()
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
