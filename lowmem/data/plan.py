"""The epoch plan: the sequence of rows of one epoch, as a pure function of (files, seed, epoch).

One epoch is laid out as a single global sequence of rows:

    row groups in a permuted order  →  within each row group, its rows in a permuted order

How consumers (ranks, or DataLoader workers of ranks) share the sequence out and the order in which each
reads its share (lanes and windows) is `lowmem.data.lanes`'s business; `consumer_range` gives the shares.

Every permutation comes from a seed derived from (seed, epoch, purpose, ids), so the plan needs no state.

The row-group order is drawn among permutations that are nearly uncorrelated with the file order. A
uniformly random order of G row groups has a rank correlation with the file order of about 1/sqrt(G)
(0.1 for 100 groups): files sorted by source, date or length would leak that order into the epoch.
Drawing a few permutations and keeping the first whose row-weighted correlation is under
`GROUP_ORDER_MAX_CORRELATION` removes that, at the cost of microseconds per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Separate purposes get separate seed streams, so e.g. the row-group order never correlates with the
# order inside a window.
_GROUP_ORDER, _ROWS_IN_GROUP = 0, 1  # 2: window orders (lowmem.data.lanes)
GROUP_ORDER_MAX_CORRELATION = 0.01
_GROUP_ORDER_DRAWS = 32


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


def order_correlation(group_rows: np.ndarray, order: np.ndarray) -> float:
    """Row-weighted correlation between where row groups sit in the file and where `order` puts them."""
    rows = group_rows.astype(np.float64)
    if rows.shape[0] < 2:
        return 0.0
    file_middle = np.cumsum(rows) - rows / 2  # (G,) each group's middle row, in file order
    in_order = rows[order]
    epoch_middle = np.cumsum(in_order) - in_order / 2  # (G,) the same groups' middles, in epoch order
    x, y, weight = epoch_middle, file_middle[order], in_order / in_order.sum()
    x, y = x - np.dot(weight, x), y - np.dot(weight, y)
    return float(np.dot(weight, x * y) / np.sqrt(np.dot(weight, x * x) * np.dot(weight, y * y)))


def consumer_range(consumer: int, num_consumers: int, total_rows: int, drop_remainder: bool = True) -> tuple[int, int]:
    """Positions `[start, stop)` of `consumer`'s rows in a sequence of `total_rows` (whatever its order).

    With `drop_remainder` every consumer gets `total_rows // num_consumers` rows and the last few are left
    out; without it (evaluation wants every row exactly once) the first `total_rows % num_consumers`
    consumers take one row more.
    """
    per_consumer = total_rows // num_consumers
    extra = 0 if drop_remainder else total_rows % num_consumers
    start = consumer * per_consumer + min(consumer, extra)
    return start, start + per_consumer + (1 if consumer < extra else 0)


def group_order(group_rows: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """A random row-group order whose correlation with the file order is negligible (see module doc)."""
    rng = _rng(seed, epoch, _GROUP_ORDER)
    best, best_correlation = None, np.inf
    for _ in range(_GROUP_ORDER_DRAWS):
        order = rng.permutation(group_rows.shape[0])
        correlation = abs(order_correlation(group_rows, order))
        if correlation < best_correlation:
            best, best_correlation = order, correlation
        if correlation <= GROUP_ORDER_MAX_CORRELATION:
            break
    # The first draw is kept: every row group has rows (the index leaves out empty ones), so the correlation is
    # a number, below inf.
    assert best is not None
    return best


@dataclass(frozen=True)
class Piece:
    """Rows `[start, stop)` of a source, counted in the source's own row order.

    A source `>= 0` is a row group, whose rows are counted in the epoch's permuted order of that group. A
    source `< 0` is the unsent part of a window of an earlier layout (`lowmem.data.elastic`), number
    `-1 - source` of its sequence's `rests`.
    """

    source: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class PieceSequence:
    """A sequence of rows made of pieces laid end to end, kept as numpy arrays (cheap in forked workers).

    `rests` describes the sources below 0 (see `Piece`); the epoch's sequence has none.
    """

    def __init__(self, sources: np.ndarray, starts: np.ndarray, stops: np.ndarray, rests: tuple = ()):
        self.sources = np.asarray(sources, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.stops = np.asarray(stops, dtype=np.int64)
        self.rests = tuple(rests)
        self._ends = np.cumsum(self.stops - self.starts)  # (P,) position just past each piece
        self.total_rows = int(self._ends[-1]) if self._ends.shape[0] else 0

    @classmethod
    def of(cls, pieces: list[Piece], rests: tuple = ()) -> "PieceSequence":
        """The sequence of `pieces`, in order."""
        arrays = np.array([(p.source, p.start, p.stop) for p in pieces], dtype=np.int64).reshape(-1, 3)
        return cls(arrays[:, 0], arrays[:, 1], arrays[:, 2], rests)

    def pieces(self, start: int, stop: int) -> list[Piece]:
        """The pieces that make up positions `[start, stop)` of the sequence, in order."""
        pieces = []
        position = int(np.searchsorted(self._ends, start, side="right"))
        while start < stop:
            piece_start = int(self._ends[position]) - int(self.stops[position] - self.starts[position])
            piece_stop = min(stop, int(self._ends[position]))
            offset = int(self.starts[position]) - piece_start
            pieces.append(Piece(int(self.sources[position]), start + offset, piece_stop + offset))
            start = piece_stop
            position += 1
        return pieces


class EpochPlan:
    """The epoch's sequence of rows: every row group in a permuted order (file order without shuffling),
    cut to `max_rows`. How consumers share it out is `lowmem.data.lanes.Layout`'s business."""

    def __init__(self, group_rows: np.ndarray, seed: int, epoch: int, shuffle: bool, max_rows: int | None = None):
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.group_rows = group_rows
        num_groups = group_rows.shape[0]
        self.group_order = group_order(group_rows, seed, epoch) if shuffle else np.arange(num_groups)
        rows_in_order = group_rows[self.group_order]
        sequence = PieceSequence(self.group_order, np.zeros(num_groups, dtype=np.int64), rows_in_order)
        if max_rows is not None and max_rows < sequence.total_rows:
            # The first rows of the sequence (of the file order without shuffling).
            sequence = PieceSequence.of(sequence.pieces(0, max_rows))
        self.sequence = sequence

    @property
    def total_rows(self) -> int:
        return self.sequence.total_rows

    def rows_in_group(self, group: int) -> np.ndarray | None:
        """The permuted row order inside `group` (None when not shuffling: file order)."""
        if not self.shuffle:
            return None
        return _rng(self.seed, self.epoch, _ROWS_IN_GROUP, group).permutation(int(self.group_rows[group]))
