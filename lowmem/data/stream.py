"""ParquetStream: rows of parquet files, shuffled and sharded, in bounded memory, with exact resume."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Iterator, Sequence, cast

import numpy as np
import pyarrow as pa
from torch.utils.data import IterableDataset, get_worker_info

from lowmem.data.bad_text import bad_text_error, check_bad_text, raw_values, undecodable_rows
from lowmem.data.elastic import EpochLayers, Layer, Position, close_layer
from lowmem.data.fingerprint import changed_files, content_fingerprint
from lowmem.data.lanes import ConsumerOrder, LayoutSpec
from lowmem.data.plan import EpochPlan, consumer_range
from lowmem.data.reader import RowGroupReader
from lowmem.data.sources import (DEFAULT_COLUMNS, FileSpec, RowGroupIndex, build_row_group_index,
                                 warn_large_row_groups)
from lowmem.data.windows import SourceCache, Window, read_window, row_origin
from lowmem.errors import DataContentChanged, DataError
from lowmem.memory import MemoryBudget

logger = logging.getLogger(__name__)

STATE_FORMAT = 2
# Rows turned into Python objects at a time: keeps the peak of Python strings well below the window's.
_CONVERT_ROWS = 1024
# By default the row groups read at once may hold up to this fraction of the host's memory budget.
LARGE_ROW_GROUP_FRACTION = 1 / 200
# The seed purpose of window orders (see lowmem.data.plan).
_ROWS_IN_WINDOW = 2
# Row groups each consumer reads at once and mixes, unless told otherwise (see the README's data section).
DEFAULT_MIX_ROW_GROUPS = 16


class ConsumerNumbering:
    """How the readers (consumers) of a stream are numbered: rank × workers per rank + the DataLoader worker,
    rotated by `worker_rotation`. Needs `rank`, `world_size`, `num_workers` and `worker_rotation`."""

    rank: int
    world_size: int
    num_workers: int
    worker_rotation: int

    @property
    def workers_per_rank(self) -> int:
        """Readers per rank: its DataLoader workers, or the rank itself."""
        return max(1, self.num_workers)

    @property
    def num_consumers(self) -> int:
        """Readers in all: ranks × workers per rank."""
        return self.world_size * self.workers_per_rank

    def current_consumer(self) -> tuple[int, int]:
        """(consumer id, number of consumers) of the calling process or DataLoader worker."""
        info = get_worker_info()
        workers, worker_id = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + (worker_id + self.worker_rotation) % workers, self.world_size * workers


class ParquetStream(ConsumerNumbering, IterableDataset):
    """An iterable over the rows of parquet files, as dicts `{column: str}`, in bounded memory.

    Args:
        files: a path, a glob, a directory (every *.parquet below it), or a list of them.
        columns: the text columns to read; every file must have them, as strings.
        buffer_size: rows in the shuffle window. Each consumer sends its rows in windows of about this many
            rows, each window in a random order.
        mix_row_groups: row groups each consumer reads at once (its lanes). A window takes rows from every
            lane, interleaved, so that consecutive rows come from this many row groups. Memory holds this
            many row groups plus one window. 1 reads one stretch of the sequence at a time.
        shuffle: permute row groups, rows within a row group, and each window, anew each epoch. False gives
            file order.
        seed: the seed of every permutation; the order is a pure function of (files, seed, epoch, number
            of consumers, mix_row_groups, buffer_size).
        rank, world_size: this process's place among the training processes.
        ultra_low_mem: reopen the file for every row group and release Arrow's pool after it. None
            decides from the memory budget: on when the host has less than `ultra_low_mem_threshold_gb`.
        ultra_low_mem_threshold_gb: the budget below which `ultra_low_mem=None` turns the mode on.
        large_row_group_bytes: the memory the row groups read at once may take; files whose row groups are
            over this divided by `mix_row_groups` get a warning with the repack command. None means 1/200 of
            the memory budget.
        num_workers: DataLoader workers per rank that will read this stream (0 = read in the training
            process). Only `len()` needs it before iterating; `StreamLoader` sets it.
        drop_remainder: True (training) gives every consumer exactly `total_rows // consumers` rows and
            leaves the few others out; False (evaluation) reads every row exactly once, the first
            `total_rows % consumers` consumers taking one row more.
        max_rows: read only the first `max_rows` rows of each epoch's sequence (of the file order when
            not shuffling), e.g. the first validation prompts to score.
        bad_text: what to do with a row whose text is not valid UTF-8: "refuse" (stop with a DataError naming
            the file, row group, row and column) or "skip" (leave it out, counted with the rows with empty
            values; a position stays exact).
        allow_changed_content: load a saved position whose files have the same names and row counts but
            other content (`lowmem.data.fingerprint`) with a warning, instead of refusing it.
        index: the row-group index of `files` with `columns`, when it was built already; else built here.

    Each consumer (a rank, or a DataLoader worker of a rank) yields exactly `total_rows // consumers`
    rows per epoch, minus rows with a null or empty value, which are skipped and counted. A saved position
    continues exactly with the same processes and workers per process, and loads into any other number or split
    of them (`lowmem.data.elastic`).
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
        mix_row_groups: int = DEFAULT_MIX_ROW_GROUPS,
        bad_text: str = "refuse",
        allow_changed_content: bool = False,
        index: RowGroupIndex | None = None,
    ):
        super().__init__()
        _check_arguments(columns, buffer_size, rank, world_size, num_workers, mix_row_groups)
        self.bad_text = check_bad_text(bad_text)
        self.allow_changed_content = bool(allow_changed_content)
        self.columns = tuple(columns)
        self.buffer_size = int(buffer_size)
        self.mix_row_groups = int(mix_row_groups)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.num_workers = int(num_workers)
        self.drop_remainder = bool(drop_remainder)
        self.max_rows = None if max_rows is None else int(max_rows)
        # An index built already (the memory plan's, of the same files and columns) is not built again.
        self.index = index if index is not None else build_row_group_index(files, self.columns)
        self._content: dict[str, Any] | None = None  # the files' content fingerprint, computed when first needed

        budget = MemoryBudget.detect() if ultra_low_mem is None or large_row_group_bytes is None else None
        # budget is detected whenever either of them is None: the casts below only tell mypy so.
        self.ultra_low_mem = (cast(MemoryBudget, budget).is_low(ultra_low_mem_threshold_gb) if ultra_low_mem is None
                              else bool(ultra_low_mem))
        self.large_row_group_bytes = (
            int(cast(MemoryBudget, budget).total_bytes * LARGE_ROW_GROUP_FRACTION) if large_row_group_bytes is None
            else int(large_row_group_bytes)
        )
        if self.rank == 0:
            warn_large_row_groups(self.index, self.large_row_group_bytes // self.lanes, self.lanes)

        self.epoch = 0
        self._saved_layers: list[Layer] | None = None  # loaded layers, until an iteration has picked them up
        self._closed: list[Layer] = []  # this epoch's layers before the current one (after a change of layout)
        self._current: LayoutSpec | None = None  # the layout being read (None: the one this stream's settings give)
        self._resume: dict[int, Position] = {}  # loaded positions in the current layout, not yet picked up
        self._live: dict[int, _Cursor] = {}  # positions of the iterations running in this process
        self._reader: RowGroupReader | None = None
        # DataLoader worker w reads consumer (w + worker_rotation) % workers of this rank. A resumed loader
        # rotates so that its worker 0 reads the consumer whose batch was due next.
        self.worker_rotation = 0

    # ----- size, layout and epochs ----------------------------------------------------------------
    @property
    def lanes(self) -> int:
        return self.mix_row_groups if self.shuffle else 1

    def layout_spec(self, num_consumers: int | None = None) -> LayoutSpec:
        """The layout this stream's settings give for `num_consumers` consumers (default: ranks × workers),
        split among `world_size` processes."""
        return LayoutSpec(num_consumers or self.num_consumers, self.lanes, self.buffer_size, self.world_size)

    def plan(self) -> EpochPlan:
        """This epoch's sequence of row groups."""
        return EpochPlan(self.index.rows, self.seed, self.epoch, self.shuffle, self.max_rows)

    def layers(self, num_consumers: int | None = None) -> EpochLayers:
        """This epoch's layers, read now by `num_consumers` consumers (default: ranks × workers per rank)."""
        current = self._settle(num_consumers or self.num_consumers)
        return EpochLayers(self.plan(), self._closed, current, self.drop_remainder,
                           (self.seed, self.epoch, _ROWS_IN_WINDOW))

    def for_epoch(self, epoch: int) -> "ParquetStream":
        """A copy of this stream that reads epoch `epoch` from its start: the same files, index and settings (and
        content fingerprint, once computed), no open files and no position."""
        other = copy.copy(self)
        other.__dict__.update(self._epoch_start_state(), _reader=None, epoch=int(epoch))
        return other

    @staticmethod
    def _epoch_start_state() -> dict[str, Any]:
        """The per-epoch fields at an epoch's start: no saved layout or position, nothing read or being read."""
        return dict(_saved_layers=None, _closed=[], _current=None, _resume={}, _live={})

    def end_position(self, consumer: int, num_consumers: int | None = None,
                     saved_layers: list[Layer] | None = None) -> Position:
        """Where `consumer` stands once it has read its whole share of this epoch: in the layout read by
        `num_consumers` consumers, or in the last layout of `saved_layers` (a saved state's)."""
        if saved_layers is None:
            layout = self.layers(num_consumers).current_layout
        else:
            layers = EpochLayers(self.plan(), saved_layers[:-1], saved_layers[-1].spec, self.drop_remainder,
                                 (self.seed, self.epoch, _ROWS_IN_WINDOW))
            layout = layers.layout(len(saved_layers) - 1)
        return [layout.consumer_order(consumer).num_windows, 0, 0]

    def rank_consumer_rows(self) -> list[int]:
        """Rows per epoch of each of this rank's consumers (before null or empty values are skipped)."""
        first = self.rank * self.workers_per_rank
        consumers = range(first, first + self.workers_per_rank)
        if self._saved_layers is None and not self._closed:
            # Counting a whole epoch needs only the total, not the epoch's order: no plan is built.
            total = self.index.num_rows if self.max_rows is None else min(self.index.num_rows, self.max_rows)
            ranges = (consumer_range(consumer, self.num_consumers, total, self.drop_remainder)
                      for consumer in consumers)
            return [stop - start for start, stop in ranges]
        layout = self.layers().current_layout
        return [layout.consumer_rows(consumer) for consumer in consumers]

    def __len__(self) -> int:
        """Rows this rank yields in this epoch (before rows with null or empty values are skipped); after a
        change of layout, in the rest of the epoch."""
        return sum(self.rank_consumer_rows())

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows. A loaded position is for its own epoch only."""
        if epoch != self.epoch:
            self.__dict__.update(self._epoch_start_state())
            self.worker_rotation = 0
        self.epoch = int(epoch)

    @property
    def rows_decoded(self) -> int:
        """Rows decoded from parquet by this process's reader (the cost of reading, resumes included)."""
        return self._reader.rows_decoded if self._reader is not None else 0

    @property
    def skipped_rows(self) -> int:
        """Rows skipped this epoch for a null or empty value (or text that is not UTF-8, with `bad_text="skip"`),
        by the iterations in this process."""
        return sum(cursor.as_list()[2] for cursor in self._live.values())

    @staticmethod
    def skipped_in(position: Position) -> int:
        """Rows skipped (null, empty or undecodable) before a position, this epoch."""
        return int(position[2])

    def content_fingerprint(self) -> dict[str, Any]:
        """The data files' content fingerprint (`lowmem.data.fingerprint`), computed once, when first needed:
        it reads every footer and a few row groups per file."""
        if self._content is None:
            self._content = content_fingerprint(self.index)
        return self._content

    # ----- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position in the epoch: small and JSON-serialisable, valid at any point of an iteration.

        It holds the epoch, seeds, fingerprints of the data (its files and row groups, and their content), and
        the layout with one `[window, sent, skipped]` per consumer of this rank, never rows. With DataLoader
        workers the positions live in the worker processes: use `StreamLoader.state_dict()` there.
        """
        live = {consumer: cursor.as_list() for consumer, cursor in self._live.items()}
        return self.state_with_positions({**self._resume, **live})

    def state_with_positions(self, positions: dict[int, Position]) -> dict[str, Any]:
        """The state dict of this stream with the given positions of this rank's consumers in the current
        layout (a consumer not given has not started)."""
        spec = self._settle(self.num_consumers)
        workers = spec.consumers // self.world_size
        own = {consumer: [0, 0, 0] for consumer in range(self.rank * workers, (self.rank + 1) * workers)}
        own.update({consumer: list(position) for consumer, position in positions.items() if consumer in own})
        content = self.content_fingerprint()
        return {
            "format": STATE_FORMAT,
            "data": self.index.fingerprint,
            "data_content": {**content, "files": list(content["files"])},
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "rank": self.rank,
            "world_size": self.world_size,
            "workers_per_rank": workers,
            "layers": [layer.as_dict() for layer in self._closed] + [Layer(spec, own).as_dict()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: the next iteration yields exactly the rest of that epoch.

        The same layout (consumers, lanes, window) continues the saved order row for row. Another layout
        needs every consumer's position (`lowmem.data.elastic.merge_rank_states`): the rows not yet sent
        are then shared out anew, each exactly once.
        """
        layers = _saved_layers(state)
        _check_state_matches(self, state)
        self.epoch = int(state["epoch"])
        self._saved_layers, self._current, self._live = layers, None, {}
        self._settle(self.num_consumers)

    def _settle(self, num_consumers: int) -> LayoutSpec:
        """The layout read by `num_consumers` consumers, taking up loaded layers as fits it."""
        spec = self.layout_spec(num_consumers)
        if self._current == spec:
            return spec
        if self._current is not None and self._saved_layers is None:
            raise DataError(
                f"This epoch is being read by {self._current.describe()}; it cannot be read by "
                f"{spec.describe()} as well. Start the next epoch, or keep num_workers as it was."
            )
        layers = self._saved_layers or []
        if layers and layers[-1].spec == spec:
            self._closed, self._resume = layers[:-1], dict(layers[-1].positions)
        elif layers:
            self._closed, self._resume = close_layer(layers, spec), {}
            logger.info("Data: the rest of epoch %d, saved by %s, is shared out anew among %s.",
                        self.epoch, layers[-1].spec.describe(), spec.describe())
        self._current = spec
        return spec

    def loaded_positions(self) -> dict[int, Position]:
        """Loaded positions of this rank's consumers not yet picked up by an iteration."""
        first = self.rank * self.workers_per_rank
        return {consumer: list(position) for consumer, position in self._resume.items()
                if first <= consumer < first + self.workers_per_rank}

    @property
    def continues_exactly(self) -> bool:
        """True when the loaded position is read in its own layout (row for row as if never stopped)."""
        return self._saved_layers is not None and self._saved_layers[-1].spec == self._current

    def forget_loaded_positions(self) -> None:
        """Drop loaded positions not yet picked up here (DataLoader workers took their own copies)."""
        self._resume = {}

    def position_of(self, consumer: int) -> Position:
        """A copy of one consumer's current position (for consumers iterating in this process)."""
        return self._live[consumer].as_list()

    # ----- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, str]]:
        consumer, num_consumers = self.current_consumer()
        layers = self.layers(num_consumers)
        cursor = _Cursor(*self._resume.pop(consumer, [0, 0, 0]))
        self._live[consumer] = cursor
        return self._iter_rows(layers, consumer, cursor)

    def _get_reader(self) -> RowGroupReader:
        if self._reader is None:
            self._reader = RowGroupReader(self.index, ultra_low_mem=self.ultra_low_mem)
        return self._reader

    def _iter_rows(self, layers: EpochLayers, consumer: int, cursor: "_Cursor") -> Iterator[dict[str, str]]:
        layer = len(layers.closed)
        order = layers.layout(layer).consumer_order(consumer)
        caches = [SourceCache(self._get_reader(), layers, layer, self.ultra_low_mem) for _ in order.lanes]
        while cursor.window < order.num_windows:
            window = read_window(order, cursor.window, caches)
            if cursor.sent == 0:  # a window resumed part-way was counted before the save
                cursor.skipped += window.skipped
            cursor.begin_window(window)
            start = window.first_unsent(cursor.sent)
            while start < window.rows.num_rows:
                try:
                    chunk = window.rows.slice(start, _CONVERT_ROWS).to_pylist()
                except UnicodeDecodeError:
                    chunk = None  # handled below, so that a refusal does not carry this error's traceback
                if chunk is None:
                    # Rare, so looked into only now: refuse, or go on without the rows from here on that hold it.
                    window = self._without_bad_text(window, start, layers, layer, order, cursor)
                    continue
                # `yield from` a list iterator costs far less per row than a Python loop, and the
                # cursor reads its position from the iterator when asked.
                yield from cursor.follow(start, chunk)
                start += _CONVERT_ROWS
            del window
            cursor.next_window()
        for cache in caches:
            cache.clear()
        if cursor.skipped:
            bad = (f" or text that is not valid UTF-8 ({cursor.bad_text_rows} of them in this reading of the epoch, "
                   f"the first at {cursor.first_bad_text})" if cursor.bad_text_rows else "")
            logger.warning(
                "Skipped %d rows with a null or empty %s value%s in epoch %d (rank %d, consumer %d of %d).",
                cursor.skipped, "/".join(self.columns), bad, self.epoch, self.rank, consumer, layers.current.consumers,
            )

    def _without_bad_text(self, window: Window, start: int, layers: EpochLayers, layer: int, order: ConsumerOrder,
                          cursor: "_Cursor") -> Window:
        """`window` without its rows from `start` on whose text is not valid UTF-8 (`bad_text="skip"`), the cursor
        moved onto it; with `bad_text="refuse"`, the DataError naming the first such row."""
        rest = window.rows.slice(start)
        bad = undecodable_rows(rest)
        if not bad:
            raise DataError(f"A row of epoch {self.epoch} could not be read as text, but no value in it is invalid "
                            "UTF-8 when checked again. Report this, with the data file if you can.")
        rows_bad = np.logical_or.reduce(list(bad.values()))
        raw = np.arange(window.rows.num_rows) if window.kept_at is None else window.kept_at
        first = int(np.flatnonzero(rows_bad)[0])
        column = next(name for name in self.columns if name in bad and bad[name][first])
        group, row = row_origin(order, cursor.window, int(raw[start + first]), layers, layer, self.index)
        where = (f"row {row} of row group {int(self.index.group_in_file[group])} of "
                 f"'{self.index.paths[int(self.index.file_id[group])]}'")
        if self.bad_text == "refuse":
            raise bad_text_error(where, column, raw_values(rest.column(column).slice(first, 1))[0])
        keep = np.ones(window.rows.num_rows, dtype=bool)
        keep[start:] = ~rows_bad
        without = Window(window.rows.filter(pa.array(keep)), raw[keep], window.skipped)
        cursor.leave_out(without, raw[start:][rows_bad], f"{where}, column '{column}'")
        return without

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
    """One consumer's position: window, raw rows of it sent, rows skipped so far this epoch.

    While rows of a converted chunk are being handed out, the count is derived from the chunk's list
    iterator (rows left in it), so the hot loop does no bookkeeping per row. Raw rows count the window's
    rows with empty values too, which are never sent: a position means the same rows whatever was skipped.
    """

    def __init__(self, window: int = 0, sent: int = 0, skipped: int = 0):
        self.window, self.skipped = window, skipped
        self._sent_before = sent  # the raw position when no chunk is being followed
        self._window: Window | None = None
        self._base, self._chunk_len, self._rows_left = 0, 0, None
        # Raw positions (sorted) of this window's rows left out for text that is not UTF-8: found only when a
        # chunk fails to convert, so they count as skipped once the position is past them (a resume before
        # them meets and counts them again; one after them does not).
        self._bad_at: np.ndarray | None = None
        self.bad_text_rows = 0  # rows left out for text that is not UTF-8 by this iteration, for its warning
        self.first_bad_text: str | None = None  # where the first of them was

    def begin_window(self, window: Window) -> None:
        self._window = window

    def leave_out(self, window: Window, bad_at: np.ndarray, where: str) -> None:
        """Go on in `window`: the current one without the rows at raw positions `bad_at` (the first at `where`)."""
        sent = self.sent  # read while the chunk followed so far still indexes the old window's rows
        self._sent_before, self._window, self._base, self._chunk_len, self._rows_left = sent, window, 0, 0, None
        self._bad_at = bad_at if self._bad_at is None else np.union1d(self._bad_at, bad_at)
        self.first_bad_text = self.first_bad_text or where

    def follow(self, start: int, chunk: list) -> Iterator:
        rows = iter(chunk)
        # A list iterator has __length_hint__ (the rows not yet taken); typeshed types iter(list) as an Iterator.
        self._base, self._chunk_len, self._rows_left = (
            start, len(chunk), rows.__length_hint__)  # type: ignore[attr-defined]
        return rows

    @property
    def sent(self) -> int:
        if self._rows_left is None:
            return self._sent_before
        return self._window.raw_position(self._base + self._chunk_len - self._rows_left())

    def next_window(self) -> None:
        if self._bad_at is not None:
            self.skipped += len(self._bad_at)
            self.bad_text_rows += len(self._bad_at)
            self._bad_at = None
        self.window += 1
        self._sent_before, self._window, self._base, self._chunk_len, self._rows_left = 0, None, 0, 0, None

    def as_list(self) -> Position:
        sent = self.sent
        passed = 0 if self._bad_at is None else int(np.searchsorted(self._bad_at, sent))
        return [self.window, sent, self.skipped + passed]


def _check_arguments(columns: Sequence[str], buffer_size: int, rank: int, world_size: int, num_workers: int,
                     mix_row_groups: int) -> None:
    if isinstance(columns, str) or not columns:
        raise DataError(
            f"columns must be a non-empty list of column names, e.g. ('prompt', 'response'); got {columns!r}.")
    if buffer_size < 1:
        raise DataError(f"buffer_size must be at least 1 row; got {buffer_size}.")
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}.")
    if mix_row_groups < 1:
        raise DataError(f"mix_row_groups must be at least 1 (1 reads one row group at a time); got {mix_row_groups}.")
    if num_workers < 0:
        raise DataError(f"num_workers must be 0 or more; got {num_workers}.")


