"""Callbacks: code handed to the Trainer that runs at fixed points of training, on every rank.

They are how a user adds behaviour without touching the loop (a tracker, a time limit that asks for a
stop, a check of their own), and how the tests inject faults (slow steps, slow saves, planted leaks) and
trace what was trained. A callback may call `trainer.request_stop(reason)`: the stop is agreed by every
rank at the next step, which then saves a checkpoint and exits as on SIGTERM.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lowmem.train.step import StepResult  # what `on_step_end` is given

if TYPE_CHECKING:
    from lowmem.train.trainer import Trainer


__all__ = ["Callback", "StepResult"]


class Callback:
    """Hooks into training; override the ones you need. Each runs on every rank, so a collective inside one
    (an all-reduce of a figure) is allowed as long as it runs on every rank."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Before the first step of this process (after a resume, at the resumed step)."""

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        """After each optimizer step; `trainer.state.step` already counts it."""

    def on_checkpoint_write(self, trainer: Trainer, folder: Path) -> None:
        """Inside a checkpoint save, after this rank wrote its part into the temporary `folder`."""

    def on_train_end(self, trainer: Trainer, model: torch.nn.Module) -> None:
        """After the last step of a run that was not stopped, with the whole model (gathered under FSDP)."""
