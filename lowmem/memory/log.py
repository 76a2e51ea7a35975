"""The per-rank memory log: one JSON object per line in <output_dir>/logs/memory_<run>_rank<rank>.jsonl."""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from pathlib import Path
from typing import Any, TextIO

from lowmem.memory.phases import PhasePeak
from lowmem.memory.probe import MemorySnapshot, reset_cuda_peak
from lowmem.units import MB

logger = logging.getLogger(__name__)

EVENTS = ("start", "record", "watchdog", "phase", "end")
# Every record has every field, null where a figure does not apply (CUDA on the CPU, USS where denied).
# cuda_peak is the peak since the previous record of the same log (see `MemoryLogger.log`). `continues` is set
# on a resumed run's start record: the ids of the runs it continues, oldest first (memlog joins them). A "phase"
# record ends one occurrence of a phase (load, step, validation, save, export: `lowmem.memory.phases`): `phase`,
# its own peak RSS `phase_high_water` and the memory plan's high-water for it, `phase_planned`.
RECORD_FIELDS = (
    "time", "run", "continues", "rank", "world_size", "epoch", "step", "event",
    "rss", "uss", "workers", "workers_rss", "workers_uss", "sys_available", "budget",
    "cuda_allocated", "cuda_reserved", "cuda_peak", "arrow_bytes", "freed", "rss_high_water",
    "predicted_high_water", "python_objects", "phase", "phase_high_water", "phase_planned",
)
RUN_ID_FORMAT = "%Y%m%d-%H%M%S"  # local time: ids of later runs sort after earlier ones
LOG_NAME = "memory_{run}_rank{rank}.jsonl"  # one file per rank per run
LOG_GLOB = LOG_NAME.format(run="*", rank="*")  # every memory log in a folder
# The same name as a pattern, to read the run id and rank back from a file name.
_LOG_NAME_PATTERN = re.compile(
    "^" + LOG_NAME.replace(".", r"\.").format(run="(?P<run>.+)", rank=r"(?P<rank>\d+)") + "$"
)


def new_run_id(now: float | None = None) -> str:
    """A run id from the local time and 6 random hex digits, e.g. 20261122-181500-3fa9c2: ids of later runs sort
    after earlier ones, and two runs started in the same second (from one folder, or from containers sharing a
    logs/ folder, where process ids repeat) still get two ids."""
    return f"{time.strftime(RUN_ID_FORMAT, time.localtime(now))}-{secrets.token_hex(3)}"


def run_id_time(run_id: str) -> float | None:
    """When the run `run_id` started (seconds since the epoch), read from its timestamp; None for other ids."""
    try:
        return time.mktime(time.strptime(run_id[:15], RUN_ID_FORMAT))
    except ValueError:
        return None


def memory_log_path(log_dir: str | Path, run_id: str, rank: int) -> Path:
    """Where rank `rank` of run `run_id` writes its memory records."""
    return Path(log_dir) / LOG_NAME.format(run=run_id, rank=rank)


def parse_log_name(path: str | Path) -> tuple[str, int] | None:
    """(run id, rank) from a file name like memory_20261122-181500_rank0.jsonl, or None."""
    match = _LOG_NAME_PATTERN.match(Path(path).name)
    return (match["run"], int(match["rank"])) if match else None


def make_record(snapshot: MemorySnapshot, *, run: str, rank: int, world_size: int, epoch: int, step: int,
                event: str, budget: int, freed: int = 0, now: float | None = None,
                predicted_high_water: int | None = None, continues: list[str] | None = None,
                phase: PhasePeak | None = None) -> dict[str, Any]:
    """One memory record (a dict with RECORD_FIELDS, in that order) from a snapshot and where training stands;
    `predicted_high_water` is the memory plan's figure for this process (None when there is no plan); a "phase"
    record carries the `phase` that ended."""
    if event not in EVENTS:
        raise ValueError(f"event must be one of {EVENTS}, not {event!r}")
    figures = snapshot.as_dict()
    context = {"time": time.time() if now is None else now, "run": run, "rank": rank, "world_size": world_size,
               "epoch": epoch, "step": step, "event": event, "budget": budget, "freed": freed,
               "predicted_high_water": predicted_high_water, "continues": continues,
               "phase": None if phase is None else phase.phase,
               "phase_high_water": None if phase is None else phase.peak,
               "phase_planned": None if phase is None else phase.planned}
    return {field: context[field] if field in context else figures[field] for field in RECORD_FIELDS}


def _mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MB:,.0f} MB"


