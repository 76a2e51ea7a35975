"""The training log: readable lines on the console and in logs/chat_trainer_low_mem_YYYYMMDD.log."""

from __future__ import annotations

import datetime as dt
import logging
import sys
from pathlib import Path

from tqdm import tqdm

LOG_FORMAT = "%(asctime)s %(levelname)s [rank {rank}] %(message)s"


class _AllRanksFilter(logging.Filter):
    """On ranks other than the main one, let through warnings and records logged with extra={"all_ranks": True}."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or getattr(record, "all_ranks", False)


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - a log line must never stop training
            self.handleError(record)


def training_log_path(log_dir: str | Path = "logs", today: dt.date | None = None) -> Path:
    """The day's human-readable training log file."""
    today = today or dt.date.today()
    return Path(log_dir) / f"chat_trainer_low_mem_{today:%Y%m%d}.log"


def setup_training_log(rank: int, is_main: bool, log_dir: str | Path = "logs") -> Path:
    """Console on every rank (others only warnings), and the log file from the main rank; returns its path."""
    path = training_log_path(log_dir)
    formatter = logging.Formatter(LOG_FORMAT.format(rank=rank), datefmt="%Y-%m-%d %H:%M:%S")
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_lowmem", False) or isinstance(handler, logging.StreamHandler):
            root.removeHandler(handler)
    console = _TqdmHandler()
    console.setLevel(logging.INFO)
    if not is_main:
        console.addFilter(_AllRanksFilter())
    handlers: list[logging.Handler] = [console]
    if is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path, encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
        handler._lowmem = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path
