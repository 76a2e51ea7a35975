"""Helpers for tests that run a function on a few processes joined by a gloo process group."""

from __future__ import annotations

import socket
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nothing listens on now, for a process group's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_on_ranks(rank_main: Callable[..., None], world: int) -> dict[int, Any]:
    """Run `rank_main(rank, port, results)` in `world` processes and return what each put in `results[rank]`."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(free_port(), results), nprocs=world, join=True)
        return dict(results)
