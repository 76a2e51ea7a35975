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


def total_steps(steps_per_epoch: int, epochs: int, max_steps: int) -> int:
    """Optimizer steps in the whole run: every epoch, or `max_steps` when that is set and fewer."""
    steps = steps_per_epoch * epochs
    return min(steps, max_steps) if max_steps else steps


def same_learning_rates(steps_done: int, peak_lr: float, warmup_steps: int, min_lr_ratio: float, old_total: int,
                        new_total: int) -> bool:
    """True when the first `steps_done` steps had the same learning rate under both run lengths (for example,
    all of them in the warmup): a run lengthened or shortened then still continues exactly."""
    return all(get_lr(step, peak_lr, warmup_steps, old_total, min_lr_ratio)
               == get_lr(step, peak_lr, warmup_steps, new_total, min_lr_ratio) for step in range(steps_done))


def stretched_step(step: int, anchor_step: int, anchor_virtual: float, virtual_total: int, total: int) -> float:
    """Where step `step` of a run of `total` steps falls on a schedule of `virtual_total` steps, when from
    `anchor_step` (at `anchor_virtual` on that schedule) the rest is stretched over the steps left.

    A resume on another number of processes changes the steps left; this keeps the learning rate continuous
    and ends the decay at the run's new end.
    """
    return anchor_virtual + (step - anchor_step) * (virtual_total - anchor_virtual) / max(total - anchor_step, 1)
