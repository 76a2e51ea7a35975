"""MixedStream: rows of several sources in set proportions, each source with epochs of its own, resumed exactly.

A mixture is a list of sources, each a file, folder or glob of parquet files read by a ParquetStream of its own,
with a weight. Every reader (consumer) takes its rows from the sources by a fixed rule, smooth weighted
round-robin: the next row comes from the source furthest behind its share, so that after n rows every source has
given within one row of `weight × n`, and every batch follows the weights to a row.

Epochs. A source that runs out starts its next epoch (a small source is repeated, in a new order each time); one
that is not used up goes on where it stopped in the next epoch of the mixture. An epoch of the mixture is as many
rows as all sources hold together (what reading each once would give), shared equally among the readers; with
weights equal to the sources' shares of the rows, an epoch reads each source about once.

Positions. Each reader's position is the rows it took from each source this epoch and, per source, the source's
epoch and its ParquetStream position there. The state holds, per source, a ParquetStream state for every source
epoch a reader is in, so a resume with the same readers continues row for row, and a resume on another number of
processes or workers shares out the rest of every source's epochs anew (`lowmem.data.elastic`), each row once.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from lowmem.data.elastic import Layer, merge_rank_states, register_state_merger
from lowmem.data.plan import consumer_range
from lowmem.data.sources import DEFAULT_COLUMNS
from lowmem.data.stream import ConsumerNumbering, ParquetStream
from lowmem.config.train_sources import Source
from lowmem.errors import DataError

logger = logging.getLogger(__name__)

STATE_KIND = "mixture"
STATE_FORMAT = 1
_BLOCK_ROWS = 1024  # source choices computed at a time
_SOURCE_SEED_STRIDE = 1_000_003  # source i reads in the order of seed + i × this: the first keeps the run's seed

MixturePosition = dict  # {"taken": [rows per source this epoch], "at": [[source epoch, window, sent, skipped], ...]}


_WEIGHT_SCALE = 10**6  # weights are compared as whole millionths: exact, so ties fall the same way every time


def smooth_round_robin(weights: Sequence[float], taken: Sequence[int], rows: int) -> list[int]:
    """The sources of the next `rows` rows, after `taken` rows from each: each row from the source whose share
    (weight × rows so far) is furthest ahead of the rows it gave; ties to the first.

    In whole numbers (weights in millionths), so that the same counts always give the same choices: a resumed
    reader continues the choices of an uninterrupted one."""
    scaled = [max(1, round(weight * _WEIGHT_SCALE)) for weight in weights]
    whole = sum(scaled)
    counts = list(taken)
    total = sum(counts)
    lags = [share * total - count * whole for share, count in zip(scaled, counts)]
    start = list(lags)
    sources = range(len(weights))
    choices: list[int] = []
    for _ in range(rows):  # a plain loop: this runs for every row read
        for source in sources:
            lags[source] += scaled[source]
        best = max(sources, key=lags.__getitem__)  # the first of the largest
        lags[best] -= whole
        choices.append(best)
        # The lags are the rule's whole state: once they are back where they started, the choices repeat
        # (after 10 rows at 0.7/0.3).
        if lags == start:
            return (choices * (rows // len(choices) + 1))[:rows]
    return choices


def _not_started() -> dict[str, str]:
    raise StopIteration


class _Reading:
    """One reader's progress in the current block of choices (the position is read from it between rows)."""

    def __init__(self, taken: list[int], at_epoch: list[int]):
        self.taken = list(taken)  # rows from each source before the current block
        self.at_epoch = list(at_epoch)  # each source's epoch this reader is in
        self._block: list[int] = []  # the block's choices, then the end-of-block mark
        self._after: np.ndarray | None = None  # (rows of the block + 1, sources): rows from each after i choices
        self._left: Any = None

    def start_block(self, block: list[int], end_mark: int) -> Iterator[int]:
        chosen = np.zeros((len(block) + 1, len(self.taken)), dtype=np.int64)
        chosen[np.arange(1, len(block) + 1), block] = 1
        self._after = np.cumsum(chosen, axis=0) + np.asarray(self.taken, dtype=np.int64)
        self._block = [*block, end_mark]
        choices = iter(self._block)
        # A list iterator has __length_hint__ (the choices not yet taken); typeshed types iter(list) as an Iterator.
        self._left = choices.__length_hint__  # type: ignore[attr-defined]
        return choices

    def last_choice(self) -> int:
        """The choice taken last from the block (the source that just ran out, or the end mark)."""
        return self._block[len(self._block) - 1 - self._left()]

    def end_block(self) -> None:
        assert self._after is not None  # set by start_block
        self.taken = self._after[-1].tolist()
        self._after, self._left = None, None

    def taken_now(self) -> list[int]:
        if self._after is None:
            return list(self.taken)
        done = min(len(self._block) - self._left(), len(self._after) - 1)
        return self._after[done].tolist()


