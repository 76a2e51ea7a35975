"""Finding and reading memory logs back: which files hold the newest run in a folder and the runs it continues
(a resumed run writes new files each time it starts), each rank's records read as far as they go.

The logs are the JSON-lines files of `lowmem.memory.log.MemoryLogger`, one per rank per run. A run killed mid-write
leaves a cut-off last line, and a rank that died early leaves no file or a short one: both are read as far as they
go, with notes saying what was missing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from lowmem.errors import DataError
from lowmem.memory.log import LOG_GLOB, LOG_NAME, parse_log_name, run_id_time
from lowmem.run_files import run_log_dir

MAX_LINES_NAMED = 5  # damaged lines named in a note, then a count


def _runs_in(directory: Path) -> dict[str, list[Path]]:
    """The memory logs in `directory`, grouped by run id."""
    runs: dict[str, list[Path]] = {}
    for file in directory.glob(LOG_GLOB):
        parsed = parse_log_name(file)
        if parsed:
            runs.setdefault(parsed[0], []).append(file)
    return runs


def _run_started(run_id: str, files: list[Path]) -> float:
    """When a run started: from its id when it is a timestamp, else from its files' oldest modification time."""
    started = run_id_time(run_id)
    return started if started is not None else min(file.stat().st_mtime for file in files)


def _by_rank(files: list[Path]) -> list[Path]:
    return sorted(files, key=lambda file: parse_log_name(file)[1])  # type: ignore[index]


def find_run(path: str | Path | None = None, log_dir: str | Path = "logs") -> list[Path]:
    """The memory-log files to read, ordered by rank.

    Args:
        path: None for the newest run in `log_dir`; a directory for the newest run in it; a run id
            (e.g. 20261122-181500) for that run in `log_dir`; or one rank's file for that file alone.
        log_dir: where the trainer writes its logs.
    """
    if path is not None and Path(path).is_file():
        return [Path(path)]
    directory = Path(path) if path is not None and Path(path).is_dir() else Path(log_dir)
    runs = _runs_in(directory) if directory.is_dir() else {}
    if path is not None and not Path(path).is_dir():
        if str(path) in runs:
            return _by_rank(runs[str(path)])
        known = ", ".join(sorted(runs)[-5:]) or "none"
        raise DataError(f"No memory log {path}: it is neither a file, a directory nor a run id in {directory}/ "
                        f"(runs there: {known}).")
    if not runs:
        raise DataError(f"No memory logs in {directory}/: training writes "
                        f"{LOG_NAME.format(run='<run>', rank='<rank>')} there every memory_log_steps steps.")
    return _by_rank(runs[_newest(runs)])


def run_folder_log_dir(path: str | Path | None) -> Path | None:
    """The log folder of a run folder (`<output_dir>/logs/` holding memory logs), or None if `path` is not one."""
    if path is None:
        return None
    logs = run_log_dir(path)
    return logs if logs.is_dir() and _runs_in(logs) else None


def _start_record(files: list[Path]) -> dict[str, Any] | None:
    """A run's start record: the first line of its lowest rank's log that has one (None where none has)."""
    for file in _by_rank(files):
        try:
            with open(file, "rb") as handle:
                record = _parse_line(handle.readline())
        except OSError:
            continue
        if record is not None and record.get("event") == "start":
            return record
    return None


def _continues(files: list[Path]) -> list[str]:
    """The run ids a run's start record says it continues (empty for a run that started fresh)."""
    record = _start_record(files)
    return [str(run) for run in record.get("continues") or []] if record else []


def _newest(runs: dict[str, list[Path]]) -> str:
    """The run started last. Ids are to the second, and a run and its resume can start within one: of the runs
    started in the last second, one that another of them continues is not the newest, and the start records' own
    times order the rest."""
    started = {run: _run_started(run, files) for run, files in runs.items()}
    last = max(started.values())
    tied = [run for run in runs if started[run] == last]
    if len(tied) == 1:
        return tied[0]
    continued = {earlier for run in tied for earlier in _continues(runs[run])}
    tied = [run for run in tied if run not in continued] or tied
    start_time = {run: (_start_record(runs[run]) or {}).get("time") for run in tied}
    return max(tied, key=lambda run: (isinstance(start_time[run], (int, float)), start_time[run] or 0, run))


