"""The learning-rate schedule: linear warmup, then cosine decay to a floor; stretched after a resume on another
number of processes; a stateful part of the run."""

from __future__ import annotations

import math
from typing import Any, Collection

from lowmem.config import OptimConfig
from lowmem.config.overrides import explicit_fields


def get_lr(step: float, peak_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step `step` (0-based; a fraction where a stretched schedule falls between steps).

    Rises linearly from peak_lr / warmup_steps to peak_lr over `warmup_steps`, then follows half a cosine
    down to `peak_lr * min_lr_ratio` at `total_steps`, and stays there. A pure function of its arguments: what a
    run changes on the way (a warmup shortened to fit it, a stretch after a resume on another number of processes)
    is the state of `LearningRateSchedule`, saved in each checkpoint.
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


# A warmup longer than this share of the run leaves the learning rate little or no decay (or never lets it
# reach its peak): one left at its default is shortened to FITTED_WARMUP_SHARE of the run, one given is kept
# as given, and so is one of a run that --max_steps cuts short (a quick try, or a run to be continued with a
# larger --max_steps, which stays exact while every step taken is in the warmup); each is said in one line
# (`warmup_line`). A tenth is the usual share (HF's warmup_ratio examples; nanoGPT's 2,000 of 600,000 steps
# is far less).
MAX_WARMUP_SHARE = 0.25
FITTED_WARMUP_SHARE = 0.1


def fitted_warmup(warmup_steps: int, total: int, kept: bool) -> int:
    """The warmup a run of `total` optimizer steps uses: `warmup_steps`, or a tenth of the run when that is over a
    quarter of it and is not to be `kept`."""
    if kept or warmup_steps <= MAX_WARMUP_SHARE * total:
        return warmup_steps
    return max(1, round(FITTED_WARMUP_SHARE * total))


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


class LearningRateSchedule:
    """The learning rate of every optimizer step, as a stateful part of the run (saved in each checkpoint).

    Linear warmup, then cosine decay to a floor over `total_steps` (`get_lr`). A resume on another number of
    processes changes the steps left: `stretch` then runs the rest of the decay over the new number from where it
    stood, so the rate stays continuous and the decay ends at the run's new end. Its state is the run's length as
    last planned and, once stretched, where the stretch began.

    The warmup is part of its state too: one that does not fit the run is shortened when the run starts
    (`fitted_warmup`), and a resume keeps the warmup the run started with.

    Args:
        peak_lr, warmup_steps, min_lr_ratio: the schedule's shape (`--learn_rate`, `--warmup_steps`,
            `--min_lr_ratio`).
        total_steps: the run's optimizer steps in all.
        warmup_kept_by: the flag that keeps `warmup_steps` whatever the run's length ("--warmup_steps" when given,
            "--max_steps" when it cuts the run short), or None to fit a warmup that does not fit the run.
    """

    def __init__(self, peak_lr: float, warmup_steps: int, min_lr_ratio: float, total_steps: int,
                 warmup_kept_by: str | None = "--warmup_steps") -> None:
        self.peak_lr, self.min_lr_ratio = peak_lr, min_lr_ratio
        self.configured_warmup, self.warmup_kept_by = warmup_steps, warmup_kept_by
        self.warmup_steps = fitted_warmup(warmup_steps, total_steps, kept=warmup_kept_by is not None)
        self.total_steps = total_steps
        # Once stretched, step s follows the schedule of `virtual_total` steps at
        # anchor_virtual + (s - anchor_step) * (virtual_total - anchor_virtual) / (total_steps - anchor_step).
        self.anchor_step = 0
        self.anchor_virtual = 0.0
        self.virtual_total = 0  # 0: not stretched, the schedule runs over total_steps

    @classmethod
    def from_config(cls, optim: OptimConfig, total_steps: int, warmup_kept_by: str | None) -> LearningRateSchedule:
        """The schedule of a run of `total_steps` optimizer steps, its shape as `optim` says (--learn_rate,
        --warmup_steps, --min_lr_ratio): the one place the config is read. A resume then loads what the run changed
        on the way (`load_state_dict`).

        Args:
            optim: the run's optimisation settings (a TrainConfig is one).
            total_steps: the run's optimizer steps in all.
            warmup_kept_by: the flag that keeps --warmup_steps whatever the run's length, or None to fit a warmup
                that does not fit the run (see the class's docstring).
        """
        return cls(optim.learn_rate, optim.warmup_steps, optim.min_lr_ratio, total_steps,
                   warmup_kept_by=warmup_kept_by)

    @property
    def stretched(self) -> bool:
        return bool(self.virtual_total)

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        at, length = self._position(step)
        return get_lr(at, self.peak_lr, self.warmup_steps, length, self.min_lr_ratio)

    def stretch(self, step: int, new_total: int) -> None:
        """From optimizer step `step` on, run the rest of the schedule over a run of `new_total` steps in all."""
        at, self.virtual_total = self._position(step)
        self.anchor_step, self.anchor_virtual = step, float(at)
        self.total_steps = new_total

    def same_rates(self, steps_done: int, old_total: int, new_total: int) -> bool:
        """True when the first `steps_done` steps had the same learning rate on this schedule's shape (its peak, its
        warmup and its floor) over a run of `old_total` steps and over one of `new_total` (`same_learning_rates`):
        a run lengthened or shortened then still continues exactly."""
        return same_learning_rates(steps_done, self.peak_lr, self.warmup_steps, self.min_lr_ratio, old_total,
                                   new_total)

    def _position(self, step: int) -> tuple[float, int]:
        """(where step `step` falls on the schedule, the schedule's length in steps)."""
        if not self.virtual_total:
            return step, self.total_steps
        return (stretched_step(step, self.anchor_step, self.anchor_virtual, self.virtual_total, self.total_steps),
                self.virtual_total)

    def warmup_line(self) -> str | None:
        """One line when the warmup does not fit the run: shortened, or kept as given; None when it fits."""
        length, configured = self.virtual_total or self.total_steps, self.configured_warmup
        if configured <= MAX_WARMUP_SHARE * length:
            return None
        what = (f"--warmup_steps={configured} is {configured / max(length, 1):.0%} of this run's {length:,} optimizer "
                "steps: the learning rate would " + (f"never reach its peak of {self.peak_lr:g} nor decay"
                                                     if configured >= length else "have little of the run to decay"))
        fitted = fitted_warmup(configured, length, kept=False)
        if self.warmup_steps == configured and self.warmup_kept_by == "--max_steps":
            return (f"{what}. Kept, as --max_steps cuts the run short: while every step taken is in the warmup, a "
                    f"larger --max_steps with --is_keep_training=True continues it exactly; --warmup_steps={fitted:,} "
                    f"fits this length.")
        if self.warmup_steps == configured:
            return (f"{what}. Kept as given; leave --warmup_steps out to warm up over {FITTED_WARMUP_SHARE:.0%} of "
                    f"the run ({fitted:,} steps).")
        return (f"{what}. Warming up over {self.warmup_steps:,} steps instead, {FITTED_WARMUP_SHARE:.0%} of the run "
                f"(a warmup over {MAX_WARMUP_SHARE:.0%} of the run is shortened unless --warmup_steps or --max_steps "
                "is given).")

    def state_dict(self) -> dict[str, Any]:
        return {"total_steps": self.total_steps, "anchor_step": self.anchor_step,
                "anchor_virtual": self.anchor_virtual, "virtual_total": self.virtual_total,
                "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A checkpoint saved before the warmup was a part of the state warmed up over --warmup_steps as given.
        self.warmup_steps = int(state.get("warmup_steps", self.configured_warmup))
        # A total of 0 comes from a checkpoint that did not record one: this run's total stands.
        self.total_steps = int(state.get("total_steps") or self.total_steps)
        self.anchor_step = int(state.get("anchor_step", 0))
        self.anchor_virtual = float(state.get("anchor_virtual", 0.0))
        self.virtual_total = int(state.get("virtual_total", 0))


def schedule_state_of_train_state(train_state: dict[str, Any]) -> dict[str, Any]:
    """The schedule's state as checkpoints written before it was a part of its own kept it: fields of the
    `train` part (`total_steps`, `lr_anchor_step`, `lr_anchor_virtual`, `lr_virtual_total`)."""
    return {"total_steps": train_state.get("total_steps", 0), "anchor_step": train_state.get("lr_anchor_step", 0),
            "anchor_virtual": train_state.get("lr_anchor_virtual", 0.0),
            "virtual_total": train_state.get("lr_virtual_total", 0)}


def warmup_kept_by(config: OptimConfig, given: Collection[str] | None, planned_steps: int) -> str | None:
    """The flag that keeps --warmup_steps as it is even when it does not fit the run (`fitted_warmup`): the warmup
    given itself, or a --max_steps given that cuts the run short; None when neither was."""
    explicit = explicit_fields(config, given)
    if "warmup_steps" in explicit:
        return "--warmup_steps"
    return "--max_steps" if "max_steps" in explicit and planned_steps == config.max_steps else None


def planned_run_line(config: OptimConfig, given: Collection[str] | None, rows_per_process: int) -> str:
    """One line of a run's length before it starts (for `plan`): optimizer steps per epoch and in all, and the
    warmup the schedule will use. `rows_per_process`: the training rows each process reads per epoch; rows with
    empty values (skipped) and packing (several rows per sequence) make the true count a little different."""
    per_step = config.batch_size_per_gpu * config.gradient_accumulation_steps
    # The training loader keeps a last, shorter micro-batch; a step takes whole groups of micro-batches.
    per_epoch = -(-rows_per_process // config.batch_size_per_gpu) // config.gradient_accumulation_steps
    planned = total_steps(per_epoch, config.epochs, config.max_steps)
    schedule = LearningRateSchedule.from_config(config, planned, warmup_kept_by(config, given, planned))
    cut_short = planned == config.max_steps < per_epoch * config.epochs
    cut = f", cut to --max_steps={config.max_steps:,}" if cut_short else ""
    warmup = schedule.warmup_line() or f"Warmup {schedule.warmup_steps:,} steps."
    return (f"Run length: about {per_epoch:,} optimizer steps per epoch ({rows_per_process:,} rows per process, "
            f"{per_step:,} per step), {planned:,} in all over {config.epochs} epoch(s){cut}; the cosine decays "
            f"to {config.min_lr_ratio:g} x --learn_rate by the last. {warmup}")
