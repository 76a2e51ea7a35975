"""When Python's garbage collector makes a full collection during training.

A full `gc.collect()` walks every object the collector tracks. After a compiled model's set-up that is about 430k
objects, and one collection took 235-340 ms on the CPU; a GPU waits through it, idle, and under DDP every rank
waits for the slowest. So:

- at the end of the set-up (the model built, compiled for its fixed shapes, the first validation done) the objects
  made so far are collected once and frozen (`freeze_set_up_objects`, `gc.freeze()`): later collections never walk
  them again (a full collection then took 0.004 ms);
- the routine cleanups of the training loop make no full collection on a GPU; they still return memory where it is
  held (Arrow's pool, glibc's heap: `lowmem.memory.cleanup`). The collector's own young-generation passes go on as
  Python runs them;
- each memory record counts the objects the collector tracks outside the frozen ones (`tracked_objects`); when
  they grew by `GROWTH_FRACTION` and `GROWTH_OBJECTS` since the previous record, a full collection runs there
  (`GrowthCollector`): cycles that pile up are still freed, at most once a record;
- on the CPU the routine cleanups keep their full collection, which costs little beside a CPU step, and keeps the
  demo's memory flat as before.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

# Growth of the tracked objects between two memory records that calls for a full collection: both the share and
# the count (a few thousand objects more is the loop's own noise).
GROWTH_FRACTION = 0.10
GROWTH_OBJECTS = 10_000


def tracked_objects() -> int:
    """The objects the collector tracks outside the frozen ones (after `freeze_set_up_objects`: those made since)."""
    return len(gc.get_objects())


def freeze_set_up_objects() -> int:
    """Collect once, then freeze every object tracked so far: later full collections skip them. Returns how many
    objects are frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GrowthCollector:
    """A full collection at a memory record when the tracked objects grew since the previous one (see the module's
    docstring); `observe` is called with each record's count."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.collections = 0

    def observe(self, objects: int | None) -> int | None:
        """Collect when `objects` grew enough since the last call; returns the objects the collection found
        unreachable, or None when it did not run."""
        if objects is None:
            return None
        before, self.last = self.last, objects
        if before is None or objects - before < max(GROWTH_OBJECTS, GROWTH_FRACTION * before):
            return None
        found = gc.collect()
        self.collections += 1
        self.last = tracked_objects()
        logger.info("Python objects grew from %s to %s since the last memory record: a full collection found %s "
                    "unreachable; %s tracked now.", f"{before:,}", f"{objects:,}", f"{found:,}", f"{self.last:,}")
        return found
