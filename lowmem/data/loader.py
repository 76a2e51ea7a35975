"""StreamLoader: a DataLoader over a stream of rows (`RowStream`: a ParquetStream or a MixedStream) whose position
can be saved and restored exactly."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data import default_convert

from lowmem.data.stream import Position
from lowmem.data.stream_type import RowStream
from lowmem.errors import LowmemError

if TYPE_CHECKING:
    from lowmem.data.mixture import MixedStream, MixturePosition

Collate = Callable[[list[dict[str, str]]], Any]


def _ignore_interrupts(worker_id: int) -> None:
    """Workers leave Ctrl+C to the training process, which stops them after saving a checkpoint."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _as_list(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return rows


def _convert_batch(item: tuple[Any, int, Any]) -> tuple[Any, int, Any]:
    """What the DataLoader does to each batch (numpy arrays to tensors), left undone to its reader's position,
    which is plain numbers that only the loader reads."""
    batch, consumer, position = item
    return default_convert(batch), consumer, position


@dataclass
class WorkerFailure:
    """An error a user can fix (bad data, a file gone) that stopped a DataLoader worker, carried to the training
    process as an item: raised there as it is, it reads as it would without workers (torch would re-raise it
    wrapped in its worker's traceback)."""

    error: LowmemError


class _BatchedStream(IterableDataset):
    """Batches and collates rows where they are read (in the worker), tagging each batch with the
    reading consumer and its position just after the batch's last row."""

    def __init__(self, stream: "RowStream[Any]", batch_size: int, collate_fn: Collate, drop_last: bool):
        super().__init__()
        self.stream, self.batch_size, self.collate_fn, self.drop_last = stream, batch_size, collate_fn, drop_last

    def __iter__(self) -> Iterator[tuple[Any, int, Position | MixturePosition | None]]:
        rows = iter(self.stream)
        consumer, _ = self.stream.current_consumer()
        try:
            yield from self._batches(rows, consumer)
        except LowmemError as error:
            if get_worker_info() is None:  # the training process itself: raised as it is
                raise
            yield WorkerFailure(error), consumer, None

    def _batches(self, rows: Iterator[dict[str, str]],
                 consumer: int) -> Iterator[tuple[Any, int, Position | MixturePosition]]:
        batch: list[dict[str, str]] = []
        for row in rows:
            batch.append(row)
            if len(batch) == self.batch_size:
                yield self.collate_fn(batch), consumer, self.stream.position_of(consumer)
                batch = []
        if batch and not self.drop_last:
            yield self.collate_fn(batch), consumer, self.stream.position_of(consumer)


