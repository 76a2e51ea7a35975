"""What a training checkpoint holds, written and read back as a dict of stateful parts.

A checkpoint folder (made atomic and complete by `lowmem.checkpoint.folders.CheckpointManager`):

    model.safetensors      the whole model's weights (main process), under every strategy but FSDP2, or
    model_shards/          under FSDP2: each rank's rows of every weight, with a JSON index, or
    adapters.safetensors   for a run that trains adapters: them alone (the base is the run's `base/`)
    model_config.json      the GPT's sizes
    optimizer.pt           AdamW's state (main process; identical on every rank under DDP), or
    deepspeed/state/       under DeepSpeed: the engine's checkpoint, one optimizer shard per rank, or
    optimizer_shards/      under FSDP2: the optimizer state, each rank's rows, with a JSON index
                           (`lowmem.distributed.sharded_checkpoint`); checkpoints of earlier versions hold
    optimizer/             torch.distributed.checkpoint's files instead, still read (as data)
    trainer_state.json     the shared parts (`train`: epoch, step, tokens seen; `schedule`: the learning rate's;
                           `checkpoints`: the manager's), the world size and workers, and the config the run had
    rank<r>/<part>.json    each rank's own parts: `data` (the loader position), `memory` (the memory log), `rng` (its
                           random states; `rng.pt`, a torch file of tensors, in checkpoints of earlier versions)

Every file is read as data: a checkpoint never runs code when it loads. A checkpoint of FSDP2 holds JSON and
safetensors only; the torch files of the others (`optimizer.pt`, DeepSpeed's, earlier versions' `rng.pt`) are checked
and read with an allow-list (`lowmem.distributed.safe_load`).

Weights and optimizer state are the strategy's business (`lowmem.distributed.strategy`); every other part
is an object with `state_dict()` / `load_state_dict()`. A part missing from an older checkpoint keeps its
fresh state. This module stores and loads; whether and how a run continues from a checkpoint is decided by
`lowmem.train.resume`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator

from lowmem.config import TrainConfig
from lowmem.distributed.safe_load import load_torch_file
from lowmem.distributed.sharded_checkpoint import OPTIMIZER_SHARDS
from lowmem.distributed.strategy import (FSDP_OPTIMIZER_DIR, OPTIMIZER_FILE, load_model_and_optimizer,
                                       save_model_and_optimizer, save_torch_file)


TRAINER_STATE_FILE = "trainer_state.json"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rank_part_file(folder: Path, rank: int, name: str, suffix: str = ".json") -> Path:
    """Where rank `rank`'s part `name` lies in the checkpoint `folder`."""
    return folder / f"rank{rank}" / f"{name}{suffix}"


def _part_file(folder: Path, rank: int, name: str, part: Stateful) -> Path:
    return rank_part_file(folder, rank, name, getattr(part, "checkpoint_suffix", ".json"))


def _write_part(path: Path, state: dict[str, Any]) -> None:
    if path.suffix == ".pt":
        save_torch_file(state, path)
    else:
        path.write_text(json.dumps(state))


def read_part_file(path: Path) -> dict[str, Any]:
    """A part's state as written by `TrainingCheckpoint.write`, read as data only (`lowmem.distributed.safe_load`:
    the random states of checkpoints written before they were stored as tensors hold numpy arrays)."""
    return load_torch_file(path, numpy_arrays=True) if path.suffix == ".pt" else json.loads(path.read_text())


class TrainingCheckpoint:
    """The model, the optimizer and the named stateful parts of a run, as one checkpoint.

    Args:
        model, optimizer: the prepared ones (the strategy decides how they are stored).
        accelerator: the run's Accelerator.
        shared: parts that are the same on every rank; the main process writes them once.
        per_rank: parts of this rank only; every rank writes its own.
        config: the run's configuration, recorded so that a resume can say what changed.
        run_facts: the world size and workers per rank, which the data order depends on.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, accelerator: Accelerator,
                 shared: dict[str, Stateful], per_rank: dict[str, Stateful], config: TrainConfig,
                 run_facts: dict[str, Any]) -> None:
        self.model, self.optimizer, self.accelerator = model, optimizer, accelerator
        self.shared, self.per_rank, self.config, self.run_facts = shared, per_rank, config, run_facts

    def write(self, folder: Path) -> None:
        """Write this rank's part into `folder`; every rank calls it (saving weights is a collective under
        FSDP and DeepSpeed)."""
        rank = self.accelerator.process_index
        (folder / f"rank{rank}").mkdir(parents=True, exist_ok=True)
        for name, part in self.per_rank.items():
            _write_part(_part_file(folder, rank, name, part), part.state_dict())
        save_model_and_optimizer(folder, self.model, self.optimizer, self.accelerator)
        if self.accelerator.is_main_process:
            state: dict[str, Any] = {name: part.state_dict() for name, part in self.shared.items()}
            state.update(config=dataclasses.asdict(self.config), **self.run_facts)
            (folder / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2, ensure_ascii=False))

    def load(self, folder: Path, saved: dict[str, Any], skip: tuple[str, ...] = (),
             with_optimizer: bool = True) -> None:
        """Load every part saved in `folder` (its trainer state already read: `saved`) except those named in
        `skip`; every rank calls it. Without `with_optimizer` the optimizer keeps its fresh state."""
        load_model_and_optimizer(folder, self.model, self.optimizer, self.accelerator, with_optimizer=with_optimizer)
        for name, part in self.shared.items():
            if name in saved and name not in skip:
                part.load_state_dict(saved[name])
        for name in self.per_rank:
            if name not in skip:
                self.load_part(folder, name)

    def load_part(self, folder: Path, name: str) -> None:
        """Load this rank's part `name` from `folder`, if the checkpoint has it (in its file of today, else of an
        earlier version: `legacy_suffixes`)."""
        part = self.per_rank[name]
        rank = self.accelerator.process_index
        for suffix in (getattr(part, "checkpoint_suffix", ".json"), *getattr(part, "legacy_suffixes", ())):
            path = rank_part_file(folder, rank, name, suffix)
            if path.is_file():
                part.load_state_dict(read_part_file(path))
                return


# What only a resume reads, under each strategy: kept in the newest checkpoints only (see CheckpointManager).
RESUME_ONLY = (OPTIMIZER_FILE, FSDP_OPTIMIZER_DIR, OPTIMIZER_SHARDS)


def read_trainer_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / TRAINER_STATE_FILE).read_text())
