"""The one format of lowmem's log lines, before training and during it, on the console and in the log files:

    2025-01-31 14:02:07 INFO [rank 0] Resumed from model_save/demo/checkpoint-500: epoch 1, step 500, ...

The rank says which process wrote a line, when several write to one console. This module imports nothing
heavy, so that the command line can set the format up before it knows which command runs.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s [rank {rank}] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def log_formatter(rank: int) -> logging.Formatter:
    """The formatter of every log line of process `rank`."""
    return logging.Formatter(LOG_FORMAT.format(rank=rank), datefmt=DATE_FORMAT)


def launch_rank() -> int:
    """This process's rank as its launcher set it (`accelerate launch`, torchrun: RANK), before Accelerate
    starts; 0 for a process started alone."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def console_handler() -> logging.Handler:
    """Lines on stderr in the one format, for the commands' own lines before training (training replaces it
    with its own handler, which writes above the progress bar, in the same format)."""
    console = logging.StreamHandler()
    console.setFormatter(log_formatter(launch_rank()))
    return console


class LogFileHandler(logging.FileHandler):
    """A log file that a full disk (or a lost permission) cannot turn into a crash or into a traceback per line:
    the first failed write warns once, on stderr, and the file is given up; the console keeps every line."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, encoding="utf-8")
        self.given_up = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.given_up:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.given_up = True
        try:
            self.close()
        except OSError:
            pass  # closing flushes, and the disk is still full
        warn_log_lost(self.baseFilename, error)


def warn_log_lost(path: str | Path, error: BaseException) -> None:
    """One line on stderr: a log file cannot be written (and is given up); training goes on."""
    print(f"WARNING: the log file {path} cannot be written ({error}); training goes on, and its lines from here on "
          "are only on the console. Free space on that disk (or fix its permissions) to keep the next run's log.",
          file=sys.stderr, flush=True)


def open_log_file(path: str | Path, formatter: logging.Formatter) -> logging.Handler | None:
    """A `LogFileHandler` appending to `path` (its folder made), or None with one warning when it cannot be
    opened: a log that cannot be written never stops a run."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        handler = LogFileHandler(path)
    except OSError as error:
        warn_log_lost(path, error)
        return None
    handler.setFormatter(formatter)
    return handler


class DoublingCount:
    """A running count that a warning says at its first and then each time it has doubled: often enough to be seen,
    never a line per step."""

    def __init__(self) -> None:
        self.total = 0
        self.said = 0

    def add(self, count: int) -> bool:
        """Add `count`; True when the total is now to be said."""
        self.total += count
        if self.total == 0 or self.total < 2 * self.said:
            return False
        self.said = self.total
        return True