class StreamLoader:
    """Batches of a stream of rows (`RowStream`) through a torch DataLoader, with an exact, saveable position.

    Rows are batched and collated inside the workers. Every batch carries its worker's stream position,
    and the loader records it when the batch is handed to the caller, so `state_dict()` describes
    exactly the batches the caller has received: batches the DataLoader prefetched but did not hand
    over are read again after a resume. Restored with the same `num_workers` (and world size) the batches
    continue exactly; with others, the rest of the epoch is shared out anew.

    Args:
        stream: the stream to read, a ParquetStream or a MixedStream (its `num_workers` is set to this loader's).
        batch_size: rows per batch.
        collate_fn: turns a list of row dicts into a batch (default: the list itself).
        num_workers: DataLoader worker processes for this rank; each reads its own share of the rank's rows.
        pin_memory: pin batches in page-locked memory (for faster host-to-GPU copies).
        drop_last: drop each worker's last incomplete batch.
        prefetch_factor: batches each worker prepares ahead (only with workers).
    """

    def __init__(
        self,
        stream: "RowStream[Any]",
        batch_size: int,
        collate_fn: Collate | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
        prefetch_factor: int | None = None,
    ):
        self.stream = stream
        self.batch_size = int(batch_size)
        self.collate_fn = collate_fn or _as_list
        self.num_workers = int(num_workers)
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.prefetch_factor = prefetch_factor if num_workers > 0 else None
        stream.num_workers = self.num_workers
        # Positions are the stream's own (Position, or MixturePosition for a MixedStream), handed back to it.
        self._loaded: dict[int, Any] = {}  # positions from load_state_dict, until a batch supersedes them
        self._delivered: dict[int, Any] = {}  # positions after the last batch handed to the caller
        self._next_worker = 0  # the rank-local consumer whose batch the DataLoader hands over next

    def __len__(self) -> int:
        """Batches this rank yields per epoch (before rows with null or empty values are skipped)."""
        batches = (rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)
                   for rows in self.stream.rank_consumer_rows())
        return sum(batches)

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def set_epoch(self, epoch: int) -> None:
        """Move to another epoch (a no-op for the current one, so a loaded position survives it).

        A stream that carries positions from one epoch into the next (a MixedStream, whose sources go on where
        they stopped) is given the readers' positions after the last batches handed out."""
        if epoch == self.stream.epoch:
            return
        if getattr(self.stream, "carries_positions", False):  # a MixedStream
            cast("MixedStream", self.stream).set_epoch(epoch, {**self._loaded, **self._delivered})
            self._loaded = self.stream.loaded_positions()
        else:
            self.stream.set_epoch(epoch)
            self._loaded = {}
        self._delivered, self._next_worker = {}, 0

    @property
    def skipped_rows(self) -> int:
        """Rows skipped this epoch for null or empty values, over the batches delivered so far."""
        return sum(self.stream.skipped_in(position) for position in {**self._loaded, **self._delivered}.values())

    def __iter__(self) -> Iterator[Any]:
        loader = DataLoader(
            _BatchedStream(self.stream, self.batch_size, self.collate_fn, self.drop_last),
            batch_size=None,
            # torch types collate_fn for batched loading (a list of items); with batch_size=None it gets each item.
            collate_fn=_convert_batch,  # type: ignore[arg-type]
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=False,  # workers must see set_epoch and loaded positions on every epoch
            # Each new iterator draws a seed for its workers; from the global RNG that draw would shift the
            # model's random numbers (dropout) whenever iterators are created, e.g. once more after a resume.
            # The stream's order comes from its own seed, so a private generator changes nothing else.
            generator=torch.Generator().manual_seed(self.stream.seed),
            worker_init_fn=_ignore_interrupts,
        )
        batches = iter(loader)
        if self.num_workers > 0:
            # The workers hold their copies of the loaded positions now; a later iteration starts afresh.
            self.stream.forget_loaded_positions()
        first_consumer = self.stream.rank * self.stream.workers_per_rank
        for batch, consumer, position in batches:
            if isinstance(batch, WorkerFailure):
                raise batch.error
            self._delivered[consumer] = position
            self._next_worker = (consumer - first_consumer + 1) % self.stream.workers_per_rank
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out: small and JSON-serialisable."""
        state = self.stream.state_with_positions({**self._loaded, **self._delivered})
        state["next_worker"] = self._next_worker
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: the next iteration yields exactly the batches that followed it.

        `state` is this rank's saved state, or every rank's merged (`lowmem.data.elastic.merge_rank_states`).
        Saved with the same processes and workers, the batches continue row for row; otherwise the rows no
        old reader had handed over are shared out anew (a merged state is needed then).
        """
        self.stream.load_state_dict(state)
        self._loaded = self.stream.loaded_positions()
        self._delivered = {}
        exact = self.stream.continues_exactly
        next_workers = state.get("next_workers", {})
        next_worker = next_workers.get(str(self.stream.rank), state.get("next_worker", 0) if "rank" in state else 0)
        # DataLoader workers take turns from worker 0: rotate so the consumer that was due comes first.
        self._next_worker = int(next_worker) if exact else 0
        self.stream.worker_rotation = self._next_worker