def format_line(record: dict[str, Any]) -> str:
    """The record as one readable line for the training log, figures in MB (MiB)."""
    if record.get("event") == "phase":
        planned = record.get("phase_planned")
        error = "" if not planned else f" ({(record['phase_high_water'] - planned) / planned:+.0%})"
        return (f"memory phase rank {record.get('rank')} step {record.get('step')} | {record.get('phase')}: peak "
                f"{_mb(record.get('phase_high_water'))}" + (f", plan {_mb(planned)}{error}" if planned else ""))
    parts = [f"memory {record.get('event', 'record')} rank {record.get('rank')} epoch {record.get('epoch')} "
             f"step {record.get('step')}"]
    rss, uss = record.get("rss"), record.get("uss")
    parts.append(f"rss {_mb(rss)}" + ("" if uss is None else f" (uss {_mb(uss)})")
                 + ("" if record.get("rss_high_water") is None else f", peak so far {_mb(record['rss_high_water'])}")
                 + ("" if record.get("predicted_high_water") is None
                    else f" (plan {_mb(record['predicted_high_water'])})"))
    if record.get("workers"):
        workers_uss = record.get("workers_uss")
        parts.append(f"{record['workers']} workers rss {_mb(record.get('workers_rss'))}"
                     + ("" if workers_uss is None else f" (uss {_mb(workers_uss)})"))
    budget = record.get("budget")
    if budget and rss is not None:
        parts.append(f"budget share {_mb(budget)} ({100 * rss / budget:.0f}% used)")
    parts.append(f"system available {_mb(record.get('sys_available'))}")
    parts.append(f"arrow {_mb(record.get('arrow_bytes'))}")
    if record.get("cuda_allocated") is not None:
        parts.append(f"cuda allocated {_mb(record['cuda_allocated'])} reserved {_mb(record.get('cuda_reserved'))} "
                     f"peak {_mb(record.get('cuda_peak'))}")
    parts.append(f"cleanup freed {_mb(record.get('freed') or 0)}")
    return " | ".join(parts)


def link_file(target: Path, link_dir: Path) -> Path | None:
    """A symbolic link to `target` in `link_dir`, of the same name (None where the file system refuses one, or
    where `link_dir` is the target's own folder): the run's log stays in its run folder and is still found
    where earlier versions wrote it."""
    link = link_dir / target.name
    try:
        if link_dir.resolve() == target.parent.resolve():
            return None
        link_dir.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target.resolve())
    except OSError:
        return None
    return link


class MemoryLogger:
    """Appends this rank's memory records to its JSON-lines file, one flushed line per record.

    Each record is written with one `write` and flushed at once: a process killed (by the OOM killer, say)
    loses at most the line being written, which the reader recognises and skips. No fsync: the kernel
    keeps what was written when a process dies, and only a host crash would lose more.
    """

    def __init__(self, log_dir: str | Path, run_id: str, rank: int, world_size: int, budget_bytes: int,
                 predicted_high_water: int | None = None, link_dir: str | Path | None = None) -> None:
        """Open `<log_dir>/memory_<run_id>_rank<rank>.jsonl`; `budget_bytes` is this rank's share of the budget,
        `predicted_high_water` the memory plan's figure for this rank (written into every record). With
        `link_dir`, a symbolic link of the same name there points at the file (the launch folder's logs/)."""
        self.run_id, self.rank, self.world_size, self.budget_bytes = run_id, rank, world_size, budget_bytes
        self.predicted_high_water = predicted_high_water
        self.continues: list[str] | None = None  # set by a resume, written into the start record
        self.path = memory_log_path(log_dir, run_id, rank)
        self._file: TextIO | None = None
        self.lost: OSError | None = None  # why the file was given up (a full disk): records then go nowhere
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as error:
            self._give_up(error)
            return
        if link_dir is not None:
            link_file(self.path, Path(link_dir))

    def _give_up(self, error: OSError) -> None:
        """A memory log that cannot be written (a full disk) is given up with one warning: training goes on, and
        the readable memory lines still reach the console and the training log."""
        self.lost = error
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # closing flushes, and the disk is still full
        self._file = None
        logger.warning("The memory log %s cannot be written (%s): training goes on without it. Free space on that "
                       "disk to keep the next run's memory log.", self.path, error)

    def log(self, snapshot: MemorySnapshot, epoch: int, step: int, event: str = "record",
            freed: int = 0, phase: PhasePeak | None = None) -> dict[str, Any]:
        """Write one record from `snapshot` and return it (for `format_line`).

        The CUDA peak is reset after a record that has one, so that each record's `cuda_peak` is the highest
        allocation since the previous record rather than since the start (memlog takes the largest).
        """
        record = make_record(snapshot, run=self.run_id, rank=self.rank, world_size=self.world_size, epoch=epoch,
                             step=step, event=event, budget=self.budget_bytes, freed=freed,
                             predicted_high_water=self.predicted_high_water,
                             continues=self.continues if event == "start" else None, phase=phase)
        if self._file is None and self.lost is None:
            raise ValueError(f"The memory log {self.path} is closed.")
        if self._file is not None:
            try:
                self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
                self._file.flush()
            except OSError as error:
                self._give_up(error)
        if snapshot.cuda_peak is not None:
            reset_cuda_peak()
        return record

    def close(self) -> None:
        """Close the file (records after this raise)."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError as error:  # the last lines could not be flushed
                self._give_up(error)
            self._file = None

    def __enter__(self) -> "MemoryLogger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
