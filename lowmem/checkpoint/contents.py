"""What a training checkpoint holds, written and read back as a dict of stateful parts.

A checkpoint folder (made atomic and complete by `lowmem.checkpoint.folders.CheckpointManager`):

    model.safetensors      the whole model's weights (main process), under every strategy
    model_config.json      the GPT's sizes
    optimizer.pt           AdamW's state (main process; identical on every rank under DDP), or
    deepspeed/state/       under DeepSpeed: the engine's checkpoint, one optimizer shard per rank, or
    optimizer/             under FSDP: the optimizer state, one shard per rank (torch.distributed.checkpoint)
    trainer_state.json     the shared parts (`train`: epoch, step, tokens seen; `checkpoints`: the manager's),
                           the world size and workers, and the config the run had
    rank<r>/<part>.json    each rank's own parts: `data` (the loader position), `memory` (the memory log)
    rank<r>/rng.pt         each rank's random states

Weights and optimizer state are the strategy's business (`lowmem.distributed.strategy`); every other part
is an object with `state_dict()` / `load_state_dict()`. A part missing from an older checkpoint keeps its
fresh state. The learning rate needs no state: it is a pure function of the step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator

from lowmem.config import MODEL_SHAPE_FIELDS, RESUME_EXACT_FIELDS, TrainConfig
from lowmem.checkpoint.folders import read_marker
from lowmem.distributed.strategy import (FSDP_OPTIMIZER_DIR, OPTIMIZER_FILE, load_model_and_optimizer,
                                       save_model_and_optimizer, save_torch_file)
from lowmem.errors import ConfigError
from lowmem.train.schedule import same_learning_rates, total_steps

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"
# The run's length only sets the schedule's total: changing it keeps a resume exact as long as every step
# already taken had the same learning rate under the old and the new total.
RUN_LENGTH_FIELDS = ("epochs", "max_steps")
# Fields added after checkpoints were written without them: the value those runs had in effect.
VALUES_BEFORE_THE_FIELD = {"dataloader_mix_row_groups": 1, "architecture": "gpt2", "text_column": "", "train_sources": ""}


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _part_file(rank_dir: Path, name: str, part: Stateful) -> Path:
    return rank_dir / f"{name}{getattr(part, 'checkpoint_suffix', '.json')}"


def _write_part(path: Path, state: dict[str, Any]) -> None:
    if path.suffix == ".pt":
        save_torch_file(state, path)
    else:
        path.write_text(json.dumps(state))


def _read_part(path: Path) -> dict[str, Any]:
    # weights_only=False: numpy's random state is no plain tensor; these files are the run's own.
    return torch.load(path, weights_only=False) if path.suffix == ".pt" else json.loads(path.read_text())


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
                 run_facts: dict[str, int]) -> None:
        self.model, self.optimizer, self.accelerator = model, optimizer, accelerator
        self.shared, self.per_rank, self.config, self.run_facts = shared, per_rank, config, run_facts

    def write(self, folder: Path) -> None:
        """Write this rank's part into `folder`; every rank calls it (saving weights is a collective under
        FSDP and DeepSpeed)."""
        rank_dir = folder / f"rank{self.accelerator.process_index}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        for name, part in self.per_rank.items():
            _write_part(_part_file(rank_dir, name, part), part.state_dict())
        save_model_and_optimizer(folder, self.model, self.optimizer, self.accelerator)
        if self.accelerator.is_main_process:
            state = {name: part.state_dict() for name, part in self.shared.items()}
            state.update(config=dataclasses.asdict(self.config), **self.run_facts)
            (folder / TRAINER_STATE_FILE).write_text(json.dumps(state, indent=2, ensure_ascii=False))

    def load(self, folder: Path, saved: dict[str, Any], skip: tuple[str, ...] = (), with_optimizer: bool = True) -> None:
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
        """Load this rank's part `name` from `folder`, if the checkpoint has it."""
        part = self.per_rank[name]
        path = _part_file(folder / f"rank{self.accelerator.process_index}", name, part)
        if path.is_file():
            part.load_state_dict(_read_part(path))


# What only a resume reads, under each strategy: kept in the newest checkpoints only (see CheckpointManager).
RESUME_ONLY = (OPTIMIZER_FILE, FSDP_OPTIMIZER_DIR)


