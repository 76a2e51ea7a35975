"""What a training checkpoint holds, and how it is written and read back.

A checkpoint folder (written atomically by `lowmem.checkpoint.CheckpointManager`):

    model.safetensors      the whole model's weights (main process), under every strategy
    model_config.json      the GPT's sizes
    optimizer.pt           AdamW's state (main process; identical on every rank under DDP), or
    deepspeed/state/       under DeepSpeed: the engine's checkpoint, one optimizer shard per rank, or
    optimizer/             under FSDP: the optimizer state, one shard per rank (torch.distributed.checkpoint)
    trainer_state.json     epoch, step, tokens seen, world size, workers, and the config it ran with
    rank<r>/rng.pt         each rank's Python, numpy and torch (CPU and CUDA) random states
    rank<r>/data.json      each rank's data position (StreamLoader.state_dict())

Weights and optimizer state are `lowmem.parallelism`'s business (what each strategy needs); this module
adds the rest. Every rank writes its own files into the same folder; the main process the shared ones.

The learning rate needs no state: it is a pure function of the step.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from lowmem.errors import ConfigError
from lowmem.parallelism import load_model_and_optimizer, save_model_and_optimizer

# Changing one of these between a save and a resume changes what the rest of the run computes.
EXACTNESS_FIELDS = (
    "train_file", "seed", "batch_size_per_gpu", "gradient_accumulation_steps", "dataloader_buffer_size",
    "max_seq_len", "epochs", "max_steps", "learn_rate", "min_lr_ratio", "warmup_steps", "weight_decay",
    "adam_beta1", "adam_beta2", "grad_clip", "loss_on_response_only", "dropout",
)
# Changing one of these makes the saved weights unusable.
MODEL_FIELDS = ("n_layer", "n_head", "n_embd", "max_seq_len")


@dataclass
class TrainState:
    """Where training stands: everything besides weights and optimizer that a resume needs."""

    epoch: int = 0
    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # real (non-padding) input tokens, all ranks
    val_loss_start: float = float("nan")  # validation loss before the first step

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, type(getattr(self, field.name))(state[field.name]))


def capture_rng() -> dict[str, Any]:
    """This process's random states."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Put back states captured by `capture_rng`."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def checkpoint_writer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, accelerator: Accelerator,
                      data_state: dict[str, Any], state: TrainState, config: Any, run_facts: dict[str, Any]):
    """A `write(folder)` callback for CheckpointManager.save that writes this rank's part.

    Every rank must call the callback (under FSDP and DeepSpeed, saving the weights and optimizer is a
    collective).
    """
    rank, is_main = accelerator.process_index, accelerator.is_main_process

    def write(folder: Path) -> None:
        rank_dir = folder / f"rank{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        torch.save(capture_rng(), rank_dir / "rng.pt")
        (rank_dir / "data.json").write_text(json.dumps(data_state))
        save_model_and_optimizer(folder, model, optimizer, accelerator)
        if is_main:
            trainer_state = {"train": state.state_dict(), "config": dataclasses.asdict(config), **run_facts}
            (folder / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, ensure_ascii=False))

    return write


def read_trainer_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "trainer_state.json").read_text())


def resume_differences(saved: dict[str, Any], config: Any, run_facts: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(changes that break exactness, changes that make the checkpoint unusable) between a save and now."""
    saved_config = saved["config"]
    inexact = [f"{name}: {saved_config.get(name)!r} → {getattr(config, name)!r}" for name in EXACTNESS_FIELDS
               if saved_config.get(name) != getattr(config, name)]
    for name, value in run_facts.items():
        if saved.get(name) != value:
            inexact.append(f"{name}: {saved.get(name)!r} → {value!r}")
    unusable = [f"{name}: {saved_config.get(name)!r} → {getattr(config, name)!r}" for name in MODEL_FIELDS
                if saved_config.get(name) != getattr(config, name)]
    return inexact, unusable


def check_resume(folder: Path, saved: dict[str, Any], config: Any, run_facts: dict[str, Any],
                 allow_config_change: bool) -> list[str]:
    """Refuse a resume that cannot continue exactly (unless allowed) or cannot load at all; return the changes."""
    inexact, unusable = resume_differences(saved, config, run_facts)
    if unusable:
        raise ConfigError(
            f"The checkpoint {folder} holds a model of another shape ({'; '.join(unusable)}). Resume with the "
            "model settings it was saved with, or start a new run in another --output_dir."
        )
    if inexact and not allow_config_change:
        raise ConfigError(
            f"Resuming from {folder} with changed settings would not continue the run exactly: "
            f"{'; '.join(inexact)}. Use the saved settings (they are in {folder / 'trainer_state.json'}), or "
            "pass --allow_config_change=True to continue anyway (data order, schedule or batches will differ)."
        )
    return inexact


def load_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    accelerator: Accelerator) -> dict[str, Any]:
    """Load weights, optimizer and this rank's random states; return this rank's data position.

    Every rank calls it; `model` and `optimizer` are the prepared ones.
    """
    rank = accelerator.process_index
    load_model_and_optimizer(folder, model, optimizer, accelerator)
    restore_rng(torch.load(folder / f"rank{rank}" / "rng.pt", weights_only=False))
    return json.loads((folder / f"rank{rank}" / "data.json").read_text())
