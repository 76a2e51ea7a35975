"""A first day with lowmem, the commands run as a user runs them: no progress bar in a pipe, one on a terminal
unless turned off, and one format for every log line."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from training_helpers import run_command, tiny_overrides, write_chat_rows

pytestmark = pytest.mark.own_process  # what a user's process prints on its own stderr, a pipe


# The one format: date and time, level, rank, message (lowmem.log_format).
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) \[rank \d+\] \S")
PYTHON_WARNING = re.compile(r"\S+:\d+: \w*Warning: ")


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory) -> SimpleNamespace:
    """The stderr of the tokenizer command and then of a 6-step training, each run as a user runs it (into a
    pipe), with their folder and flags."""
    folder = tmp_path_factory.mktemp("first_day")
    overrides = tiny_overrides(folder, write_chat_rows(folder / "train.parquet", 200, seed=1),
                               write_chat_rows(folder / "valid.parquet", 30, seed=2))
    tokenizer = run_command(["tokenizer", *overrides], cwd=folder)
    assert tokenizer.returncode == 0, tokenizer.stderr[-3000:]
    train = run_command(["train", *overrides, "--max_steps=6"], cwd=folder)
    assert train.returncode == 0, train.stderr[-3000:]
    return SimpleNamespace(folder=folder, overrides=overrides, tokenizer=tokenizer.stderr, train=train.stderr)


PROGRESS_BAR = re.compile(r"train: +\d+%\|")


def test_no_progress_bar_in_a_pipe(first_runs):
    # Read as text, a bar's carriage returns come back as line ends: the bar itself is looked for.
    assert "step 6/6 |" in first_runs.train
    assert not PROGRESS_BAR.search(first_runs.train) and "step/s]" not in first_runs.train, first_runs.train


def _stderr_on_a_terminal(command: list[str], cwd: Path) -> str:
    """Run `command` with its stderr on a pseudo-terminal, as in an interactive shell; what it wrote there."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import termios
    import threading

    main_end, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new one is 0 columns wide
    chunks: list[bytes] = []

    def drain() -> None:  # read as it comes: a full terminal buffer would block the writer
        while True:
            try:
                chunk = os.read(main_end, 65536)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        done = subprocess.run(command, cwd=cwd, stderr=terminal, stdout=subprocess.DEVNULL, timeout=600, check=False)
    finally:
        os.close(terminal)
        reader.join(timeout=30)
        os.close(main_end)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert done.returncode == 0, text[-3000:]
    return text


@pytest.mark.parametrize("progress", [True, False])
def test_the_progress_bar_on_a_terminal_unless_turned_off(first_runs, progress):
    from training_helpers import command_line as script_command

    flags = [*first_runs.overrides, f"--output_dir={first_runs.folder / f'run-{progress}'}", "--max_steps=3",
             f"--progress={progress}"]
    text = _stderr_on_a_terminal(script_command(["train", *flags]), first_runs.folder)
    assert "step 3/3 |" in text
    assert bool(PROGRESS_BAR.search(text)) == progress, text[-3000:]


def test_every_log_line_has_the_one_format(first_runs):
    tokenizer, train = first_runs.tokenizer, first_runs.train
    assert "training the tokenizer on" in tokenizer and "Training:" in train
    for output in (tokenizer, train):
        for line in output.splitlines():
            if line and not line[0].isspace() and not PYTHON_WARNING.match(line):  # indented: a message's next lines
                assert LOG_LINE.match(line), line