def _call(function: Any) -> Any:
    return function()


class MixedStream(ConsumerNumbering, IterableDataset):
    """Rows of several sources, as dicts `{column: str}`, mixed by weight, in bounded memory, with exact resume.

    Args:
        sources: the sources and their weights (normalised to sum to 1).
        columns: the text columns every source's files have.
        buffer_size, mix_row_groups: as for ParquetStream, for the whole mixture: each source reads its weight's
            share of them (at least 1), so that memory holds about as much as one stream with these settings.
        seed: the run's seed; source i reads in the order of its own seed (the first source the run's).
        Other arguments are given to each source's ParquetStream.

    Readers (ranks × DataLoader workers) each take `total_rows // readers` rows per epoch, where total_rows sums
    every source's rows.
    """

    carries_positions = True  # StreamLoader hands over the readers' positions at an epoch's end (see set_epoch)

    def __init__(self, sources: Sequence[Source], columns: Sequence[str] = DEFAULT_COLUMNS, buffer_size: int = 5000,
                 mix_row_groups: int = 16, seed: int = 0, rank: int = 0, world_size: int = 1, **stream_args: Any):
        super().__init__()
        if not sources:
            raise DataError("A mixture needs at least one source.")
        total = sum(source.weight for source in sources)
        self.sources = list(sources)
        self.weights = [source.weight / total for source in sources]
        self.columns, self.seed = tuple(columns), int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self._bases = [
            ParquetStream(source.path, columns=columns, buffer_size=max(1, round(buffer_size * weight)),
                          mix_row_groups=max(1, round(mix_row_groups * weight)),
                          seed=self.seed + _SOURCE_SEED_STRIDE * i,
                          rank=rank, world_size=world_size, **stream_args)
            for i, (source, weight) in enumerate(zip(self.sources, self.weights))]
        self.epoch = 0
        self._epoch_streams: dict[tuple[int, int], ParquetStream] = {}  # (source, its epoch) → its stream here
        self._ends: dict[tuple[int, int, int], list[int]] = {}  # (source, epoch, reader) → its end position
        self.num_workers = int(stream_args.get("num_workers", 0))
        self.worker_rotation = 0
        self._quota: dict[int, int] = {}  # rows each reader takes this epoch, when not the equal share
        self._taken: dict[int, list[int]] = {}  # loaded rows per source of this rank's readers
        self._saved: list[dict[int, dict[str, Any]]] = [{} for _ in self.sources]  # source → epoch → its state
        self._at: list[dict[int, int]] = [{} for _ in self.sources]  # source → reader → loaded epoch
        self._exact = False
        self._live: dict[int, tuple[_Reading, list[ParquetStream | None]]] = {}

    # ----- what ParquetStream offers too ------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        """DataLoader workers per rank that read this mixture (StreamLoader sets it); every source follows it."""
        return self._num_workers

    @num_workers.setter
    def num_workers(self, workers: int) -> None:
        self._num_workers = int(workers)
        self._set_on_sources("num_workers", self._num_workers)

    @property
    def worker_rotation(self) -> int:
        """Which reader DataLoader worker 0 reads (a resumed loader starts with the one whose batch was due)."""
        return self._worker_rotation

    @worker_rotation.setter
    def worker_rotation(self, rotation: int) -> None:
        # Forked DataLoader workers inherit the source streams already built here: they must number readers alike.
        self._worker_rotation = int(rotation)
        self._set_on_sources("worker_rotation", self._worker_rotation)

    def _set_on_sources(self, name: str, value: Any) -> None:
        """Set a setting every source stream follows, on the sources and the streams built of them."""
        for stream in [*self._bases, *self._epoch_streams.values()]:
            setattr(stream, name, value)

    @property
    def total_rows(self) -> int:
        """Rows of every source together: an epoch of the mixture."""
        return sum(base.index.num_rows for base in self._bases)

    @property
    def allow_changed_content(self) -> bool:
        return self._bases[0].allow_changed_content

    @allow_changed_content.setter
    def allow_changed_content(self, allow: bool) -> None:
        self._set_on_sources("allow_changed_content", bool(allow))

    @staticmethod
    def skipped_in(position: MixturePosition) -> int:
        """Rows skipped (null, empty or undecodable) in the source epochs a position is in."""
        return sum(int(at[3]) for at in position["at"])

    def describe(self) -> str:
        """The sources, their shares and rows, and an epoch's rows, in words."""
        sources = ", ".join(f"{source.path} ({weight:.0%}, {base.index.num_rows:,} rows)"
                            for source, weight, base in zip(self.sources, self.weights, self._bases))
        return f"{sources}; an epoch is {self.total_rows:,} rows, every source's together"

    def quota(self, consumer: int) -> int:
        """Rows reader `consumer` takes this epoch."""
        if consumer in self._quota:
            return self._quota[consumer]
        start, stop = consumer_range(consumer, self.num_consumers, self.total_rows, True)
        return stop - start

    def rank_consumer_rows(self) -> list[int]:
        """Rows each of this rank's readers takes this epoch."""
        first = self.rank * self.workers_per_rank
        return [self.quota(consumer) for consumer in range(first, first + self.workers_per_rank)]

    def __len__(self) -> int:
        """Rows this rank takes this epoch."""
        return sum(self.rank_consumer_rows())

    def close(self) -> None:
        """Close every source's open files (reading reopens them)."""
        for stream in [*self._bases, *self._epoch_streams.values()]:
            stream.close()

    def __getstate__(self) -> dict[str, Any]:
        # Sent to DataLoader workers: each builds its own source streams as it reaches them.
        state = self.__dict__.copy()
        state["_epoch_streams"], state["_live"] = {}, {}
        return state

    # ----- the source streams ---------------------------------------------------------------------------
    def _first_epoch(self, source: int, consumer: int) -> int:
        """The source epoch a reader starts in: where it was when saved, with the same readers; with others, the
        first one any old reader was in (each new reader reads its share of every epoch's rest)."""
        if self._exact and consumer in self._at[source]:
            return self._at[source][consumer]
        return min(self._saved[source]) if self._saved[source] else 0

    def _source_at(self, source: int, epoch: int) -> ParquetStream:
        """Source `source`'s stream in its epoch `epoch`, from its saved state there if there is one."""
        key = (source, epoch)
        if key not in self._epoch_streams:
            if get_worker_info() is None:
                # Computed once, here, and taken along by every copy (and by DataLoader workers forked later):
                # the copies check saved positions against it and write it into states.
                self._bases[source].content_fingerprint()
            stream = self._bases[source].for_epoch(epoch)
            stream.num_workers, stream.worker_rotation = self._num_workers, self._worker_rotation
            if epoch in self._saved[source]:
                stream.load_state_dict(self._saved[source][epoch])
            self._epoch_streams[key] = stream
        return self._epoch_streams[key]

    def _end_position(self, source: int, epoch: int, consumer: int) -> list[int]:
        """Reader `consumer`'s position at the end of its share of a source epoch (it has moved on)."""
        key = (source, epoch, consumer)
        if key not in self._ends:
            self._ends[key] = self._source_at(source, epoch).end_position(consumer, self.num_consumers)
        return self._ends[key]

    def _forget_before(self, source: int, epoch: int) -> None:
        """Drop source `source`'s streams of epochs before `epoch`: no reader of this process goes back to them."""
        for key in [key for key in self._epoch_streams if key[0] == source and key[1] < epoch]:
            self._epoch_streams.pop(key).close()
        self._ends = {key: end for key, end in self._ends.items() if key[0] != source or key[1] >= epoch}

    # ----- iteration ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, str]]:
        consumer, _ = self.current_consumer()
        taken = self._taken.get(consumer, [0] * len(self.sources))
        reading = _Reading(taken, [self._first_epoch(source, consumer) for source in range(len(self.sources))])
        streams: list[ParquetStream | None] = [None] * len(self.sources)
        self._live[consumer] = (reading, streams)
        return self._iter_rows(consumer, reading, streams)

    def _iter_rows(self, consumer: int, reading: _Reading, streams: list[ParquetStream | None]) -> Iterator[dict]:
        end_mark = len(self.sources)
        nexts: list[Any] = [_not_started] * end_mark + [_not_started]  # the end mark's: the block ends there
        left = self.quota(consumer) - sum(reading.taken)
        while left > 0:
            block = smooth_round_robin(self.weights, reading.taken, min(left, _BLOCK_ROWS))
            choices = reading.start_block(block, end_mark)
            while True:
                # Each row is fetched and handed on by map in C, not by a Python loop: a mixture reads about as
                # fast as one source. The map stops where a source runs out (or has not started) or at the mark.
                yield from map(_call, map(nexts.__getitem__, choices))
                source = reading.last_choice()
                if source == end_mark:
                    break
                row, nexts[source] = self._next_row(source, reading, streams)
                yield row
            reading.end_block()
            left -= len(block)

    def _next_row(self, source: int, reading: _Reading, streams: list[ParquetStream | None]) -> tuple[dict, Any]:
        """The next row of `source`, where it starts here or after its epoch ran out, and the rows' iterator."""
        advance = streams[source] is not None
        while True:
            if advance:
                reading.at_epoch[source] += 1
                self._forget_before(source, reading.at_epoch[source])
            advance = True
            epoch = reading.at_epoch[source]
            streams[source] = stream = self._source_at(source, epoch)
            rows = iter(stream)
            for row in rows:
                return row, rows.__next__
            if epoch not in self._saved[source]:  # a whole fresh epoch without a row (a saved one may be done)
                raise self._no_rows(source)

    def _no_rows(self, source: int) -> DataError:
        rows, readers = self._bases[source].index.num_rows, self.num_consumers
        path = self.sources[source].path
        if rows < readers:
            return DataError(f"The source '{path}' of the mixture has {rows} rows, fewer than the {readers} readers "
                             "(processes × DataLoader workers) that share each of its epochs equally, so each gets "
                             "none. Give it more rows (repeat them in its file), or read with fewer workers "
                             "(--dataloader_num_workers).")
        return DataError(f"The source '{path}' of the mixture gave this reader no row in a whole epoch: every row of "
                         "its share has a null or empty value. Fix or remove that source.")

    def position_of(self, consumer: int) -> MixturePosition:
        """A copy of reader `consumer`'s position (for readers iterating in this process)."""
        reading, streams = self._live[consumer]
        at = []
        for source, stream in enumerate(streams):
            epoch = reading.at_epoch[source]
            if stream is None:
                position = self._loaded_position(source, consumer, epoch)
            else:
                position = stream.position_of(consumer)  # iterating: `_next_row` starts it as it sets it
            at.append([epoch, *position])
        return {"taken": reading.taken_now(), "at": at}

    def _loaded_position(self, source: int, consumer: int, epoch: int) -> list[int]:
        saved = self._saved[source].get(epoch)
        if saved is None or not self._exact:
            return [0, 0, 0]
        return list(saved["layers"][-1]["positions"].get(str(consumer), [0, 0, 0]))

    # ----- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position of this rank's readers iterating in this process (see `state_with_positions`)."""
        return self.state_with_positions({consumer: self.position_of(consumer) for consumer in self._live})

    def state_with_positions(self, positions: dict[int, MixturePosition]) -> dict[str, Any]:
        """The state of this rank's readers at the given positions (a reader not given is where it was loaded,
        or at the start): small and JSON-serialisable, never rows."""
        own = range(self.rank * self.workers_per_rank, (self.rank + 1) * self.workers_per_rank)
        loaded = self.loaded_positions()
        positions = {consumer: positions.get(consumer) or loaded.get(consumer) or self._fresh_position(consumer)
                     for consumer in own}
        source_states, at_maps = [], []
        for source, base in enumerate(self._bases):
            base.content_fingerprint()
            at = {consumer: int(positions[consumer]["at"][source][0]) for consumer in own}
            first = min(at.values())
            self._forget_before(source, first)  # epochs every reader here has left (none reads them again)
            # Loaded epochs beyond every reader here are kept as they were loaded (after a change of readers they
            # hold the old readers' progress), with this rank's readers not yet in them.
            last = max([*at.values(), *(epoch for epoch in self._saved[source] if epoch >= first)])
            states = {}
            for epoch in range(first, last + 1):
                stream = self._source_at(source, epoch)
                here = {consumer: (list(positions[consumer]["at"][source][1:]) if at[consumer] == epoch
                                   else self._end_position(source, epoch, consumer))
                        for consumer in own if at[consumer] >= epoch}
                states[str(epoch)] = stream.state_with_positions(here)
            source_states.append(states)
            at_maps.append({str(consumer): epoch for consumer, epoch in at.items()})
        return {
            "kind": STATE_KIND, "format": STATE_FORMAT, "epoch": self.epoch, "seed": self.seed,
            "weights": self.weights, "sources": [base.index.fingerprint for base in self._bases],
            "paths": [source.path for source in self.sources],
            "rank": self.rank, "world_size": self.world_size, "workers_per_rank": self.workers_per_rank,
            "consumers": self.num_consumers,
            "quota": {str(consumer): self.quota(consumer) for consumer in own},
            "taken": {str(consumer): list(positions[consumer]["taken"]) for consumer in own},
            "at": at_maps, "source_states": source_states,
        }

    def _fresh_position(self, consumer: int) -> MixturePosition:
        at = []
        for source in range(len(self.sources)):
            epoch = self._first_epoch(source, consumer)
            at.append([epoch, *self._loaded_position(source, consumer, epoch)])
        return {"taken": list(self._taken.get(consumer, [0] * len(self.sources))), "at": at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: with the same readers row for row; with others (every rank's state
        merged, `merge_mixture_states`), the rest of the epoch and of every source's epochs shared out anew."""
        _check_mixture_state(self, state)
        old_readers = int(state["consumers"])
        quota = {int(consumer): int(rows) for consumer, rows in state["quota"].items()}
        taken = {int(consumer): [int(rows) for rows in counts] for consumer, counts in state["taken"].items()}
        self._exact = (old_readers == self.num_consumers and int(state["world_size"]) == self.world_size
                       and self._same_layouts(state))
        if self._exact:
            self._quota, self._taken = quota, taken
        else:
            if len(quota) != old_readers:
                raise DataError("Resuming a mixture on another number of processes or workers needs every process's "
                                "saved position (merged); this state holds only some of them.")
            left = sum(quota[consumer] - sum(taken[consumer]) for consumer in quota)
            ranges = (consumer_range(consumer, self.num_consumers, left, True)
                      for consumer in range(self.num_consumers))
            self._quota = {consumer: stop - start for consumer, (start, stop) in enumerate(ranges)}
            self._taken = {}
            logger.info("Data: the rest of epoch %d of the mixture (%d rows), saved by %d readers, is shared out anew "
                        "among %d.", int(state["epoch"]), left, old_readers, self.num_consumers)
        self.epoch = int(state["epoch"])
        self._at = [{int(consumer): int(epoch) for consumer, epoch in at.items()} for at in state["at"]]
        self._saved = [{int(epoch): source_state for epoch, source_state in states.items()}
                       for states in state["source_states"]]
        if not self._exact:
            for source in range(len(self.sources)):
                self._complete_epochs(source, old_readers)
        self._open_saved_epochs()

    def _open_saved_epochs(self) -> None:
        """The streams of every saved source epoch, built now, on the main process: other data is refused before
        training starts, and DataLoader workers forked later find them built."""
        self._replace_epoch_streams()
        for source, saved in enumerate(self._saved):
            for epoch in saved:
                self._source_at(source, epoch)

    def _same_layouts(self, state: dict[str, Any]) -> bool:
        """Whether every saved source epoch was read in the layout each source reads now (the same readers, lanes
        and windows): only then does every reader continue where it was."""
        return all(Layer.from_dict(source_state["layers"][-1]).spec == base.layout_spec(self.num_consumers)
                   for base, states in zip(self._bases, state["source_states"]) for source_state in states.values())

    def _complete_epochs(self, source: int, old_readers: int) -> None:
        """Every source epoch an old reader was in, with every old reader's position in it: a reader already past
        it has read its share, one not yet in it has read nothing (a rank saves only the epochs its readers are in)."""
        at = self._at[source]
        if not at:
            return
        template = next(iter(self._saved[source].values()))
        for epoch in range(min(at.values()), max(at.values()) + 1):
            if epoch not in self._saved[source]:
                last = {**template["layers"][-1], "positions": {}}
                self._saved[source][epoch] = {**template, "epoch": epoch, "layers": [last]}
            state = self._saved[source][epoch]
            positions = state["layers"][-1]["positions"]
            for consumer in range(old_readers):
                if str(consumer) not in positions:
                    positions[str(consumer)] = (self._finished_when_saved(source, state, consumer)
                                                if at.get(consumer, epoch) > epoch else [0, 0, 0])

    def _finished_when_saved(self, source: int, state: dict[str, Any], consumer: int) -> list[int]:
        """The position of an old reader at the end of its share of a saved source epoch."""
        layers = [Layer.from_dict(layer) for layer in state["layers"]]
        return self._bases[source].for_epoch(int(state["epoch"])).end_position(consumer, saved_layers=layers)

    def _replace_epoch_streams(self) -> None:
        for stream in self._epoch_streams.values():
            stream.close()
        self._epoch_streams, self._ends, self._live = {}, {}, {}

    def loaded_positions(self) -> dict[int, MixturePosition]:
        """Loaded positions of this rank's readers (read the same way again), when they continue exactly."""
        if not self._exact:
            return {}
        first = self.rank * self.workers_per_rank
        return {consumer: self._fresh_position(consumer) for consumer in range(first, first + self.workers_per_rank)
                if consumer in self._taken}

    @property
    def continues_exactly(self) -> bool:
        """True when the loaded position is read by the readers and layouts that saved it (row for row)."""
        return self._exact

    def forget_loaded_positions(self) -> None:
        """Nothing to drop: a loaded position stays this epoch's starting point until the epoch changes."""

    def set_epoch(self, epoch: int, positions: dict[int, MixturePosition] | None = None) -> None:
        """Start epoch `epoch` of the mixture. `positions` (this rank's readers at the end of the last epoch, from
        StreamLoader) carry every source's position over: sources do not restart with the mixture's epochs."""
        if epoch == self.epoch:
            return
        if positions:
            carried = self.state_with_positions(positions)
            self._at = [{int(consumer): int(at) for consumer, at in ats.items()} for ats in carried["at"]]
            self._saved = [{int(at): state for at, state in states.items()} for states in carried["source_states"]]
            self._exact = True
        self._open_saved_epochs()
        self._quota, self._taken = {}, {}
        self.epoch = int(epoch)
        self.worker_rotation = 0  # a new epoch's readers start with worker 0, as StreamLoader expects


def _check_mixture_state(stream: MixedStream, state: dict[str, Any]) -> None:
    """Refuse a saved position that is not this mixture's, and say why."""
    if not isinstance(state, dict) or state.get("kind") != STATE_KIND:
        raise DataError("The saved data position is of one training file, not of a mixture of sources: resume with "
                        "the --train_file the run was started with, or start a new run (--output_dir) for the mixture.")
    if state.get("format") != STATE_FORMAT:
        raise DataError(f"The saved mixture position has format {state.get('format')!r}, which this version does "
                        "not read; resume with the version that saved it.")
    differences = []
    if len(state["sources"]) != len(stream.sources):
        differences.append(f"it had {len(state['sources'])} sources, now {len(stream.sources)}")
    else:
        differences += [f"the files of source {i + 1} ({source.path}) changed" for i, (source, saved, base)
                        in enumerate(zip(stream.sources, state["sources"], stream._bases))
                        if saved != base.index.fingerprint]
        if any(abs(saved - now) > 1e-9 for saved, now in zip(state["weights"], stream.weights)):
            differences.append(f"the weights were {state['weights']}, now {stream.weights}")
    if int(state["seed"]) != stream.seed:
        differences.append(f"seed was {state['seed']}, now {stream.seed}")
    if differences:
        raise DataError("The saved mixture position does not fit these sources: " + "; ".join(differences) +
                        ". Resume with the same --train_sources and seed, or start a new run (--output_dir).")


def merge_mixture_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One mixture state holding every reader's position, from the states each rank saved (any order)."""
    first = states[0]
    for state in states:
        for field in ("kind", "format", "epoch", "world_size", "consumers", "weights", "sources", "seed"):
            if state.get(field) != first.get(field):
                raise DataError(f"The saved data positions of the processes disagree on {field}: "
                                f"{first.get(field)!r} and {state.get(field)!r}; they are not from one checkpoint.")
    merged = {key: value for key, value in first.items() if key not in ("rank", "next_worker")}
    for field in ("quota", "taken"):
        merged[field] = {consumer: value for state in states for consumer, value in state[field].items()}
    merged["at"] = [{consumer: epoch for state in states for consumer, epoch in state["at"][source].items()}
                    for source in range(len(first["sources"]))]
    merged["source_states"] = []
    for source in range(len(first["sources"])):
        epochs = sorted({int(epoch) for state in states for epoch in state["source_states"][source]})
        merged["source_states"].append({
            str(epoch): merge_rank_states([state["source_states"][source][str(epoch)] for state in states
                                           if str(epoch) in state["source_states"][source]])
            for epoch in epochs})
    merged["next_workers"] = {str(state["rank"]): int(state.get("next_worker", 0))
                              for state in states if "rank" in state}
    return merged


register_state_merger(STATE_KIND, merge_mixture_states)
