"""The memory schedule of the training loop: cleanups, memory records and the watchdog, by step."""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any, Callable, Iterator

from lowmem.memory.cleanup import cleanup_memory, release_cuda_cache
from lowmem.memory.collector import GrowthCollector
from lowmem.memory.log import MemoryLogger, format_line
from lowmem.memory.phases import PhaseMeter
from lowmem.memory.probe import MemorySnapshot, take_snapshot
from lowmem.memory.watchdog import MemoryWatchdog
from lowmem.program import command_line

logger = logging.getLogger(__name__)


class MemoryMonitor:
    """Call `start`, then `after_step` after every optimizer step, then `end`.

    Every `cleanup_steps` steps: a cleanup and a watchdog check on a cheap snapshot (no USS). Every
    `memory_log_steps` steps: a cleanup, a full snapshot (USS, workers), a record in the memory log and its
    line in the training log, and a watchdog check. A step that is both does the second only. 0 turns either off.
    These cleanups leave the CUDA cache alone (see `release_cuda_cache`); the watchdog empties it when it fires.
    On a GPU they make no full garbage collection either: a record makes one when Python objects grew since the
    previous record (`lowmem.memory.collector`).
    """

    def __init__(self, memory_logger: MemoryLogger, watchdog: MemoryWatchdog | None, on_gpu: bool,
                 cleanup_steps: int = 50, memory_log_steps: int = 200,
                 cleanup: Callable[[bool], int] = cleanup_memory, phases: PhaseMeter | None = None) -> None:
        self.memory_logger, self.watchdog, self.on_gpu = memory_logger, watchdog, on_gpu
        self.cleanup_steps, self.memory_log_steps, self.cleanup = cleanup_steps, memory_log_steps, cleanup
        self.earlier_runs: list[str] = []  # ids of the runs this one resumed, oldest first
        self.collector = GrowthCollector()
        # The phase the process is in (begun with the load, before this monitor existed) and each one's peak.
        self.phases = phases or PhaseMeter()

    def state_dict(self) -> dict[str, Any]:
        """Which memory logs hold this training's records: a resumed run writes a new log under a new id."""
        return {"run_id": self.memory_logger.run_id, "earlier_runs": self.earlier_runs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.earlier_runs = [*state.get("earlier_runs", []), state["run_id"]]
        self.memory_logger.continues = list(self.earlier_runs)
        # The logs are in <run folder>/logs/: memlog on the run folder reads every segment, joined.
        logger.info("Memory log: run %s continues runs %s (`%s` reads them joined).", self.memory_logger.run_id,
                    ", ".join(self.earlier_runs), command_line(f"memlog {self.memory_logger.path.parent.parent}"))

    def start(self, epoch: int, step: int) -> dict[str, Any]:
        """Log the memory before training (after the model and data are set up)."""
        return self._record(epoch, step, "start", freed=0)

    def after_step(self, epoch: int, step: int) -> dict[str, Any] | None:
        """Run what is due at `step`; returns the record when one was written."""
        if self.memory_log_steps and step % self.memory_log_steps == 0:
            return self._record(epoch, step, "record", freed=self.cleanup(self.on_gpu))
        if self.cleanup_steps and step % self.cleanup_steps == 0:
            freed = self.cleanup(self.on_gpu)
            self._watch(take_snapshot(include_uss=False), epoch, step, freed)
        return None

    def enter_phase(self, phase: str | None, epoch: int, step: int) -> None:
        """Begin `phase` (None: none); the phase that ends gets its record in the memory log: its own peak and the
        plan's figure for it (see `lowmem.memory.phases`)."""
        ended = self.phases.enter(phase)
        if ended is not None:
            record = self.memory_logger.log(take_snapshot(include_uss=False), epoch, step, event="phase", phase=ended)
            logger.debug(format_line(record))

    @contextlib.contextmanager
    def phase(self, phase: str, epoch: int, step: int) -> Iterator[None]:
        """`phase` for the duration of the block, the phase it interrupts begun again after it."""
        interrupted = self.phases.current
        self.enter_phase(phase, epoch, step)
        try:
            yield
        finally:
            self.enter_phase(interrupted, epoch, step)

    def end(self, epoch: int, step: int) -> dict[str, Any]:
        """Log the memory after training (the phase under way ended first) and close the memory log."""
        self.enter_phase(None, epoch, step)
        if self.phases.peaks:
            logger.info("Memory by phase, rank %d: %s.", self.memory_logger.rank, self.phases.describe(),
                        extra={"all_ranks": True})
        record = self._record(epoch, step, "end", freed=self.cleanup(self.on_gpu))
        self.memory_logger.close()
        return record

    def _record(self, epoch: int, step: int, event: str, freed: int) -> dict[str, Any]:
        snapshot = take_snapshot()
        record = self.memory_logger.log(snapshot, epoch, step, event=event, freed=freed)
        logger.info(format_line(record))
        if self.on_gpu:  # the CPU's routine cleanups collected already
            self.collector.observe(snapshot.python_objects)
        self._watch(snapshot, epoch, step, freed)
        return record

    def _watch(self, snapshot: MemorySnapshot, epoch: int, step: int, freed: int) -> None:
        """Run the watchdog on a snapshot taken just after a cleanup, and log a record when it fires."""
        if self.watchdog is None:
            return
        # The cleanup has just run: when the watchdog fires it only adds what the routine cleanup leaves
        # out (the CUDA cache), then re-measures.
        result = self.watchdog.check(snapshot, self.on_gpu, cleanup=lambda on_gpu: self._forced(on_gpu, freed),
                                     step=step)
        if result is not None:
            self.memory_logger.log(result.after, epoch, step, event="watchdog", freed=result.freed)

    @staticmethod
    def _forced(on_gpu: bool, freed: int) -> int:
        """The watchdog's cleanup right after a routine one: what that one leaves out on a GPU (a full collection,
        the CUDA cache); returns the routine cleanup's bytes."""
        if on_gpu:
            gc.collect()
        release_cuda_cache(on_gpu)
        return freed
