"""The one format of lowmem's log lines, before training and during it, on the console and in the log files:

    2025-01-31 14:02:07 INFO [rank 0] Resumed from model_save/demo/checkpoint-500: epoch 1, step 500, ...

The rank says which process wrote a line, when several write to one console. This module imports nothing
heavy, so that the command line can set the format up before it knows which command runs.
"""

from __future__ import annotations

import logging
import os

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
