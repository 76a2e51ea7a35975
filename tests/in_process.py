"""Commands run in the test's own process, as `training_helpers.run_command` runs them in a new one.

A new interpreter costs 2.5 to 3 CPU-seconds before lowmem does anything (importing torch), so a test that checks
what a command does, not what a process boundary does, calls the command line's `main` here instead: the same
arguments, the same LOWMEM_* test variables (the callbacks and overrides `tests/train_with_faults.py` applies), the
same `sys.argv[0]` (the hints a command prints name the script it was started as), its stdout and stderr captured,
and an uncaught exception turned into exit status 1 with its traceback on stderr, as an interpreter does.

Whatever a command changes of the process is put back after it: the environment, the working directory, the
logging handlers, the signal handlers, the module attributes the test overrides replace, Accelerate's shared state
and torch's compile caches. What stays a subprocess: a run under a launcher, a run that is killed or signalled, and
a run whose process memory a test reads (this process holds more than a command's own interpreter would). The
launcher and ranks of a run under `accelerate launch`, and a run alone that a test kills or signals
(`training_helpers.start_run`), are forks of this worker's fork server (`forked_ranks`, `forked_command`,
fork_server.py) unless the test is marked `own_process` or `machine`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import psutil
    from fork_server import ForkServer

# Set for the tests marked `own_process` (by an autouse fixture of conftest.py): their commands get a process each.
OWN_PROCESS = False
# Set for the tests marked `own_process` or `machine`: the launchers and ranks of their launches are real processes,
# not forks of the worker's fork server (`fork_server.py`).
REAL_PROCESSES = False
_fork_server = None


def forked_ranks(launcher: list[str], script: str, args: list[str]) -> list[str] | None:
    """The launcher's command line with it and its ranks forked by this worker's fork server (started on first use),
    or None when the test needs real processes."""
    if launcher[:2] != ["accelerate", "launch"]:  # another wrapper may change who runs it
        return None
    return forked_command(launcher, script, args)


def forked_command(launcher: list[str] | None, script: str, args: list[str]) -> list[str] | None:
    """`script ARGS` (under `launcher` if any) as a command line whose processes this worker's fork server forks,
    or None when the test needs real processes."""
    server = fork_server()
    return None if server is None else server.command(launcher, script, args)


def fork_server() -> "ForkServer | None":
    """This worker's fork server (started on first use), or None when the test needs real processes."""
    global _fork_server
    if REAL_PROCESSES:
        return None
    if _fork_server is None:
        import tempfile

        from fork_server import ForkServer

        _fork_server = ForkServer(Path(tempfile.mkdtemp(prefix="lowmem-fork-server-")))
    return _fork_server


def forked_for(client: "psutil.Process") -> list["psutil.Process"]:
    """The processes this worker's fork server forked for `client` and for the processes started below it (a
    launcher's ranks): those running in its working directory since it started. Empty for a process of its own."""
    if _fork_server is None:
        return []
    import psutil

    try:
        folder, started = client.cwd(), client.create_time()
        children = psutil.Process(_fork_server.process.pid).children()
    except psutil.Error:
        return []
    forked = []
    for child in children:
        try:
            if child.create_time() >= started and child.cwd() == folder:
                forked.append(child)
        except psutil.Error:  # already gone
            pass
    return forked


def forked_cpu_seconds() -> float:
    """The CPU seconds of the ranks this worker's fork server forked and reaped so far (0 before it starts)."""
    return 0.0 if _fork_server is None else _fork_server.children_cpu_seconds()


def stop_fork_server() -> None:
    """Stop this worker's fork server, if it started (at the end of the session)."""
    global _fork_server
    if _fork_server is not None:
        _fork_server.stop()
        shutil.rmtree(Path(_fork_server.address).parent, ignore_errors=True)
        _fork_server = None
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


@contextlib.contextmanager
def _environment(changes: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _threads(env: dict[str, str]) -> Iterator[None]:
    """torch's compute threads as OMP_NUM_THREADS in `env` sets them for a new process (read at its start: a
    change of the variable alone would not reach this process's torch), put back after."""
    import torch

    saved = torch.get_num_threads()
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def _test_overrides() -> Iterator[None]:
    """What `tests/train_with_faults.py` overrides from LOWMEM_* variables, put back after the command."""
    import fault_injection

    import lowmem.memory.budget as budget
    import lowmem.train.memory_fit as memory_fit

    saved = (budget.memory_budget_bytes, memory_fit.measure_base_bytes, memory_fit.layout_of)
    fault_injection.apply_test_overrides()
    try:
        yield
    finally:
        budget.memory_budget_bytes, memory_fit.measure_base_bytes, memory_fit.layout_of = saved


def _fresh_accelerate_state() -> None:
    """Accelerate's process-wide state as a new interpreter has it: none (a test before may have made one with other
    settings, and Accelerate refuses to change them)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    GradientState._reset_state()


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Signal handlers, sys.argv and Accelerate's and torch's process-wide state as they were before the command;
    the command starts with none of Accelerate's."""
    handlers = {number: signal.getsignal(number) for number in _HANDLED_SIGNALS}
    argv = list(sys.argv)
    _fresh_accelerate_state()
    try:
        yield
    finally:
        sys.argv[:] = argv
        for number, handler in handlers.items():
            signal.signal(number, handler)
        _fresh_accelerate_state()
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        torch._dynamo.reset()


@contextlib.contextmanager
def commands_run_in(folder: Path) -> Iterator[None]:
    """Commands run in-process from `folder` (their launch logs go there), the logging they set up taken down after:
    the console handler a command installs must not print the next tests' log lines."""
    root, cwd = logging.getLogger(), os.getcwd()
    handlers, level = list(root.handlers), root.level
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def run_in_process(argv: list[str], args: list[str], cwd: Path, env: dict[str, str] | None = None
                   ) -> subprocess.CompletedProcess:
    """Run lowmem's command line with `args` in this process, from `cwd`, with `env` added to the environment and
    `sys.argv` set to `argv` (the script a new process would run, then `args`); return it as `subprocess.run` would
    (returncode, stdout, stderr)."""
    from fault_injection import callbacks_from_environment

    from lowmem.cli import main

    env = env or {}
    out, err = io.StringIO(), io.StringIO()
    with _process_state_kept(), _environment(env), _threads(env), commands_run_in(cwd), _test_overrides(), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("default")  # printed on stderr as a fresh interpreter prints them, not recorded
        root = logging.getLogger()
        for handler in list(root.handlers):  # so that the command's console handler is installed, on this stderr
            root.removeHandler(handler)
        sys.argv[:] = argv
        try:
            code = main(list(args), callbacks=callbacks_from_environment())
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except Exception:  # noqa: BLE001 - what an interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
