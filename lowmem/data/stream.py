"""ParquetStream: rows of parquet files, shuffled and sharded, in bounded memory, with exact resume."""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
from torch.utils.data import IterableDataset, get_worker_info

from lowmem.data.plan import EpochPlan, Piece, consumer_range
from lowmem.data.reader import RowGroupReader
from lowmem.data.sources import DEFAULT_COLUMNS, FileSpec, build_row_group_index, warn_large_row_groups
from lowmem.errors import DataError
from lowmem.memory import MemoryBudget, release_arrow_memory

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
# Rows turned into Python objects at a time: keeps the peak of Python strings well below the window's.
_CONVERT_ROWS = 1024
# By default a row group is "too large" above this fraction of the host's memory budget.
LARGE_ROW_GROUP_FRACTION = 1 / 200

Position = list  # [window, rows emitted from it, rows skipped so far this epoch]


class ParquetStream(IterableDataset):
    """An iterable over the rows of parquet files, as dicts `{column: str}`, in bounded memory.

    Args:
        files: a path, a glob, a directory (every *.parquet below it), or a list of them.
        columns: the text columns to read; every file must have them, as strings.
        buffer_size: rows in the shuffle buffer. Each consumer emits its rows in windows of this many
            rows, each window in a random order; memory holds one window plus one row group.
        shuffle: permute row groups, rows within a row group, and rows within a window, anew each
            epoch. False gives file order.
        seed: the seed of every permutation; the order is a pure function of (files, seed, epoch,
            number of consumers).
        rank, world_size: this process's place among the training processes.
        ultra_low_mem: reopen the file for every row group and release Arrow's pool after it. None
            decides from the memory budget: on when the host has less than `ultra_low_mem_threshold_gb`.
        ultra_low_mem_threshold_gb: the budget below which `ultra_low_mem=None` turns the mode on.
        large_row_group_bytes: row groups above this uncompressed size get a warning with the repack
            command; None means 1/200 of the memory budget.
        num_workers: DataLoader workers per rank that will read this stream (0 = read in the training
            process). Only `len()` needs it before iterating; `StreamLoader` sets it.
        drop_remainder: True (training) gives every consumer exactly `total_rows // consumers` rows and
            leaves the few others out; False (evaluation) reads every row exactly once, the first
            `total_rows % consumers` consumers taking one row more.
        max_rows: read only the first `max_rows` rows of each epoch's sequence (of the file order when
            not shuffling), e.g. the first validation prompts to score.

    Each consumer (a rank, or a DataLoader worker of a rank) yields exactly `total_rows // consumers`
    rows per epoch, minus rows with a null or empty value, which are skipped and counted.
    """

    def __init__(
        self,
        files: FileSpec,
        columns: Sequence[str] = DEFAULT_COLUMNS,
        buffer_size: int = 5000,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        ultra_low_mem: bool | None = None,
        ultra_low_mem_threshold_gb: float = 15.0,
        large_row_group_bytes: int | None = None,
        num_workers: int = 0,
        drop_remainder: bool = True,
        max_rows: int | None = None,
    ):
        super().__init__()
        _check_arguments(columns, buffer_size, rank, world_size, num_workers)
        self.columns = tuple(columns)
        self.buffer_size = int(buffer_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.num_workers = int(num_workers)
        self.drop_remainder = bool(drop_remainder)
        self.max_rows = None if max_rows is None else int(max_rows)
        self.index = build_row_group_index(files, self.columns)

        budget = MemoryBudget.detect() if ultra_low_mem is None or large_row_group_bytes is None else None
        self.ultra_low_mem = budget.is_low(ultra_low_mem_threshold_gb) if ultra_low_mem is None else bool(ultra_low_mem)
        self.large_row_group_bytes = (
            int(budget.total_bytes * LARGE_ROW_GROUP_FRACTION) if large_row_group_bytes is None else int(large_row_group_bytes)
        )
        if self.rank == 0:
            warn_large_row_groups(self.index, self.large_row_group_bytes)

        self.epoch = 0
        self._resume: dict[int, Position] = {}  # loaded positions not yet picked up by an iteration
        self._positions_consumers: int | None = None  # consumer count of the loaded or running positions
        self._live: dict[int, _Cursor] = {}  # positions of the iterations running in this process
        self._reader: RowGroupReader | None = None
        # DataLoader worker w reads consumer (w + worker_rotation) % workers of this rank. A resumed loader
        # rotates so that its worker 0 reads the consumer whose batch was due next.
        self.worker_rotation = 0

    # ----- size and epochs ------------------------------------------------------------------------
    @property
    def workers_per_rank(self) -> int:
        return max(1, self.num_workers)

    @property
    def num_consumers(self) -> int:
        return self.world_size * self.workers_per_rank

    def plan(self, num_consumers: int | None = None) -> EpochPlan:
        """This epoch's plan for `num_consumers` consumers (default: ranks × workers per rank)."""
        return EpochPlan(self.index.rows, self.seed, self.epoch, num_consumers or self.num_consumers, self.shuffle,
                         self.drop_remainder, self.max_rows)

    def rank_consumer_rows(self) -> list[int]:
        """Rows per epoch of each of this rank's consumers (before null or empty values are skipped)."""
        # Counting needs only the total, not the epoch's order: no plan is built.
        total = self.index.num_rows if self.max_rows is None else min(self.index.num_rows, self.max_rows)
        first = self.rank * self.workers_per_rank
        ranges = (consumer_range(consumer, self.num_consumers, total, self.drop_remainder)
                  for consumer in range(first, first + self.workers_per_rank))
        return [stop - start for start, stop in ranges]

    def __len__(self) -> int:
        """Rows this rank yields per epoch (before rows with null or empty values are skipped)."""
        return sum(self.rank_consumer_rows())

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows. A loaded position is for its own epoch only."""
        if epoch != self.epoch:
            self._resume, self._live, self._positions_consumers = {}, {}, None
            self.worker_rotation = 0
        self.epoch = int(epoch)

    @property
    def rows_decoded(self) -> int:
        """Rows decoded from parquet by this process's reader (the cost of reading, resumes included)."""
        return self._reader.rows_decoded if self._reader is not None else 0

    @property
    def skipped_rows(self) -> int:
        """Rows skipped this epoch for a null or empty value, by the iterations in this process."""
        return sum(cursor.skipped for cursor in self._live.values())

    # ----- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: small and JSON-serialisable, valid at any point of an iteration.

        It holds the epoch, seeds, a fingerprint of the data and one `[window, emitted, skipped]` per
        consumer of this rank, never rows. With DataLoader workers the positions live in the worker
        processes: use `StreamLoader.state_dict()` there.
        """
        live = {consumer: cursor.as_list() for consumer, cursor in self._live.items()}
        return self.state_with_positions({**self._resume, **live})

    def state_with_positions(self, positions: dict[int, Position]) -> dict[str, Any]:
        """The state dict of this stream with the given consumer positions."""
        return {
            "format": STATE_FORMAT,
            "data": self.index.fingerprint,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "buffer_size": self.buffer_size,
            "epoch": self.epoch,
            "rank": self.rank,
            "world_size": self.world_size,
            "workers_per_rank": (self._positions_consumers or self.num_consumers) // self.world_size,
            "consumers": {str(consumer): list(position) for consumer, position in sorted(positions.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: the next iteration yields exactly the rest of that epoch."""
        _check_state_matches(self, state)
        self.epoch = int(state["epoch"])
        self._resume = {int(consumer): [int(v) for v in position] for consumer, position in state["consumers"].items()}
        saved_workers = int(state["workers_per_rank"])
        self._positions_consumers = self.world_size * saved_workers
        if self.workers_per_rank != saved_workers:
            self.num_workers = saved_workers
        self._live = {}

    def forget_loaded_positions(self) -> None:
        """Drop loaded positions not yet picked up here (DataLoader workers took their own copies)."""
        self._resume = {}

    def position_of(self, consumer: int) -> Position:
        """A copy of one consumer's current position (for consumers iterating in this process)."""
        return self._live[consumer].as_list()

    # ----- iteration ------------------------------------------------------------------------------
    def current_consumer(self) -> tuple[int, int]:
        """(consumer id, number of consumers) of the calling process or DataLoader worker."""
        info = get_worker_info()
        workers, worker_id = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + (worker_id + self.worker_rotation) % workers, self.world_size * workers

    def __iter__(self) -> Iterator[dict[str, str]]:
        consumer, num_consumers = self.current_consumer()
        if self._resume and self._positions_consumers != num_consumers:
            raise DataError(
                f"The saved data position was made with {self._positions_consumers // self.world_size} "
                f"DataLoader worker(s) per rank, but this run reads with {num_consumers // self.world_size}. "
                "Resume with the same num_workers (and number of processes) to continue exactly."
            )
        plan = self.plan(num_consumers)
        cursor = _Cursor(*self._resume.pop(consumer, [0, 0, 0]))
        self._live[consumer] = cursor
        self._positions_consumers = num_consumers
        return self._iter_rows(plan, consumer, cursor)

    def _get_reader(self) -> RowGroupReader:
        if self._reader is None:
            self._reader = RowGroupReader(self.index, ultra_low_mem=self.ultra_low_mem)
        return self._reader

    def _iter_rows(self, plan: EpochPlan, consumer: int, cursor: "_Cursor") -> Iterator[dict[str, str]]:
        groups = _GroupCache(self._get_reader(), plan, self.ultra_low_mem)
        num_windows = plan.num_windows(consumer, self.buffer_size)
        while cursor.window < num_windows:
            window, emitted = cursor.window, cursor.emitted
            rows, skipped = self._build_window(plan, consumer, window, groups)
            if emitted == 0:  # a window resumed part-way was counted before the save
                cursor.skipped += skipped
            for start in range(emitted, rows.num_rows, _CONVERT_ROWS):
                chunk = rows.slice(start, _CONVERT_ROWS).to_pylist()
                # `yield from` a list iterator costs far less per row than a Python loop, and the
                # cursor reads its position from the iterator when asked.
                yield from cursor.follow(start, chunk)
            del rows
            cursor.next_window()
        groups.clear()
        if cursor.skipped:
            logger.warning(
                "Skipped %d rows with a null or empty %s value in epoch %d (rank %d, consumer %d of %d).",
                cursor.skipped, "/".join(self.columns), self.epoch, self.rank, consumer, plan.num_consumers,
            )

    def _build_window(self, plan: EpochPlan, consumer: int, window: int, groups: "_GroupCache") -> tuple[pa.Table, int]:
        """The window's rows in emission order, without null or empty values, and how many were dropped."""
        start, stop = plan.window_range(consumer, window, self.buffer_size)
        parts = [groups.piece(piece) for piece in plan.pieces(start, stop)]
        table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        kept = _keep_mask(table)
        skipped = 0
        if kept is not None:
            table = table.filter(kept)
            skipped = (stop - start) - table.num_rows
        order = plan.rows_in_window(consumer, window, table.num_rows)
        if order is not None:
            table = table.take(order)
        return table, skipped

    def close(self) -> None:
        """Close open files (iteration reopens them as needed)."""
        if self._reader is not None:
            self._reader.close()

    def __getstate__(self) -> dict[str, Any]:
        # Sent to DataLoader workers: open file handles and live positions stay behind.
        state = self.__dict__.copy()
        state["_reader"] = None
        state["_live"] = {}
        return state


class _Cursor:
    """One consumer's position: window, rows emitted from it, rows skipped so far this epoch.

    While rows of a converted chunk are being handed out, the emitted count is derived from the chunk's
    list iterator (rows left in it), so the hot loop does no bookkeeping per row.
    """

    def __init__(self, window: int = 0, emitted: int = 0, skipped: int = 0):
        self.window, self.skipped = window, skipped
        self._base, self._chunk_len, self._rows_left = emitted, 0, None

    def follow(self, start: int, chunk: list) -> Iterator:
        rows = iter(chunk)
        self._base, self._chunk_len, self._rows_left = start, len(chunk), rows.__length_hint__
        return rows

    @property
    def emitted(self) -> int:
        if self._rows_left is None:
            return self._base
        return self._base + self._chunk_len - self._rows_left()

    def next_window(self) -> None:
        self.window, self._base, self._chunk_len, self._rows_left = self.window + 1, 0, 0, None

    def as_list(self) -> Position:
        return [self.window, self.emitted, self.skipped]


class _GroupCache:
    """The most recently read row group, kept because neighbouring windows usually share it."""

    def __init__(self, reader: RowGroupReader, plan: EpochPlan, release_after_drop: bool):
        self.reader, self.plan, self.release_after_drop = reader, plan, release_after_drop
        self.group: int | None = None
        self.table: pa.Table | None = None
        self.order = None

    def piece(self, piece: Piece) -> pa.Table:
        if piece.group != self.group:
            self.clear()
            self.table = self.reader.read(piece.group)
            self.order = self.plan.rows_in_group(piece.group)
            self.group = piece.group
        if self.order is None:
            return self.table.slice(piece.start, piece.stop - piece.start)
        return self.table.take(self.order[piece.start:piece.stop])

    def clear(self) -> None:
        had_table = self.table is not None
        self.group, self.table, self.order = None, None, None
        if had_table and self.release_after_drop:
            release_arrow_memory()


def _keep_mask(table: pa.Table) -> pa.ChunkedArray | None:
    """True for rows whose every column is a non-empty string; None when every row qualifies."""
    mask = None
    for column in table.columns:
        non_empty = pc.fill_null(pc.greater(pc.binary_length(column), 0), False)
        mask = non_empty if mask is None else pc.and_(mask, non_empty)
    if mask is None or pc.all(mask).as_py():
        return None
    return mask


def _check_arguments(columns: Sequence[str], buffer_size: int, rank: int, world_size: int, num_workers: int) -> None:
    if isinstance(columns, str) or not columns:
        raise DataError(f"columns must be a non-empty list of column names, e.g. ('prompt', 'response'); got {columns!r}.")
    if buffer_size < 1:
        raise DataError(f"buffer_size must be at least 1 row; got {buffer_size}.")
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}.")
    if num_workers < 0:
        raise DataError(f"num_workers must be 0 or more; got {num_workers}.")


def _check_state_matches(stream: ParquetStream, state: dict[str, Any]) -> None:
    """Refuse a saved position that would not continue this stream exactly, and say why."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise DataError("This is not a ParquetStream position (unknown format); it cannot be resumed from.")
    differences = []
    if state["data"] != stream.index.fingerprint:
        differences.append("the data files (names or row groups) changed")
    for field in ("seed", "shuffle", "buffer_size", "world_size", "rank"):
        if state[field] != getattr(stream, field):
            differences.append(f"{field} was {state[field]}, now {getattr(stream, field)}")
    if differences:
        raise DataError(
            "The saved data position does not fit this stream: " + "; ".join(differences) + ". Resume with "
            "the same data files and settings, or start the data from the beginning of an epoch."
        )
