"""How consumers share out a sequence of rows, and the order in which each reads its share: lanes and windows.

A layout is three numbers: consumers `C`, lanes `K` (how many row groups are read at once and mixed) and
window rows `B` (the shuffle buffer); and how the consumers are split into processes × readers per process,
which tells layouts apart (a saved position is read in its own layout only) but does not enter any order.

- Consumer `c` takes the contiguous slice `[c * R, (c + 1) * R)` of the sequence, `R = total // C`; the last
  `total % C` rows are left out (evaluation instead gives the first few consumers one row more).
- The slice's pieces (row groups, or parts of them) are dealt to `K` lanes, each piece to the lane with the
  fewest rows so far, so that lanes differ by less than one piece.
- The consumer reads every lane at once, each at a pace proportional to its length, so that all lanes end
  with the slice: window `w` takes rows `[w B L_j / R, (w + 1) B L_j / R)` of lane `j` (of `L_j` rows),
  about `B / K` rows of each lane.
- Inside a window each lane's rows are permuted, and the lanes are interleaved evenly with a random jitter
  (row `i` of a lane's `n` rows in the window sorts at `(i + u) / n`, `u` uniform): any `K` consecutive rows
  come from nearly `K` different lanes, hence from as many row groups. With `K = 1` a window is `B`
  consecutive rows of the slice in a random order, which is the order before lanes existed.

Memory: each lane holds the row group it is reading (`K` row groups), plus one window of about `B` rows.
A consumer's position is `[window, rows of the window sent, rows skipped]`; resuming reads the row groups of
one window again, never the slice from its start. Every order is a pure function of the seed key.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

from lowmem.data.plan import Piece, PieceSequence, consumer_range


@dataclass(frozen=True)
class LayoutSpec:
    """How a sequence is shared out and read: consumers, lanes per consumer, rows per window, and the processes
    the consumers are split among (None: not recorded, in layers saved before it was).

    Consumer `c` is DataLoader worker `c % (consumers // processes)` of process `c // (consumers // processes)`.
    2 processes × 1 reader and 1 process × 2 readers are the same `consumers` but not the same layout: the
    readers of a process share its length and its steps, so a position saved under one is a new layer under
    the other. The orders depend on `consumers` alone, so runs that keep their layout read as they always did.
    """

    consumers: int
    lanes: int
    window_rows: int
    processes: int | None = None

    @property
    def readers_per_process(self) -> int | None:
        return None if self.processes is None else self.consumers // self.processes

    def as_dict(self) -> dict[str, int]:
        spec = {"consumers": self.consumers, "lanes": self.lanes, "window_rows": self.window_rows}
        return spec if self.processes is None else {**spec, "processes": self.processes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayoutSpec":
        processes = data.get("processes")
        return cls(int(data["consumers"]), int(data["lanes"]), int(data["window_rows"]),
                   None if processes is None else int(processes))

    def describe(self) -> str:
        readers = (f"{self.consumers} consumer(s)" if self.processes is None
                   else f"{self.processes} process(es) × {self.readers_per_process} reader(s)")
        return f"{readers}, {self.lanes} lane(s), windows of {self.window_rows} rows"


def deal_to_lanes(pieces: list[Piece], lanes: int) -> list[PieceSequence]:
    """Deal `pieces`, in order, to `lanes` lanes: each to the lane with the fewest rows so far (ties: lowest)."""
    dealt: list[list[Piece]] = [[] for _ in range(lanes)]
    shortest = [(0, lane) for lane in range(lanes)]  # a heap of (rows so far, lane)
    for piece in pieces:
        rows, lane = heapq.heappop(shortest)
        dealt[lane].append(piece)
        heapq.heappush(shortest, (rows + piece.rows, lane))
    return [PieceSequence.of(lane_pieces) for lane_pieces in dealt]


class ConsumerOrder:
    """The reading order of one consumer's slice: its lanes, its windows and each window's emission order.

    Args:
        pieces: the slice, in sequence order.
        lanes: how many lanes to deal the pieces to (1 without shuffling: file order).
        window_rows: rows per window `B`.
        window_key: the seed key of this consumer's windows; window `w` draws from `window_key[:-1] + (w,)`
            followed by `window_key[-1]` (a tuple, empty for the first layout of an epoch).
        shuffle: permute and interleave each window; False emits the slice in order.
    """

    def __init__(self, pieces: list[Piece], lanes: int, window_rows: int, window_key: tuple, shuffle: bool):
        self.lanes = deal_to_lanes(pieces, lanes if shuffle else 1)
        self.lane_rows = np.array([lane.total_rows for lane in self.lanes], dtype=np.int64)  # (K,)
        self.total_rows = int(self.lane_rows.sum())
        self.window_rows, self.window_key, self.shuffle = window_rows, window_key, shuffle
        self.num_windows = -(-self.total_rows // window_rows)  # ceil

    def lane_bounds(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(first, stop) row of each lane inside `window`: (K,) each. Lanes keep pace with the slice."""
        total = max(self.total_rows, 1)
        start = min(window * self.window_rows, self.total_rows)
        stop = min(start + self.window_rows, self.total_rows)
        return start * self.lane_rows // total, stop * self.lane_rows // total

    def window_size(self, window: int) -> int:
        first, stop = self.lane_bounds(window)
        return int((stop - first).sum())

    def window_pieces(self, window: int) -> list[list[Piece]]:
        """Each lane's pieces in `window`, lane by lane; their rows laid end to end are the window's raw rows."""
        first, stop = self.lane_bounds(window)
        return [lane.pieces(int(a), int(b)) for lane, a, b in zip(self.lanes, first, stop)]

    def tail_pieces(self, window: int) -> list[Piece]:
        """Every lane's rows from the start of `window` to the lane's end, lane by lane."""
        first, _ = self.lane_bounds(window)
        return [piece for lane, a in zip(self.lanes, first) for piece in lane.pieces(int(a), lane.total_rows)]

    def emission_order(self, window: int) -> np.ndarray | None:
        """The window's raw rows (as `window_pieces` lays them out) in the order they are sent; None: as laid out."""
        if not self.shuffle:
            return None
        first, stop = self.lane_bounds(window)
        counts = stop - first  # (K,) rows of each lane in this window
        prefix, suffix = self.window_key[:-1], self.window_key[-1]
        rng = np.random.default_rng([int(k) for k in (*prefix, window, *suffix)])
        if counts.shape[0] == 1:
            return rng.permutation(int(counts[0]))
        total = int(counts.sum())
        lane_of_row = np.repeat(np.arange(counts.shape[0]), counts)  # (n,) as laid out: lane 0's rows, lane 1's, ...
        # Each lane's rows in a random order: sorting lane + uniform keeps lanes apart and shuffles inside each.
        shuffled = np.argsort(lane_of_row + rng.random(total), kind="stable")
        # Interleave the lanes evenly: the i-th of lane j's n_j rows sorts at (i + u) / n_j.
        rank_in_lane = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        slots = (rank_in_lane + rng.random(total)) / np.repeat(counts, counts)
        return shuffled[np.argsort(slots, kind="stable")]


