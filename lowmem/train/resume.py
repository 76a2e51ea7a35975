"""Whether and how a run continues from a checkpoint: which checkpoint, what may have changed since it was
saved, the settings a resumed run keeps, the data position on another number of processes or workers, and the
learning-rate schedule's steps left.

The checkpoint layer only stores, checks and loads (`lowmem.checkpoint`); every decision of a resume is here:

    resume_from_checkpoint    the whole resume of a Trainer, in order
    settle_architecture,      settings a resumed run keeps from its checkpoints whatever today's defaults
      settle_loss_targets,
      resumed_tokenizer_dir
    check_resume,             refusing what cannot continue exactly (unless --allow_config_change) or at all
      resume_differences,
      check_weights_only
    processes_changed,        another number of processes or DataLoader workers: the rest of the epoch shared out
      readers_changed,        anew among the new readers (`lowmem.data.elastic`), which needs every old rank's
      merged_data_state,      position; steps, the schedule and the best-checkpoint ranking continue, the global
      rescale_line            batch changes with the number of processes, said in one line
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowmem.checkpoint.contents import (TRAINER_STATE_FILE, newest_saved_config, rank_part_file, read_part_file,
                                       read_trainer_state)
from lowmem.checkpoint.folders import read_marker
from lowmem.config import MODEL_SHAPE_FIELDS, RESUME_EXACT_FIELDS, TrainConfig
from lowmem.config.columns import response_only
from lowmem.data.elastic import merge_rank_states
from lowmem.data.tokenizer_identity import check_same_tokenizer
from lowmem.distributed.collectives import broadcast_from_main, run_on_main
from lowmem.distributed.safe_load import check_checkpoint_files
from lowmem.distributed.strategy import DEEPSPEED_DIR, FSDP_OPTIMIZER_DIR
from lowmem.errors import ConfigError, DataContentChanged, DataError
from lowmem.train.schedule import same_learning_rates, schedule_state_of_train_state, total_steps
from lowmem.train.setup import NEW_RUN_ARCHITECTURE

if TYPE_CHECKING:
    from lowmem.train.trainer import Trainer

logger = logging.getLogger(__name__)

# The run's length only sets the schedule's total: changing it keeps a resume exact as long as every step
# already taken had the same learning rate under the old and the new total.
RUN_LENGTH_FIELDS = ("epochs", "max_steps")
# Fields added after checkpoints were written without them: the value those runs had in effect.
VALUES_BEFORE_THE_FIELD = {"dataloader_mix_row_groups": 1, "architecture": "gpt2", "text_column": "",
                           "train_sources": ""}
# What decides the layout of the data readers: a change of any of them shares the epoch's rest out anew.
READER_FIELDS = ("dataloader_buffer_size", "dataloader_mix_row_groups")
READER_FACTS = ("world_size", "workers_per_rank")


def _in_effect(saved_config: dict[str, Any]) -> dict[str, Any]:
    """A saved config with the values its run had in effect for the fields added after it was written."""
    return {**VALUES_BEFORE_THE_FIELD, **saved_config}


def resume_from_checkpoint(trainer: Trainer, allow_config_change: bool = False,
                           start_from: str | Path | None = None) -> Path | None:
    """Continue `trainer` from the latest complete checkpoint of its run folder (or from `start_from`, one of its
    checkpoints, the newer ones set aside), if there is one; returns it. Every rank calls it.

    In order: the checkpoint chosen (damaged ones only: refused), the tokenizer and the settings compared with
    the saved ones (`check_resume`, `check_weights_only`), every part loaded, the data position loaded (merged
    from every old rank's on another layout of readers), and the schedule continued (stretched over the steps
    left after a change of processes).
    """
    config = trainer.config
    folder = _checkpoint_to_resume(trainer, allow_config_change, start_from)
    if folder is None:
        logger.info("No complete checkpoint in %s: starting fresh.", config.output_dir)
        return None
    saved = read_trainer_state(folder)
    check_same_tokenizer(saved.get("tokenizer"), trainer.tokenizer_identity, folder)
    changes = check_resume(folder, saved, config, allow_config_change, trainer.steps_per_epoch)
    with_optimizer = check_weights_only(folder, allow_config_change, trainer.is_main, trainer.checkpoints.damage)
    if not with_optimizer:
        changes.append("optimizer state started afresh")
    planned_total = trainer.total_steps  # this run's length, before the checkpoint's schedule replaces it
    # Saved before the schedule was a part of its own: its state is in `train`.
    saved.setdefault("schedule", schedule_state_of_train_state(saved.get("train", {})))
    trainer.checkpoint.load(folder, saved, skip=("data",), with_optimizer=with_optimizer)
    run_facts = trainer.checkpoint.run_facts
    rescaled = processes_changed(saved, run_facts)
    _load_data_position(trainer, folder, saved, allow_config_change, may_restart_epoch=bool(changes) or rescaled)
    if rescaled:
        steps_left = _stretch_schedule(trainer)
        logger.info(rescale_line(saved, config, run_facts, len(trainer.data.loader.stream), steps_left))
    else:  # a stretched schedule keeps the total it planned; otherwise this run's length stands
        trainer.total_steps = trainer.schedule.total_steps if trainer.schedule.stretched else planned_total
    trainer.checkpoints.last_saved_step = trainer.state.step
    trainer.resumed_from = folder
    state = trainer.state
    logger.info("Resumed from %s: epoch %d, step %d, %s tokens seen%s.", folder, state.epoch, state.step,
                f"{state.tokens_seen:,}", f" (changed: {'; '.join(changes)})" if changes else "")
    return folder


def _checkpoint_to_resume(trainer: Trainer, allow_config_change: bool, start_from: str | Path | None) -> Path | None:
    """The checkpoint every rank resumes from, chosen by the main process: `start_from` (the newer ones set aside),
    else the newest intact one, else None. Checkpoints that exist but are all damaged stop the resume: a run is
    never started fresh over them."""
    checkpoints = trainer.checkpoints
    if start_from is not None:
        if not allow_config_change:  # refused before newer checkpoints are set aside
            check_weights_only(Path(start_from), allow_config_change, trainer.is_main)
        if Path(start_from).is_dir():  # a checkpoint that is not data is refused before anything is set aside too
            _check_files_are_data(trainer, Path(start_from))
        return Path(broadcast_from_main(trainer.accelerator, lambda: str(checkpoints.start_from(start_from))))

    def newest_intact() -> tuple[Path | None, str | None]:
        found = checkpoints.latest_complete()
        return found, checkpoints.no_usable_checkpoint(found)

    folder, refusal = broadcast_from_main(trainer.accelerator, newest_intact)
    if refusal is not None:
        raise ConfigError(refusal if trainer.is_main else "")
    if folder is not None:
        _check_files_are_data(trainer, folder)
    return folder


def _check_files_are_data(trainer: Trainer, folder: Path) -> None:
    """Every file of `folder` a rank will unpickle holds data only: checked once, by the main process, before any
    rank loads anything (a refusal stops every rank, with the main process's message)."""
    run_on_main(trainer.accelerator, lambda: check_checkpoint_files(folder, FSDP_OPTIMIZER_DIR, DEEPSPEED_DIR))


def _load_data_position(trainer: Trainer, folder: Path, saved: dict[str, Any], allow_config_change: bool,
                        may_restart_epoch: bool) -> None:
    """This rank's data position from `folder`: its own, or every old rank's merged when the readers' layout
    changed. Data files rewritten since the save are refused, or read on from the saved position with
    `allow_config_change`; a position that no longer fits changed settings restarts the epoch."""
    stream = trainer.data.loader.stream
    stream.allow_changed_content = allow_config_change
    try:
        if readers_changed(saved, trainer.config, trainer.checkpoint.run_facts):
            trainer.data.load_state_dict(merged_data_state(folder, int(saved.get("world_size", 1))))
        else:
            trainer.checkpoint.load_part(folder, "data")
    except DataError as error:
        if isinstance(error, DataContentChanged) or not may_restart_epoch:
            raise  # other rows under a saved position: refused, whatever else changed
        logger.warning("The saved data position does not fit the changed settings (%s): epoch %d restarts.",
                       error, trainer.state.epoch)


def _stretch_schedule(trainer: Trainer) -> int:
    """After a resume on another number of processes: the steps left are this epoch's rest and the later epochs
    at the new rate; the schedule is stretched over them from where it stood. Returns the steps left."""
    config, step = trainer.config, trainer.state.step
    steps_left = (len(trainer.data.loader) // config.gradient_accumulation_steps
                  + max(0, config.epochs - trainer.state.epoch - 1) * trainer.steps_per_epoch)
    total = step + steps_left
    if config.max_steps:
        total = min(total, config.max_steps)
    trainer.schedule.stretch(step, total)
    trainer.total_steps = total
    return total - step


def saved_config_to_resume(config: TrainConfig, checkpoint: str | Path | None = None) -> dict[str, Any] | None:
    """The config saved with the checkpoint a resume continues from: `checkpoint` when one is named
    (--resume_from_checkpoint), else the run's newest with a readable trainer state; None when there is none."""
    if checkpoint:
        return dict(read_trainer_state(Path(checkpoint))["config"])
    return newest_saved_config(config.output_dir)


def settle_architecture(config: TrainConfig, is_keep_training: bool,
                        checkpoint: str | Path | None = None) -> TrainConfig:
    """`config` with its architecture decided: as given; else, when resuming, that of the checkpoint it resumes
    from (`saved_config_to_resume`; gpt2 for those saved before the option existed); else NEW_RUN_ARCHITECTURE.
    A resumed run thus keeps its model whatever the default, and an explicit other value is refused by the
    resume check."""
    if config.architecture is not None:
        return config
    saved = saved_config_to_resume(config, checkpoint) if is_keep_training else None
    if saved is None:
        return dataclasses.replace(config, architecture=NEW_RUN_ARCHITECTURE)
    return dataclasses.replace(config, architecture=_in_effect(saved)["architecture"])


def settle_loss_targets(config: TrainConfig, is_keep_training: bool,
                        checkpoint: str | Path | None = None) -> TrainConfig:
    """`config` with --loss_on_response_only decided: as given; else, when resuming a run of the same columns,
    that of the checkpoint it resumes from (runs saved when every token was the default keep it); else from the
    data (`lowmem.config.columns.response_only`). Checkpoints thus always record a concrete value."""
    if config.loss_on_response_only is not None:
        return config
    saved = saved_config_to_resume(config, checkpoint) if is_keep_training else None
    saved = _in_effect(saved) if saved is not None else {}
    kept = saved.get("loss_on_response_only")
    if kept is None or saved.get("text_column") != config.text_column:  # other columns: the resume check says so
        return dataclasses.replace(config, loss_on_response_only=response_only(config))
    if kept != response_only(config):
        logger.info("The run in %s was saved with --loss_on_response_only=%s: kept (a new run of this data would "
                    "take %s).", config.output_dir, kept, response_only(config))
    return dataclasses.replace(config, loss_on_response_only=bool(kept))


def resumed_tokenizer_dir(config: TrainConfig, checkpoint: str | Path | None = None) -> TrainConfig:
    """`config` with the tokenizer folder the checkpoint it resumes from was trained with (`checkpoint`, else the
    run's newest): a resume that does not name one continues with the run's own, wherever today's defaults
    point."""
    saved_dir = (saved_config_to_resume(config, checkpoint) or {}).get("tokenizer_dir")
    if not saved_dir or saved_dir == config.tokenizer_dir:
        return config
    logger.info("Tokenizer of the run in %s: %s.", config.output_dir, saved_dir)
    return dataclasses.replace(config, tokenizer_dir=saved_dir)


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


def _run_length_is_harmless(saved: dict[str, Any], config: TrainConfig, steps_per_epoch: int) -> bool:
    """True when the steps already taken had the same learning rates under the saved and the new run length."""
    saved_config = saved["config"]
    old_total = total_steps(steps_per_epoch, saved_config["epochs"], saved_config["max_steps"])
    new_total = total_steps(steps_per_epoch, config.epochs, config.max_steps)
    # The warmup the run started with (shortened to fit it, `fitted_warmup`), where the checkpoint records it.
    warmup = int(saved.get("schedule", {}).get("warmup_steps", config.warmup_steps))
    return same_learning_rates(int(saved["train"]["step"]), config.learn_rate, warmup, config.min_lr_ratio,
                               old_total, new_total)


def resume_differences(saved: dict[str, Any], config: TrainConfig, steps_per_epoch: int) -> tuple[list[str], list[str]]:
    """(changes that break exactness, changes that make the checkpoint unusable) between a save and now.

    `steps_per_epoch` is this run's; a changed run length counts only when it changed a learning rate
    already used. The run facts (processes, workers) are not among them: a resume may change them.
    """
    saved_config = _in_effect(saved["config"])
    changed = [name for name in RESUME_EXACT_FIELDS if saved_config.get(name) != getattr(config, name)]
    changed.sort(key=lambda name: name in RUN_LENGTH_FIELDS)  # what changes the batches is named first
    if changed and set(changed) <= set(RUN_LENGTH_FIELDS) and _run_length_is_harmless(saved, config, steps_per_epoch):
        changed = []
    inexact = [f"{name}: {saved_config.get(name)!r} → {getattr(config, name)!r}" for name in changed]
    # Another number of processes or workers is no reason to refuse: the data layer shares the rest of the
    # epoch out anew (`processes_changed`, `merged_data_state` below), and the resume says so.
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


def processes_changed(saved: dict[str, Any], run_facts: dict[str, Any]) -> bool:
    """True when the saved run had another number of processes or of DataLoader workers per process."""
    return any(saved.get(fact) != run_facts[fact] for fact in READER_FACTS)


def readers_changed(saved: dict[str, Any], config: TrainConfig, run_facts: dict[str, Any]) -> bool:
    """True when the saved run read its data with another layout than this run will."""
    saved_config = _in_effect(saved["config"])
    return (processes_changed(saved, run_facts)
            or any(saved_config.get(name) != getattr(config, name) for name in READER_FIELDS))


def merged_data_state(folder: Path, world_size: int) -> dict[str, Any]:
    """Every saved rank's data position in `folder`, merged into one state."""
    states = []
    for rank in range(world_size):
        path = rank_part_file(folder, rank, "data")
        if not path.is_file():
            raise DataError(f"{path} is missing, so the rest of the epoch cannot be shared out among the new "
                            "processes. The checkpoint is incomplete; resume from another one.")
        states.append(read_part_file(path))
    return merge_rank_states(states)


def accumulation_to_keep(old_rows: int, new_processes: int, batch_size: int) -> int | None:
    """The gradient accumulation that keeps `old_rows` rows per optimizer step, if a whole number does."""
    per_micro_step = new_processes * batch_size
    return old_rows // per_micro_step if old_rows % per_micro_step == 0 else None


def rescale_line(saved: dict[str, Any], config: TrainConfig, run_facts: dict[str, Any], rows_per_process: int,
                 steps_left: int) -> str:
    """One log line: processes and workers before and after, the global batch, and how to keep it."""
    saved_config = saved["config"]
    old_processes, new_processes = int(saved.get("world_size", 1)), int(run_facts["world_size"])
    old_rows = old_processes * saved_config["batch_size_per_gpu"] * saved_config["gradient_accumulation_steps"]
    new_rows = new_processes * config.batch_size_per_gpu * config.gradient_accumulation_steps
    line = (f"Resuming on {new_processes} process(es) × {run_facts['workers_per_rank']} reader(s) where the run had "
            f"{old_processes} × {saved.get('workers_per_rank', 1)}: the rows left in this epoch are shared out anew "
            f"({rows_per_process:,} per process), and {steps_left:,} steps remain. ")
    if new_rows == old_rows:
        return line + f"The global batch stays {new_rows:,} rows per optimizer step."
    keep = accumulation_to_keep(old_rows, new_processes, config.batch_size_per_gpu)
    how = (f"to keep {old_rows:,}, resume with --gradient_accumulation_steps={keep} --allow_config_change=True"
           if keep else f"no whole --gradient_accumulation_steps keeps {old_rows:,} with {new_processes} process(es)")
    return line + f"The global batch is now {new_rows:,} rows per optimizer step (it was {old_rows:,}); {how}."
