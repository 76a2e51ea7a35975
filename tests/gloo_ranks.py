"""Helpers for tests that run a function on a few processes joined by a gloo process group.

The ranks are forked from a server process that imported torch, torch.distributed and the lowmem modules the rank
functions use once, for the whole pytest worker (multiprocessing's "forkserver" start method, with those modules
preloaded), instead of interpreters that each import them again as `torch.multiprocessing.spawn` starts them (3 to
4 CPU-seconds a rank on the 2-core machine). The server holds no thread and no process group, so a fork of it is as
clean as a new interpreter; each rank takes the test's environment as it is when the ranks start, as a spawned one
would."""

from __future__ import annotations

import multiprocessing
import os
import socket
from typing import Any, Callable

import torch.multiprocessing as mp

# What the rank functions import, loaded once in the server (a module missing here is skipped by the server).
PRELOADED = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo", "accelerate",
             "lowmem.model", "lowmem.train.trainer", "lowmem.distributed.strategy", "lowmem.distributed.accelerator",
             "lowmem.distributed.collectives", "lowmem.eval.validation", "lowmem.tokenization.text_tokenizer",
             "training_helpers", "trainer_fixtures", "gloo_ranks")


def free_port() -> int:
    """A TCP port nothing listens on now, for a process group's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_ranks(rank_main: Callable[..., None], args: tuple[Any, ...], world: int) -> None:
    """Run `rank_main(rank, *args)` in `world` processes forked from the preloaded server, and wait for them: a rank
    that raises fails the call with its traceback, as `torch.multiprocessing.spawn` does."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOADED))
    mp.start_processes(_in_environment, args=(dict(os.environ), rank_main, *args), nprocs=world, join=True,
                       start_method="forkserver")


def _in_environment(rank: int, environment: dict[str, str], rank_main: Callable[..., None], *args: Any) -> None:
    """The rank in the environment the test had when it started the ranks (the server's is the one it started
    with)."""
    os.environ.clear()
    os.environ.update(environment)
    rank_main(rank, *args)


def run_on_ranks(rank_main: Callable[..., None], world: int) -> dict[int, Any]:
    """Run `rank_main(rank, port, results)` in `world` processes and return what each put in `results[rank]`."""
    with mp.Manager() as manager:
        results = manager.dict()
        start_ranks(rank_main, (free_port(), results), world)
        return dict(results)
