"""The memory watchdog: a rank close to its share of the budget cleans up, and says what to lower if that fails."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from lowmem.memory.cleanup import forced_cleanup
from lowmem.memory.probe import MemorySnapshot, take_snapshot
from lowmem.units import MB

logger = logging.getLogger(__name__)
# The settings that set a rank's own memory: rows per micro-batch (collated tensors, activations on the
# CPU), rows held by the shuffle buffer, and tokens per row.
SETTINGS_TO_LOWER = ("batch_size_per_gpu", "dataloader_buffer_size", "max_seq_len")


def _describe(snapshot: MemorySnapshot) -> str:
    """The footprint in words: RSS, plus the workers' USS when they have any."""
    text = f"RSS {snapshot.rss / MB:,.0f} MB"
    if snapshot.workers_uss:
        text += f" + workers' USS {snapshot.workers_uss / MB:,.0f} MB"
    return text


@dataclass(frozen=True)
class WatchdogResult:
    """What one firing of the watchdog did and found."""

    before: MemorySnapshot
    after: MemorySnapshot
    freed: int  # bytes the forced cleanup freed
    limit: int  # bytes: fraction × budget share
    still_over: bool  # the cleanup did not bring the rank under the limit
    message: str
    logged: bool  # False when the warning was held back by the rate limit


class MemoryWatchdog:
    """Watches one rank's memory against `fraction` of its share of the budget.

    Measured is the rank's footprint: its RSS plus its workers' USS where the snapshot has it (see
    `MemorySnapshot.footprint`). Over the limit it forces a cleanup, measures again and warns. Two limits
    keep a rank that stays over from flooding the log or spending its time in `gc.collect()`: after a
    cleanup that did not help, the next `repeat_every - 1` checks do nothing; and a warning is logged at
    most once per `repeat_every` checks, the next one saying how many were held back.
    """

    def __init__(self, budget_share_bytes: int, fraction: float = 0.9, repeat_every: int = 10,
                 probe: Callable[..., MemorySnapshot] = take_snapshot) -> None:
        """Args: this rank's share of the budget (bytes), the fraction of it that triggers, the rate limit
        (in checks), and the function that re-measures after the cleanup."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], not {fraction}")
        if budget_share_bytes <= 0:
            raise ValueError(f"budget_share_bytes must be positive, not {budget_share_bytes}")
        self.budget_share_bytes = budget_share_bytes
        self.fraction = fraction
        self.repeat_every = max(1, repeat_every)
        self.probe = probe
        self._quiet_checks = 0  # checks left to skip after a cleanup that did not help
        self._since_warning = self.repeat_every  # checks since the last logged warning
        self._held_back = 0  # warnings not logged since the last logged one

    @property
    def limit_bytes(self) -> int:
        return int(self.fraction * self.budget_share_bytes)

    def check(self, snapshot: MemorySnapshot, on_gpu: bool, cleanup: Callable[[bool], int] = forced_cleanup,
              step: int | None = None) -> WatchdogResult | None:
        """Act if `snapshot` is over the limit; return what was done, or None when nothing was.

        Args:
            snapshot: a fresh measurement of this rank (USS optional).
            on_gpu: passed to `cleanup` (empties the CUDA cache).
            cleanup: frees memory and returns the bytes freed.
            step: the training step, for the message.
        """
        self._since_warning += 1
        if snapshot.footprint <= self.limit_bytes:
            self._quiet_checks = 0
            return None
        if self._quiet_checks > 0:
            self._quiet_checks -= 1
            return None
        freed = cleanup(on_gpu)
        after = self.probe(include_uss=snapshot.uss is not None)
        still_over = after.footprint > self.limit_bytes
        if still_over:
            self._quiet_checks = self.repeat_every - 1
        message = self._message(snapshot, after, freed, still_over, step)
        logged = self._since_warning >= self.repeat_every
        if logged:
            if self._held_back:
                message += f" ({self._held_back} similar warning(s) held back since the last one.)"
            logger.warning(message)
            self._since_warning, self._held_back = 0, 0
        else:
            self._held_back += 1
        return WatchdogResult(snapshot, after, freed, self.limit_bytes, still_over, message, logged)

    def _message(self, before: MemorySnapshot, after: MemorySnapshot, freed: int, still_over: bool,
                 step: int | None) -> str:
        """The warning: the figures, and what to change when cleaning up was not enough."""
        where = "" if step is None else f" at step {step}"
        text = (
            f"Memory watchdog{where}: {_describe(before)} passed {self.fraction:.0%} of this rank's "
            f"{self.budget_share_bytes / MB:,.0f} MB share of the memory budget ({self.limit_bytes / MB:,.0f} MB). "
            f"A forced cleanup freed {freed / MB:,.0f} MB: now {_describe(after)} "
            f"(workers {after.workers}, Arrow pool {after.arrow_bytes / MB:,.0f} MB, "
            f"system available {after.sys_available / MB:,.0f} MB)."
        )
        if not still_over:
            return text + " Back under the limit."
        settings = ", ".join(f"--{name}" for name in SETTINGS_TO_LOWER)
        text += f" Still over the limit: lower {settings}"
        if after.workers:
            text += f", or --dataloader_num_workers ({after.workers} workers running)"
        return text + ", or the process will be OOM-killed if this keeps growing."
