"""The small stateful parts of a training run that are neither model nor optimizer: where training stands,
and each process's random states."""

from __future__ import annotations

import base64
import dataclasses
import logging
import math
import random
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from lowmem.data import StreamLoader
from lowmem.train.step import Batch, take

logger = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Where training stands: the same on every rank, saved once per checkpoint."""

    epoch: int = 0
    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # real (non-padding) input tokens, all ranks
    val_loss_start: float = float("nan")  # validation loss before the first step
    skipped_steps: int = 0  # steps whose gradients were not finite: counted, but not applied
    rows_not_trained: int = 0  # rows of short last accumulation steps that ended epochs, all ranks

    def state_dict(self) -> dict[str, Any]:
        state = dataclasses.asdict(self)
        if math.isnan(self.val_loss_start):  # not measured (--eval_on_start=False): JSON's null, not a bare NaN
            state["val_loss_start"] = None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):
            if field.name in state:  # a field added later keeps its default when an older checkpoint lacks it
                value = state[field.name]
                setattr(self, field.name, field.default if value is None else type(getattr(self, field.name))(value))


class RngState:
    """This process's Python, numpy and torch (CPU and CUDA) random states; each rank saves its own.

    Stored as JSON: Python's state as its version, its 625 words and the cached gaussian; numpy's as its generator's
    name, key, position and cached gaussian; torch's generator states as their bytes in base64. Nothing in it can run
    code when it loads. Checkpoints written before held them in a torch file (`rng.pt`: tensors and numbers, or, earlier
    still, Python tuples and a numpy array); they load too (see `lowmem.distributed.safe_load`).

    Of the CUDA states only the current device's is saved: that is the generator this rank's work draws
    from, and a resume that sees fewer GPUs (one per process instead of all of them, say) can still load it.
    """

    checkpoint_suffix = ".json"
    legacy_suffixes = (".pt",)  # a torch file read with weights_only=True, in checkpoints of earlier versions

    def state_dict(self) -> dict[str, Any]:
        version, words, gauss_next = random.getstate()
        kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        states: dict[str, Any] = {
            "python": {"version": int(version), "words": [int(word) for word in words], "gauss_next": gauss_next},
            "numpy": {"kind": str(kind), "keys": [int(key) for key in keys], "position": int(position),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "torch": _bytes_text(torch.get_rng_state()),
        }
        if torch.cuda.is_available():
            states["cuda"] = _bytes_text(torch.cuda.get_rng_state())  # the current device's
        return states

    def load_state_dict(self, states: dict[str, Any]) -> None:
        random.setstate(_python_state(states["python"]))
        np.random.set_state(_numpy_state(states["numpy"]))
        torch.set_rng_state(_generator_state(states["torch"]))
        if "cuda" in states and torch.cuda.is_available():
            saved = states["cuda"]
            cuda_state = _generator_state(saved) if isinstance(saved, str) else _current_device_state(saved)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state)


def _bytes_text(state: torch.Tensor) -> str:
    """A generator's state (a uint8 tensor) as base64 text."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _generator_state(saved: str | torch.Tensor) -> torch.Tensor:
    """A generator's state from its base64 text (or the tensor an earlier checkpoint held)."""
    if isinstance(saved, torch.Tensor):
        return saved
    return torch.frombuffer(bytearray(base64.b64decode(saved)), dtype=torch.uint8)


def _python_state(saved: Any) -> tuple[Any, ...]:
    """`random.setstate`'s tuple from the stored data (or the tuple an earlier checkpoint held)."""
    if not isinstance(saved, dict):
        return tuple(saved)
    words = saved["words"]
    return (saved["version"], tuple(words.tolist() if isinstance(words, torch.Tensor) else words),
            saved["gauss_next"])


def _numpy_state(saved: Any) -> tuple[Any, ...]:
    """`np.random.set_state`'s tuple from the stored data (or the tuple an earlier checkpoint held)."""
    if not isinstance(saved, dict):
        return tuple(saved)
    keys = np.asarray(saved["keys"].numpy() if isinstance(saved["keys"], torch.Tensor) else saved["keys"],
                      dtype=np.uint32)
    return (saved["kind"], keys, saved["position"], saved["has_gauss"], saved["cached_gaussian"])


def _current_device_state(saved: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | None:
    """The saved CUDA random state of the current device.

    Checkpoints written before only the current device's state was saved hold a list, one state per GPU
    visible then: the entry of the current device's index is taken, or None when that list is too short.
    """
    if isinstance(saved, torch.Tensor):
        return saved
    index = torch.cuda.current_device()
    if index < len(saved):
        return saved[index]
    logger.warning("The checkpoint holds CUDA random states for %d GPU(s), none for this rank's device %d: its "
                   "CUDA random state is not restored (dropout draws differ from the uninterrupted run).",
                   len(saved), index)
    return None


class LoaderPosition:
    """The training loader as a checkpoint part: its position, except at a stop, where the batches taken for
    a step that was not trained are given back (the position before them is saved)."""

    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader
        self._before_step: dict[str, Any] | None = None
        self._untrained = False

    def epoch_batches(self, epoch: int) -> Iterator[Batch]:
        self.loader.set_epoch(epoch)
        return iter(self.loader)

    def take(self, batches: Iterator[Batch], count: int) -> list[Batch]:
        """The next `count` batches, remembering the position before them."""
        self._before_step = self.loader.state_dict()
        return take(batches, count)

    def give_back_last_batches(self) -> None:
        self._untrained = True

    def state_dict(self) -> dict[str, Any]:
        if self._untrained:
            assert self._before_step is not None  # batches were taken before any could be given back
            return self._before_step
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def allow_changed_content(self, allow: bool) -> None:
        """Whether a saved position over data files rewritten since the save loads (read on from it) or is refused."""
        self.loader.stream.allow_changed_content = allow
