"""What the loader, the resume and the Trainer need of a stream of rows: `RowStream`, which `ParquetStream` and
`MixedStream` both are (the positions they save differ: a ParquetStream's `Position`, a mixture's
`MixturePosition`, each saved and merged by its own kind, see `lowmem.data.elastic.merge_rank_states`)."""

from __future__ import annotations

from typing import Any, Iterator, Protocol, TypeVar

PositionT = TypeVar("PositionT")


class RowStream(Protocol[PositionT]):
    """A stream of rows read by `rank`'s consumers (its DataLoader workers), whose position is exact and saveable."""

    rank: int
    world_size: int
    seed: int
    epoch: int
    num_workers: int  # the DataLoader workers reading it on each rank (0: the training process itself)
    worker_rotation: int  # which consumer DataLoader worker 0 reads (a resumed loader starts with the one due)
    allow_changed_content: bool  # load a saved position whose files changed content (--allow_config_change)

    @property
    def workers_per_rank(self) -> int: ...

    @property
    def continues_exactly(self) -> bool:
        """Whether the loaded position continues row for row (same processes and workers as at the save)."""

    def __iter__(self) -> Iterator[dict[str, str]]: ...

    def __len__(self) -> int: ...

    def current_consumer(self) -> tuple[int, int]:
        """(this reader's consumer number, the number of consumers)."""

    def set_epoch(self, epoch: int) -> None: ...

    def rank_consumer_rows(self) -> list[int]:
        """The rows each of this rank's consumers reads in the epoch."""

    def position_of(self, consumer: int) -> PositionT:
        """Where `consumer` stands: after the last row it handed out."""

    def skipped_in(self, position: PositionT) -> int:
        """Rows of bad text skipped up to `position`."""

    def state_dict(self) -> dict[str, Any]: ...

    def state_with_positions(self, positions: dict[int, PositionT]) -> dict[str, Any]:
        """The stream's state with these consumers' positions: what a checkpoint saves of it."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def loaded_positions(self) -> dict[int, PositionT]:
        """The positions the last `load_state_dict` gave this rank's consumers."""

    def forget_loaded_positions(self) -> None:
        """Start the next iteration from the epoch's start (the workers took their copies of the positions)."""
