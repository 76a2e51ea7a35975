"""How long the rows are against --max_seq_len: the length that keeps nearly all of them whole, and the rows a
length cuts, said at the start from a sample and counted as training meets them.

A row of n tokens (its layout: `[bos] prompt [sep] response [eos]`, a chat template, or a preference row's longer
answer) needs n - 1 inputs: a shorter --max_seq_len cuts its end, the response's last tokens and the token that
ends its turn among them, so that a model never learns to stop.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

from lowmem.data.collate import PAD_TO_MULTIPLE_OF
from lowmem.log_format import DoublingCount

logger = logging.getLogger(__name__)

WHOLE_SHARE = 0.99  # the share of rows a settled length keeps whole
# The longest length settled from rows: what TRL's SFT and DPO trainers cut at by default (max_length=1024). Longer
# rows take --max_seq_len, given: their memory grows with the length, and the plan shows it before a launch.
LENGTH_FROM_ROWS_CAP = 1024


def length_keeping(lengths: Sequence[int], share: float = WHOLE_SHARE) -> int:
    """The shortest --max_seq_len, a multiple of PAD_TO_MULTIPLE_OF, that keeps `share` of rows of these token
    `lengths` whole; PAD_TO_MULTIPLE_OF for no rows."""
    if not lengths:
        return PAD_TO_MULTIPLE_OF
    ordered = sorted(max(length - 1, 1) for length in lengths)
    needed = ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)]
    return -(-needed // PAD_TO_MULTIPLE_OF) * PAD_TO_MULTIPLE_OF


def rows_cut(lengths: Sequence[int], max_seq_len: int) -> int:
    """How many rows of these token `lengths` --max_seq_len cuts."""
    return sum(length - 1 > max_seq_len for length in lengths)


def cut_rows_line(lengths: Sequence[int], max_seq_len: int) -> str | None:
    """One line for the start: the sampled rows --max_seq_len cuts and the length that keeps WHOLE_SHARE of them
    whole; None when it cuts none."""
    cut = rows_cut(lengths, max_seq_len)
    if not cut:
        return None
    return (f"{cut:,} of {len(lengths):,} sampled training rows ({cut / len(lengths):.1%}) are longer than "
            f"--max_seq_len={max_seq_len} and are cut at their end (the end of the answer and the token that ends it "
            f"are not trained); --max_seq_len={length_keeping(lengths)} keeps {WHOLE_SHARE:.0%} of them whole.")


class CutRows:
    """Says, as training meets them, how many rows --max_seq_len cut: at the first, then each time the count
    doubles (the start-up line gave the sample's share and the length that keeps them whole)."""

    def __init__(self, max_seq_len: int) -> None:
        self.max_seq_len, self.count = max_seq_len, DoublingCount()

    @property
    def total(self) -> int:
        """Rows cut so far, over every rank."""
        return self.count.total

    def add(self, count: int) -> None:
        """Rows cut since the last log line, over every rank."""
        if not self.count.add(count):
            return
        logger.warning("%s training rows cut at --max_seq_len=%d so far: their ends are not trained (the start-up "
                       "line gives the length that keeps nearly all of them whole).", f"{self.total:,}",
                       self.max_seq_len)
