"""The two warnings of preference training where its users get stuck: a DPO loss that stays at ln 2, and pairs
whose two answers are the same."""

from __future__ import annotations

import logging

from lowmem.log_format import DoublingCount
from lowmem.model.preference import LN2

logger = logging.getLogger(__name__)

# The loss counts as stuck within this of ln 2 (the loss where the policy still equals its reference) ...
STALL_TOLERANCE = 0.01
# ... over this many optimizer steps in a row (the log's windows: a window's mean loss decides for its steps).
STALL_STEPS = 200


class StallAtLn2:
    """Warns once when the DPO loss of every log line over `STALL_STEPS` steps stayed within `STALL_TOLERANCE` of
    ln 2, with the usual causes."""

    def __init__(self, steps: int = STALL_STEPS) -> None:
        self.steps = steps
        self.since: int | None = None  # the first step of the current run of lines at ln 2
        self.warned = False

    def add(self, step: int, loss: float, window_steps: int) -> None:
        """A log line's mean DPO loss over the `window_steps` steps that end at `step`."""
        if abs(loss - LN2) >= STALL_TOLERANCE:
            self.since = None
            return
        if self.since is None:
            self.since = step - window_steps
        if self.warned or step - self.since < self.steps:
            return
        self.warned = True
        logger.warning(
            "The DPO loss has stayed within %.2f of ln 2 (%.4f) for %d steps: the policy still ranks the answers as "
            "its reference does. The usual causes: --dpo_beta too small for the log-probability differences (try "
            "0.1 to 0.5); --learn_rate too low, or a warmup still under way (fine-tuning usually takes 5e-7 to 5e-6 "
            "for every weight, 1e-5 to 1e-4 for adapters); pairs whose chosen and rejected answers barely differ; "
            "or a policy that is still its reference (nothing trains: check the adapters' line and the gradient "
            "norm).", STALL_TOLERANCE, LN2, step - self.since)


class SkippedPairs:
    """Says, as they are found, how many pairs were left out because their chosen and rejected answers are the same
    tokens (within --max_seq_len): at the first, then each time the count doubles."""

    def __init__(self) -> None:
        self.count = DoublingCount()

    @property
    def total(self) -> int:
        """Pairs left out so far, over every rank."""
        return self.count.total

    def add(self, count: int) -> None:
        """Pairs left out since the last log line, over every rank."""
        if not self.count.add(count):
            return
        logger.warning("%s pairs left out so far: their chosen and rejected answers are the same tokens (within "
                       "--max_seq_len), so they carry no preference. Check the data (`lowmem convert` writes such rows "
                       "as they are), or raise --max_seq_len where long prompts cut both answers off.",
                       f"{self.total:,}")