def _saved_layers(state: dict[str, Any]) -> list[Layer]:
    """The layers of a saved state; a state from before layers (format 1) is one layer of single-lane windows."""
    if isinstance(state, dict) and state.get("kind") == "mixture":
        raise DataError("The saved data position is of a mixture of sources (--train_sources), not of one training "
                        "file: resume with the --train_sources the run was started with, or start a new run "
                        "(--output_dir) for this file.")
    if not isinstance(state, dict) or state.get("format") not in (1, STATE_FORMAT):
        raise DataError("This is not a ParquetStream position (unknown format); it cannot be resumed from.")
    processes = int(state["world_size"])
    if state["format"] == 1:
        consumers = processes * int(state["workers_per_rank"])
        spec = LayoutSpec(consumers, 1, int(state["buffer_size"]), processes)
        positions = {int(consumer): [int(v) for v in position] for consumer, position in state["consumers"].items()}
        return [Layer(spec, positions)]
    layers = [Layer.from_dict(layer) for layer in state["layers"]]
    # A state saved before layouts recorded their processes: its last layer is the saving run's, and the
    # earlier layers are never compared with a layout again, so they keep None.
    if layers[-1].spec.processes is None:
        layers[-1] = Layer(dataclasses.replace(layers[-1].spec, processes=processes), layers[-1].positions)
    return layers


