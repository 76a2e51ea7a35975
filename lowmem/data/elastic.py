"""The rest of an epoch after a change of layout: a position saved by N consumers, read by M.

Positions are saved per consumer, under a layout (`lowmem.data.lanes`). When a run continues with another
number of consumers (processes × DataLoader workers), another split of them (2 × 1 → 1 × 2: each process's
length and steps change), lanes or window size, the rows no old consumer has sent yet become a new sequence,
the *remainder*, which the new layout shares out as it would an epoch:

    for each old consumer, in order:  the unsent rows of its current window (one piece whose source is a
                                      `WindowRest`), then each lane's rows after that window

Each new consumer takes an equal contiguous slice of the remainder (fewer than M rows are left out) and reads
it with lanes and windows. Together with the fewer than N rows the old layout left out, fewer than N + M rows
of the epoch go unread, and none is read twice. Batches a DataLoader had prefetched but not handed over are
after the saved positions, so they are part of the remainder.

An epoch is therefore a stack of layers: the epoch's sequence under its first layout, then for every change
the remainder under the next. A state holds each layer's layout and positions (numbers only, never rows),
and every layer's sequence is rebuilt from them. The next epoch starts afresh with the current layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lowmem.data.lanes import Layout, LayoutSpec
from lowmem.data.plan import EpochPlan, Piece, PieceSequence
from lowmem.errors import DataError

Position = list  # [window, raw rows of the window sent, rows skipped so far this epoch]


@dataclass(frozen=True)
class WindowRest:
    """The rows of window `window` of `consumer` in layer `layer` from the `sent`-th on, in emission order."""

    layer: int
    consumer: int
    window: int
    sent: int


@dataclass
class Layer:
    """A layout and the positions its consumers reached (all of them, once the layer is closed)."""

    spec: LayoutSpec
    positions: dict[int, Position]

    def as_dict(self) -> dict[str, Any]:
        positions = {str(consumer): list(position) for consumer, position in sorted(self.positions.items())}
        return {**self.spec.as_dict(), "positions": positions}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Layer":
        positions = {int(consumer): [int(v) for v in position] for consumer, position in data["positions"].items()}
        return cls(LayoutSpec.from_dict(data), positions)


def remainder_pieces(layout: Layout, positions: dict[int, Position],
                     layer: int) -> tuple[list[Piece], list[WindowRest]]:
    """The rows no consumer of `layout` (layer `layer`) has sent, given each consumer's position, as pieces and
    the WindowRests their sources below 0 stand for (see the module doc)."""
    pieces: list[Piece] = []
    rests: dict[WindowRest, int] = {}  # each rest and its source number in the new sequence

    def source_of(rest: WindowRest) -> int:
        return rests.setdefault(rest, -1 - len(rests))

    def carry(piece: Piece) -> Piece:
        # A piece of an earlier remainder keeps pointing at the same rows, under its number in the new sequence.
        if piece.source >= 0:
            return piece
        return Piece(source_of(layout.sequence.rests[-1 - piece.source]), piece.start, piece.stop)

    for consumer in range(layout.spec.consumers):
        order = layout.consumer_order(consumer)
        window, sent, _ = positions.get(consumer, [0, 0, 0])
        if window >= order.num_windows:
            continue
        size = order.window_size(window)
        if 0 < sent < size:
            pieces.append(Piece(source_of(WindowRest(layer, consumer, window, sent)), 0, size - sent))
        if sent > 0:
            window += 1
        if window < order.num_windows:
            pieces.extend(carry(piece) for piece in order.tail_pieces(window))
    return pieces, list(rests)


class EpochLayers:
    """The layers of one epoch: builds each layer's Layout from the plan and the closed layers' positions.

    Args:
        plan: the epoch's plan (its sequence is layer 0's).
        closed: the layers before the current one, each with every consumer's position.
        current: the layout being read now.
        drop_remainder: leave the last few rows of a sequence out so that consumers get equal shares.
    """

    def __init__(self, plan: EpochPlan, closed: list[Layer], current: LayoutSpec, drop_remainder: bool,
                 key: tuple[int, ...]):
        self.plan, self.closed, self.current = plan, closed, current
        self.drop_remainder, self.key = drop_remainder, key
        self._layouts: list[Layout] = []

    def layout(self, layer: int) -> Layout:
        """The Layout of layer `layer` (0 = the epoch's first; `len(closed)` = the current one)."""
        while len(self._layouts) <= layer:
            index = len(self._layouts)
            if index == 0:
                sequence = self.plan.sequence
            else:
                previous = self._layouts[index - 1]
                pieces, rests = remainder_pieces(previous, self.closed[index - 1].positions, index - 1)
                sequence = PieceSequence.of(pieces, tuple(rests))
            spec = self.closed[index].spec if index < len(self.closed) else self.current
            # The first layer keeps the key layouts had before layers existed, so that its order is unchanged;
            # how its consumers are split into processes stays out of every key for the same reason.
            self._layouts.append(Layout(sequence, spec, self.plan.shuffle, self.drop_remainder,
                                        (*self.key, spec.consumers), () if index == 0 else (index,)))
        return self._layouts[layer]

    @property
    def current_layout(self) -> Layout:
        return self.layout(len(self.closed))

    def rest(self, source: int, layer: int) -> WindowRest:
        """The WindowRest that source `source` (< 0) of layer `layer`'s sequence stands for."""
        return self.layout(layer).sequence.rests[-1 - source]


def close_layer(layers: list[Layer], spec: LayoutSpec) -> list[Layer]:
    """Check that the last saved layer has every consumer's position, so that its remainder is known."""
    last = layers[-1]
    missing = sorted(set(range(last.spec.consumers)) - set(last.positions))
    if missing:
        raise DataError(
            f"The saved data position covers {len(last.positions)} of its {last.spec.consumers} readers "
            f"(missing: {missing[:8]}), so the rest of the epoch cannot be shared out to {spec.describe()}. "
            "Load the positions of every process together (`merge_rank_states`), or resume with the same "
            "number of processes and DataLoader workers."
        )
    return layers


StateMerger = Callable[[list[dict[str, Any]]], dict[str, Any]]
# How the saved states of another kind of stream merge (by the state's "kind"): a stream whose states hold other
# streams' states (a mixture) registers its own merge here, so that this module, which it uses, never imports it.
STATE_MERGERS: dict[str, StateMerger] = {}


def register_state_merger(kind: str, merge: StateMerger) -> None:
    """Have `merge_rank_states` merge the states of `kind` with `merge`."""
    STATE_MERGERS[kind] = merge


def merge_rank_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state holding every consumer's position, from the states each rank saved (any order): a ParquetStream's
    here, another kind's by the merge it registered (`register_state_merger`).

    A run that resumes on another number of processes or workers loads this merged state on every rank.
    """
    if not states:
        raise DataError("No saved data positions to merge.")
    first = states[0]
    merge_kind = STATE_MERGERS.get(str(first.get("kind")))
    if merge_kind is not None:
        return merge_kind(states)
    merged_positions: dict[str, Position] = {}
    next_workers: dict[str, int] = {}
    for state in states:
        for field in ("format", "data", "seed", "shuffle", "epoch", "world_size"):
            if state.get(field) != first.get(field):
                raise DataError(f"The saved data positions of the processes disagree on {field}: "
                                f"{first.get(field)!r} and {state.get(field)!r}; they are not from one checkpoint.")
        if state["layers"][:-1] != first["layers"][:-1]:
            raise DataError("The saved data positions of the processes disagree on earlier layouts; "
                            "they are not from one checkpoint.")
        merged_positions.update(state["layers"][-1]["positions"])
        if "rank" in state:
            next_workers[str(state["rank"])] = int(state.get("next_worker", 0))
    last = {**first["layers"][-1], "positions": dict(sorted(merged_positions.items(), key=lambda kv: int(kv[0])))}
    merged = {key: value for key, value in first.items() if key not in ("rank", "next_worker")}
    merged["layers"] = [*first["layers"][:-1], last]
    merged["next_workers"] = next_workers
    return merged
