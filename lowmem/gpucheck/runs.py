"""Starting the commands a check runs (train, bench_train, under `accelerate launch` or not) and reading what
they logged: each step's loss, the checkpoint a resume started from."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

STEP_LINE = re.compile(r"step (\d+)/\d+ \| epoch \d+ \| loss ([\d.]+)")
RESUMED_LINE = re.compile(r"Resumed from \S*checkpoint-(\d+):")
# The line an uncaught exception ends its traceback with, as a rank prints it ("[rank0]: RuntimeError: ...") or alone.
EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?\w*(?:Error|Exception)\b:.*)$")


class StageFailed(Exception):
    """A check that did not hold: the message is the FAIL line's reason."""


class StageSkipped(Exception):
    """A check that cannot run here: the message is the SKIP line's reason."""


@dataclass
class Deadline:
    """A stage's time budget: each command it starts gets what is left of it."""

    seconds: float
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        left = self.seconds - (time.monotonic() - self.started)
        if left <= 0:
            raise StageFailed(f"ran past the stage's {self.seconds:.0f} s")
        return left


@dataclass
class Finished:
    """A command that ran to its end: exit code, output and the losses it logged by step."""

    returncode: int
    stdout: str
    stderr: str
    losses: dict[int, float]

    def tail(self, lines: int = 6) -> str:
        """The end of its stderr, to quote in a FAIL line (see `failure_summary`)."""
        return failure_summary(self.stderr, lines)


def failure_summary(stderr: str, lines: int = 6) -> str:
    """The last `lines` lines of a command's stderr, to quote in a FAIL line, led by the exception a rank raised.

    Under `accelerate launch` the launcher's own report of the failed child (a ChildFailedError and its table of
    ranks) comes after the rank's traceback and fills the end of stderr; the rank's exception line is what says why.
    """
    stripped = [line.strip() for line in stderr.strip().splitlines()]
    end = stripped[-lines:]
    raised = [match.group(1) for line in stripped if (match := EXCEPTION_LINE.match(line))
              and "ChildFailedError" not in match.group(1)]
    lead = [raised[0]] if raised and not any(raised[0] in line for line in end) else []
    return " | ".join(lead + end)


def lowmem_command(args: list[str], launcher: list[str] | None = None) -> list[str]:
    """`python -m lowmem ARGS`, or `accelerate launch [...] -m lowmem ARGS`: the installed package either way,
    as a user runs it."""
    if launcher is None:
        return [sys.executable, "-m", "lowmem", *args]
    return [sys.executable, "-m", "accelerate.commands.launch", *launcher, "-m", "lowmem", *args]


def losses_in(text: str) -> dict[int, float]:
    """Each step's loss from the one-line-per-step log (the last line of a step wins)."""
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(text)}


def run(command: list[str], cwd: Path, env: dict[str, str], deadline: Deadline) -> Finished:
    """Run a command to its end within the stage's time (killed with its children past it)."""
    process = subprocess.Popen(command, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=deadline.left())
    except subprocess.TimeoutExpired:
        _kill_group(process)
        process.communicate()
        raise StageFailed(f"`{' '.join(command[-6:])}` ran past the stage's {deadline.seconds:.0f} s") from None
    return Finished(process.returncode, stdout, stderr, losses_in(stderr))


def run_and_kill_after(command: list[str], cwd: Path, env: dict[str, str], deadline: Deadline,
                       step: int) -> str:
    """Run a training command and SIGKILL it, launcher and ranks together (as the OOM killer or a scheduler
    ends a job), once it has logged `step`; return what it logged. Fails when it ends before that step."""
    process = subprocess.Popen(command, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        for line in process.stderr:  # type: ignore[union-attr]
            seen.append(line)
            match = STEP_LINE.search(line)
            if match and int(match.group(1)) >= step:
                break
            deadline.left()
        else:
            process.wait()
            raise StageFailed(f"the run ended (exit code {process.returncode}) before step {step}: "
                              + failure_summary("".join(seen)))
    finally:
        _kill_group(process)
        process.wait()
    return "".join(seen)


def resumed_from(text: str) -> int | None:
    """The step of the checkpoint a run said it resumed from, or None."""
    match = RESUMED_LINE.search(text)
    return int(match.group(1)) if match else None


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL a command and every process below it (torch's launcher starts its ranks in sessions of their
    own, which a signal to the command's process group would miss)."""
    import psutil

    try:
        parent = psutil.Process(process.pid)
        family = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for member in family:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def fresh_folder(folder: Path) -> Path:
    """An empty folder for one run (a check run again starts over; `check` makes sure the check's folder holds
    nothing but its own runs)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder
