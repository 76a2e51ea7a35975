"""The learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math


def get_lr(step: int, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Rises linearly from peak_lr / warmup_steps to peak_lr over `warmup_steps`, then follows half a cosine
    down to `peak_lr * min_lr_ratio` at `total_steps`, and stays there. A pure function of the step, so a
    resumed run continues the schedule exactly from its step count.
    """
    min_lr = peak_lr * min_lr_ratio
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)  # 0 → 1 over the decay
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak_lr - min_lr)
