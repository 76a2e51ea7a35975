"""The ranks of one machine compile in turn: the first to reach a graph compiles it, the others load it.

Every rank of a run compiles the same graphs. Left alone, the ranks of a machine compile them at once: each lowers
the graph, generates its kernels and builds them (a C++ compiler on the CPU, Triton on a GPU), so a machine of three
ranks pays three times the CPU and holds three compilers' memory at the same moment. Here inductor's inner
compilation, the step its FX graph cache answers, takes a file lock shared by the run's ranks on this machine: the
first rank compiles and writes the cache, the next finds the graph there and loads it in a fraction of the time.

No collective runs while the lock is held (compiling a graph communicates with no rank), so a rank waiting for the
lock never waits for a rank that waits for it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import inspect
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def turn_lock_path(environ: dict[str, str] | None = None) -> Path | None:
    """The lock file of this run's ranks on this machine, or None when this machine runs one rank of it.

    Named after the run's rendezvous (address, port and the launcher's run id), which every rank of the run shares
    and another run on the machine does not."""
    if environ is None:
        environ = {name: os.environ.get(name, "") for name in ("LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                              "TORCHELASTIC_RUN_ID")}
    if int(environ.get("LOCAL_WORLD_SIZE") or 1) <= 1:
        return None
    run = "|".join(environ.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
    return Path(tempfile.gettempdir()) / f"lowmem-compile-{hashlib.sha1(run.encode()).hexdigest()[:16]}.lock"


@contextlib.contextmanager
def machine_turn(lock_path: Path) -> Iterator[None]:
    """Hold the run's compile lock on this machine for the duration of the block."""
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile_in_turn(inner_compile: Any, lock_path: Path, *args: Any, **kwargs: Any) -> Any:
    with machine_turn(lock_path):
        return inner_compile(*args, **kwargs)


class _InductorInTurn(torch._TorchCompileInductorWrapper):
    """torch.compile's inductor backend (mode and options applied as torch applies them), whose inner compilation
    of each forward and backward graph takes the machine's turn."""

    def __init__(self, mode: str | None, dynamic: bool | None, lock_path: Path) -> None:
        super().__init__(mode, None, dynamic)
        self.lock_path = lock_path

    def __call__(self, model_: Any, inputs_: Any, *, config_patches: dict[str, Any] | None = None) -> Any:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        extra: dict[str, Any] = {}
        if "compile_region_name" in inspect.signature(compile_fx).parameters:
            extra["compile_region_name"] = getattr(self, "name", None)
        return compile_fx(model_, inputs_, inner_compile=functools.partial(_compile_in_turn, compile_fx_inner,
                                                                           self.lock_path),
                          config_patches={**self.config, **(config_patches or {})}, **extra)


def inductor_backend(mode: str | None, dynamic: bool | None) -> Any:
    """What to give torch.compile as inductor: the backend that compiles in turn when this machine runs several
    ranks of the run (and torch has the backend class it builds on), else the name "inductor"."""
    lock_path = turn_lock_path()
    if lock_path is None or not hasattr(torch, "_TorchCompileInductorWrapper"):
        return "inductor"
    # The lock file goes with the run: a rank that still compiles keeps its lock, and one that opens the name anew
    # only compiles beside it, as without turns.
    atexit.register(lock_path.unlink, missing_ok=True)
    return _InductorInTurn(mode, dynamic, lock_path)