def find_segments(directory: Path) -> tuple[list[list[Path]], list[str]]:
    """The newest run in `directory` and the runs it continues (a resumed run writes a new log each time it
    starts): their files, oldest segment first, and notes on segments whose logs are missing."""
    runs = _runs_in(directory)
    newest = _newest(runs)
    chain = [*_continues(runs[newest]), newest]
    missing = [run for run in chain if run not in runs]
    notes = [f"segment(s) {', '.join(missing)} of this run have no log in {directory}/"] if missing else []
    return [_by_rank(runs[run]) for run in chain if run in runs], notes


def join_segments(segments: list[dict[int, list[dict[str, Any]]]]) -> tuple[dict[int, list[dict[str, Any]]], int]:
    """One run's records per rank from its segments (oldest first), and the step the last segment started at.

    A segment's records at or after the step the next one resumed from are left out: those steps were trained
    again from the checkpoint, as the curves in TensorBoard show them.
    """
    starts = [min((records[0]["step"] for records in segment.values() if records), default=0) for segment in segments]
    joined: dict[int, list[dict[str, Any]]] = {}
    for index, segment in enumerate(segments):
        until = starts[index + 1] if index + 1 < len(segments) else None
        for rank, records in segment.items():
            kept = [record for record in records if until is None or record["step"] < until]
            joined.setdefault(rank, []).extend(kept)
    return joined, starts[-1]


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    """A record from one line, or None if the line is not a JSON object with an integer step and RSS."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    if not isinstance(record.get("step"), int) or not isinstance(record.get("rss"), int):
        return None
    return record


def _line_list(numbers: list[int]) -> str:
    named = ", ".join(str(number) for number in numbers[:MAX_LINES_NAMED])
    return named + (f" and {len(numbers) - MAX_LINES_NAMED} more" if len(numbers) > MAX_LINES_NAMED else "")


def read_log(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of one rank's log, and notes on anything that could not be read.

    A cut-off last line (the run was killed while writing it) ends the reading there; a damaged line
    elsewhere is skipped. Either way the notes say at which line.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], [f"{path.name}: no such file"]
    if not data.strip():
        return [], [f"{path.name}: empty (no record was written)"]
    lines = data.split(b"\n")
    cut_off = not data.endswith(b"\n")  # the last element is then a partly written line
    if not cut_off:
        lines.pop()
    records: list[dict[str, Any]] = []
    damaged: list[int] = []
    notes: list[str] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        record = _parse_line(raw)
        if record is not None:
            records.append(record)
        elif cut_off and number == len(lines):
            notes.append(f"{path.name}: line {number} is cut off (the run was stopped while writing it); "
                         f"read the {len(records)} records before it")
        else:
            damaged.append(number)
    if damaged:
        notes.insert(0, f"{path.name}: line(s) {_line_list(damaged)} damaged (not a memory record), skipped")
    return records, notes


def read_run(files: Sequence[Path], expect_all_ranks: bool = True) -> tuple[dict[int, list[dict[str, Any]]], list[str]]:
    """Records per rank from a run's files, and notes: damage, ranks without a log, ranks that stopped early.

    Args:
        files: the run's files (from `find_run`).
        expect_all_ranks: note every rank below the logged world size that has no file (off when one
            rank's file was asked for on purpose).
    """
    by_rank: dict[int, list[dict[str, Any]]] = {}
    notes: list[str] = []
    for file in files:
        records, file_notes = read_log(file)
        notes.extend(file_notes)
        parsed = parse_log_name(file)
        rank = parsed[1] if parsed else int(records[0].get("rank", 0)) if records else 0
        by_rank.setdefault(rank, []).extend(records)
    world_sizes: set[Any] = {record.get("world_size") for records in by_rank.values() for record in records}
    world_sizes.discard(None)
    if len(world_sizes) > 1:
        notes.append(f"the files disagree on the number of ranks: {sorted(world_sizes)}")
    if expect_all_ranks and world_sizes:
        for rank in range(max(world_sizes)):
            if rank not in by_rank:
                notes.append(f"rank {rank}: no log (the run had {max(world_sizes)} ranks; this one wrote no file)")
    # A rank without an end record while others have one stopped early (when none has one, the run
    # is still going or was stopped as a whole: nothing to single out).
    ended = {rank for rank, records in by_rank.items() if records and records[-1].get("event") == "end"}
    if ended:
        for rank in sorted(rank for rank, records in by_rank.items() if records and rank not in ended):
            notes.append(f"rank {rank}: no end record while other ranks have one (it stopped early, at step "
                         f"{by_rank[rank][-1]['step']} or soon after)")
    return by_rank, notes
