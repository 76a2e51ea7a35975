"""The epoch plan: which rows each consumer reads, and in which order, as a pure function.

One epoch is laid out as a single global sequence of rows:

    row groups in a permuted order  →  within each row group, its rows in a permuted order

Consumer `c` of `C` (a consumer is one rank, or one DataLoader worker of a rank) takes the contiguous
slice `[c * R, (c + 1) * R)` of that sequence, with `R = total_rows // C`. So every consumer gets exactly
`R` rows, no row is given twice, and the `total_rows % C` rows at the very end are left out (a different
few each epoch, because the sequence is re-permuted). Because the slice is contiguous, a consumer reads
only its own row groups (plus at most two it shares with its neighbours), not every file.

Each consumer then cuts its slice into windows of `window_rows` rows and emits each window in a random
order: the shuffle buffer. A position is therefore just (window, rows emitted from it), and resuming
means re-reading the row groups of one window, never the epoch's start.

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
_GROUP_ORDER, _ROWS_IN_GROUP, _ROWS_IN_WINDOW = 0, 1, 2
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
    return best


@dataclass(frozen=True)
class Piece:
    """Rows `[start, stop)` of row group `group`, counted in the group's (permuted) row order."""

    group: int
    start: int
    stop: int


class EpochPlan:
    """The row order of one epoch for `num_consumers` consumers."""

    def __init__(self, group_rows: np.ndarray, seed: int, epoch: int, num_consumers: int, shuffle: bool,
                 drop_remainder: bool = True, max_rows: int | None = None):
        if num_consumers < 1:
            raise ValueError("num_consumers must be at least 1")
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.group_rows = group_rows
        self.num_consumers = num_consumers
        num_groups = group_rows.shape[0]
        self.group_order = group_order(group_rows, seed, epoch) if shuffle else np.arange(num_groups)
        rows_in_order = group_rows[self.group_order]
        self._ends = np.cumsum(rows_in_order)  # (G,) global position just past each group
        self._starts = self._ends - rows_in_order
        total = int(self._ends[-1]) if num_groups else 0
        if max_rows is not None:
            total = min(total, max_rows)  # the first rows of the sequence: file order without shuffling
        self.total_rows, self.drop_remainder = total, drop_remainder

    def consumer_range(self, consumer: int) -> tuple[int, int]:
        """Global positions `[start, stop)` of `consumer`'s rows."""
        return consumer_range(consumer, self.num_consumers, self.total_rows, self.drop_remainder)

    def num_windows(self, consumer: int, window_rows: int) -> int:
        first, last = self.consumer_range(consumer)
        return -(-(last - first) // window_rows)  # ceil

    def window_range(self, consumer: int, window: int, window_rows: int) -> tuple[int, int]:
        """Global positions `[start, stop)` of one window of one consumer (the last may be short)."""
        first, last = self.consumer_range(consumer)
        start = first + window * window_rows
        return start, min(start + window_rows, last)

    def pieces(self, start: int, stop: int) -> list[Piece]:
        """The row-group pieces that make up global positions `[start, stop)`, in order."""
        pieces = []
        position = int(np.searchsorted(self._ends, start, side="right"))
        while start < stop:
            group_start = int(self._starts[position])
            piece_stop = min(stop, int(self._ends[position]))
            pieces.append(Piece(int(self.group_order[position]), start - group_start, piece_stop - group_start))
            start = piece_stop
            position += 1
        return pieces

    def rows_in_group(self, group: int) -> np.ndarray | None:
        """The permuted row order inside `group` (None when not shuffling: file order)."""
        if not self.shuffle:
            return None
        return _rng(self.seed, self.epoch, _ROWS_IN_GROUP, group).permutation(int(self.group_rows[group]))

    def rows_in_window(self, consumer: int, window: int, num_rows: int) -> np.ndarray | None:
        """The order in which a window's `num_rows` kept rows are emitted (None when not shuffling)."""
        if not self.shuffle:
            return None
        return _rng(self.seed, self.epoch, _ROWS_IN_WINDOW, self.num_consumers, consumer, window).permutation(num_rows)