def _check_state_matches(stream: ParquetStream, state: dict[str, Any]) -> None:
    """Refuse a saved position of other data or another order, and say why."""
    differences = []
    if state["data"] != stream.index.fingerprint:
        differences.append("the data files (names or row groups) changed")
    for field in ("seed", "shuffle"):
        if state[field] != getattr(stream, field):
            differences.append(f"{field} was {state[field]}, now {getattr(stream, field)}")
    if differences:
        raise DataError(
            "The saved data position does not fit this stream: " + "; ".join(differences) + ". Resume with "
            "the same data files, seed and shuffle, or start the data from the beginning of an epoch."
        )
    _check_same_content(stream, state.get("data_content"))


_NAMED_FILES = 5  # changed files named in the message; the others are counted


def _check_same_content(stream: ParquetStream, saved: Any) -> None:
    """Refuse a saved position whose files have the same names and row groups but other content.

    A state saved before content fingerprints existed (no `data_content`) is not checked.
    """
    if saved is None:
        return
    changed = changed_files(stream.index, saved, stream.content_fingerprint())
    if not changed:
        return
    names = ", ".join(f"'{name}'" for name in changed[:_NAMED_FILES])
    more = f" and {len(changed) - _NAMED_FILES} more" if len(changed) > _NAMED_FILES else ""
    what = (f"The content of {names}{more} changed since this data position was saved (same file names and rows "
            "per row group, but the footer or the sampled rows differ): the saved position would continue over "
            "other rows.")
    if stream.allow_changed_content:
        logger.warning("%s Continuing from the saved position as asked: rows of %s may be read twice or not at "
                       "all in this epoch.", what, "that file" if len(changed) == 1 else "those files")
        return
    raise DataContentChanged(
        f"{what} Resume with the data files the run was trained on, or pass --allow_config_change=True "
        "(allow_changed_content=True for a ParquetStream) to continue from the saved position knowingly: rows "
        "of the changed files may then be read twice or not at all in this epoch."
    )