def check_weights_only(folder: Path, allow_config_change: bool, is_main: bool = True,
                       damaged: dict[str, list[str]] | None = None) -> bool:
    """True when `folder` holds the optimizer state a resume needs; a checkpoint kept for its score only (its
    marker says "weights_only") is refused unless `allow_config_change`, which resumes with a fresh optimizer.
    The refusal's message is the main process's (the others raise it empty); `damaged` names the newer
    checkpoints a resume fell back from."""
    marker = read_marker(folder) or {}
    if not marker.get("weights_only"):
        return True
    if not allow_config_change:
        listing = "; ".join(f"{name}: {', '.join(problems)}" for name, problems in (damaged or {}).items())
        newer = (f"The newer ones are damaged ({listing}): restore them from a copy if you have one, or pass"
                 if listing else "Resume from a newer checkpoint, or pass")
        raise ConfigError(
            f"{folder} holds the weights but not the optimizer state (only the newest --keep_optimizer_n_ckp "
            "checkpoints keep it; this one was kept for its score), so a resume from it cannot continue exactly. "
            f"{newer} --allow_config_change=True to continue from these weights with the optimizer's moments "
            "started afresh (the first steps then move the weights differently)."
            if is_main else ""
        )
    logger.warning("Resuming from %s with a fresh optimizer state: it kept the weights only (--allow_config_change).",
                   folder)
    return False


def read_trainer_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / TRAINER_STATE_FILE).read_text())


def newest_saved_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The training config saved with the newest checkpoint of `run_dir` that has a readable trainer state,
    or None. For settings every checkpoint of a run shares (the model's architecture): nothing is verified."""
    state = newest_trainer_state(run_dir)
    return None if state is None else dict(state["config"])


def newest_trainer_state(run_dir: str | Path) -> dict[str, Any] | None:
    """The trainer state of the newest checkpoint of `run_dir` that has a readable one (with its config), or None.
    For what every checkpoint of a run shares (the architecture, the memory savers): nothing is verified."""
    steps = []
    # checkpoint-N.old: a save replacing checkpoint-N was interrupted; CheckpointManager will rename it back.
    for folder in Path(run_dir).glob("checkpoint-*"):
        number = folder.name.split("-", 1)[1].removesuffix(".old")
        if number.isdigit():
            steps.append((int(number), folder))
    for _, folder in sorted(steps, reverse=True):
        try:
            state = read_trainer_state(folder)
            dict(state["config"])
            return state
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _run_length_is_harmless(saved: dict[str, Any], config: TrainConfig, steps_per_epoch: int) -> bool:
    """True when the steps already taken had the same learning rates under the saved and the new run length."""
    saved_config = saved["config"]
    old_total = total_steps(steps_per_epoch, saved_config["epochs"], saved_config["max_steps"])
    new_total = total_steps(steps_per_epoch, config.epochs, config.max_steps)
    return same_learning_rates(int(saved["train"]["step"]), config.learn_rate, config.warmup_steps,
                               config.min_lr_ratio, old_total, new_total)


def resume_differences(saved: dict[str, Any], config: TrainConfig, steps_per_epoch: int) -> tuple[list[str], list[str]]:
    """(changes that break exactness, changes that make the checkpoint unusable) between a save and now.

    `steps_per_epoch` is this run's; a changed run length counts only when it changed a learning rate
    already used. The run facts (processes, workers) are not among them: a resume may change them.
    """
    saved_config = {**VALUES_BEFORE_THE_FIELD, **saved["config"]}
    changed = [name for name in RESUME_EXACT_FIELDS if saved_config.get(name) != getattr(config, name)]
    changed.sort(key=lambda name: name in RUN_LENGTH_FIELDS)  # what changes the batches is named first
    if changed and set(changed) <= set(RUN_LENGTH_FIELDS) and _run_length_is_harmless(saved, config, steps_per_epoch):
        changed = []
    inexact = [f"{name}: {saved_config.get(name)!r} → {getattr(config, name)!r}" for name in changed]
    # Another number of processes or workers is no reason to refuse: the data layer shares the rest of the
    # epoch out anew (`lowmem.train.rescale`), and the trainer says so.
    unusable = [f"{name}: {saved_config.get(name)!r} → {getattr(config, name)!r}" for name in MODEL_SHAPE_FIELDS
                if saved_config.get(name) != getattr(config, name)]
    return inexact, unusable


def check_resume(folder: Path, saved: dict[str, Any], config: TrainConfig, allow_config_change: bool,
                 steps_per_epoch: int) -> list[str]:
    """Refuse a resume from `folder` (whose trainer state is `saved`) that cannot continue exactly (unless
    allowed) or cannot load at all; return the changes."""
    inexact, unusable = resume_differences(saved, config, steps_per_epoch)
    if unusable:
        raise ConfigError(
            f"The checkpoint {folder} holds a model of another shape ({'; '.join(unusable)}). Resume with the "
            "model settings it was saved with, or start a new run in another --output_dir."
        )
    if inexact and not allow_config_change:
        raise ConfigError(
            f"Resuming from {folder} with changed settings would not continue the run exactly: "
            f"{'; '.join(inexact)}. Use the saved settings (they are in {folder / TRAINER_STATE_FILE}), or "
            "pass --allow_config_change=True to continue anyway (data order, schedule or batches will differ)."
        )
    return inexact