class Layout:
    """A sequence shared out among `spec.consumers` consumers, each reading its slice as a ConsumerOrder.

    `key` is the seed key of the windows: `(seed, epoch, purpose, consumers)` and a tuple that tells layouts
    of the same epoch apart (empty for the first).
    """

    def __init__(self, sequence: PieceSequence, spec: LayoutSpec, shuffle: bool, drop_remainder: bool,
                 key: tuple[int, ...], layer_key: tuple[int, ...] = ()):
        self.sequence, self.spec, self.shuffle, self.drop_remainder = sequence, spec, shuffle, drop_remainder
        self.key, self.layer_key = key, layer_key

    def consumer_range(self, consumer: int) -> tuple[int, int]:
        """Positions `[start, stop)` of `consumer`'s slice in the sequence."""
        return consumer_range(consumer, self.spec.consumers, self.sequence.total_rows, self.drop_remainder)

    def consumer_rows(self, consumer: int) -> int:
        start, stop = self.consumer_range(consumer)
        return stop - start

    def consumer_order(self, consumer: int) -> ConsumerOrder:
        start, stop = self.consumer_range(consumer)
        return ConsumerOrder(self.sequence.pieces(start, stop), self.spec.lanes, self.spec.window_rows,
                             (*self.key, consumer, self.layer_key), self.shuffle)
