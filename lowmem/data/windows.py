"""Reading a window: its lanes' pieces from row groups (or from an earlier layout's unsent rows), as one Arrow
table in the order the rows are sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lowmem.data.elastic import EpochLayers
from lowmem.data.lanes import ConsumerOrder
from lowmem.data.plan import Piece
from lowmem.data.reader import RowGroupReader
from lowmem.data.sources import RowGroupIndex
from lowmem.memory import release_arrow_memory


class SourceCache:
    """The source a lane is reading (a row group, in the epoch's permuted row order, or the unsent rows of an
    earlier window), kept because the lane's next windows take their rows from it too.

    Args:
        reader: reads row groups.
        layers: the epoch's layers, to resolve sources below 0.
        layer: the layer whose sequence the pieces come from.
        release_after_drop: hand the Arrow pool's free memory back whenever a source is dropped.
    """

    def __init__(self, reader: RowGroupReader | _OriginReader, layers: EpochLayers, layer: int,
                 release_after_drop: bool):
        self.reader, self.layers, self.layer, self.release_after_drop = reader, layers, layer, release_after_drop
        self.source: int | None = None
        self.table: pa.Table | None = None  # the source's rows in its own order

    def piece(self, piece: Piece) -> pa.Table:
        """The piece's rows, in its source's order (a zero-copy slice)."""
        if piece.source != self.source:
            self.clear()
            if piece.source >= 0:
                table = self.reader.read(piece.source)
                order = self.layers.plan.rows_in_group(piece.source)
                # One gather per row group, so that every piece of it is then a slice: many small takes cost more.
                self.table = table if order is None else table.take(order)
                del table
            else:
                rest = self.layers.rest(piece.source, self.layer)
                consumer_order = self.layers.layout(rest.layer).consumer_order(rest.consumer)
                self.table = raw_window(consumer_order, rest.window, self.reader, self.layers, rest.layer,
                                        self.release_after_drop).slice(rest.sent)
            self.source = piece.source
        assert self.table is not None  # read above for this source (clear() empties both together)
        return self.table.slice(piece.start, piece.rows)

    def clear(self) -> None:
        had_table = self.table is not None
        self.source, self.table = None, None
        if had_table and self.release_after_drop:
            release_arrow_memory()


def raw_window(order: ConsumerOrder, window: int, reader: RowGroupReader | _OriginReader, layers: EpochLayers,
               layer: int, release_after_drop: bool, caches: list[SourceCache] | None = None) -> pa.Table:
    """Every row of `window` (empty values included) in the order they are sent.

    `caches` holds one SourceCache per lane, kept from window to window; without them (an earlier layout's
    window, read once) a single cache reads one source at a time.
    """
    lanes = order.window_pieces(window)
    single = None if caches is not None else SourceCache(reader, layers, layer, release_after_drop)
    parts: list[pa.Table] = []
    for lane, pieces in enumerate(lanes):
        cache = single or cast("list[SourceCache]", caches)[lane]  # single is made only when caches is None
        parts.extend(cache.piece(piece) for piece in pieces)
    if single is not None:
        single.clear()
    if not parts:
        return pa.table({column: pa.array([], pa.string()) for column in reader.index.columns})
    table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
    emission = order.emission_order(window)
    return table if emission is None else table.take(emission)


@dataclass
class Window:
    """A window's rows to send (empty values removed) and where each came from in the raw window."""

    rows: pa.Table
    kept_at: np.ndarray | None  # (rows,) raw position of each kept row; None when every row is kept
    skipped: int  # rows removed for an empty or null value

    def first_unsent(self, sent: int) -> int:
        """Index in `rows` of the first row whose raw position is `sent` or later."""
        return sent if self.kept_at is None else int(np.searchsorted(self.kept_at, sent))

    def raw_position(self, rows_sent: int) -> int:
        """The raw position just after the first `rows_sent` kept rows."""
        if self.kept_at is None or rows_sent == 0:
            return rows_sent
        return int(self.kept_at[rows_sent - 1]) + 1


def read_window(order: ConsumerOrder, window: int, caches: list[SourceCache]) -> Window:
    """Window `window` of a consumer, ready to send: rows in order, without null or empty values."""
    first = caches[0]
    table = raw_window(order, window, first.reader, first.layers, first.layer, first.release_after_drop, caches)
    kept = keep_mask(table)
    if kept is None:
        return Window(table, None, 0)
    kept_at = np.flatnonzero(kept.to_numpy(zero_copy_only=False))
    return Window(table.filter(kept), kept_at, table.num_rows - kept_at.shape[0])


def keep_mask(table: pa.Table) -> pa.ChunkedArray | None:
    """True for rows whose every column is a non-empty string; None when every row qualifies."""
    mask = None
    for column in table.columns:
        non_empty = pc.fill_null(pc.greater(pc.binary_length(column), 0), False)
        mask = non_empty if mask is None else pc.and_(mask, non_empty)
    if mask is None or pc.all(mask).as_py():
        return None
    return mask


class _OriginReader:
    """Reads, for each row group, the row group's number and each row's index in it, instead of its columns:
    `raw_window` over it gives where each row of a window comes from, with no file read."""

    def __init__(self, index: RowGroupIndex):
        self.index = index

    def read(self, group: int) -> pa.Table:
        rows = int(self.index.rows[group])
        return pa.table({"group": np.full(rows, group, dtype=np.int64), "row": np.arange(rows, dtype=np.int64)})


def row_origin(order: ConsumerOrder, window: int, raw_position: int, layers: EpochLayers, layer: int,
               index: RowGroupIndex) -> tuple[int, int]:
    """(row group of the index, row in it as stored in its file) of the row at `raw_position` of a raw window.

    For messages about one row (rare): it builds the window's order again, from numbers only.
    """
    origins = raw_window(order, window, _OriginReader(index), layers, layer, release_after_drop=False)
    return int(origins.column("group")[raw_position].as_py()), int(origins.column("row")[raw_position].as_py())
