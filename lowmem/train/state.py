"""The small stateful parts of a training run that are neither model nor optimizer: where training stands,
and each process's random states."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class TrainState:
    """Where training stands: the same on every rank, saved once per checkpoint."""

    epoch: int = 0
    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # real (non-padding) input tokens, all ranks
    val_loss_start: float = float("nan")  # validation loss before the first step

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):
            if field.name in state:  # a field added later keeps its default when an older checkpoint lacks it
                setattr(self, field.name, type(getattr(self, field.name))(state[field.name]))


class RngState:
    """This process's Python, numpy and torch (CPU and CUDA) random states; each rank saves its own."""

    # Numpy's state is a tuple holding an array: torch.save keeps it as it is, JSON would not.
    checkpoint_suffix = ".pt"

    def state_dict(self) -> dict[str, Any]:
        states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.get_rng_state_all()
        return states

    def load_state_dict(self, states: dict[str, Any]) -> None:
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])
