"""Whether and how a run continues from a checkpoint: which checkpoint, what may have changed since it was
saved, the data position on another number of processes or workers, and the learning-rate schedule's steps left.

The checkpoint layer only stores, checks and loads (`lowmem.checkpoint`); the start-up reads the saved run and
settles the config from it (`lowmem.train.startup`); the Trainer's parts load themselves (`Trainer.resume`, through
`TrainingCheckpoint`). Every decision of a resume is here:

    choose_checkpoint         which checkpoint: the one named (the newer ones set aside), else the newest intact one
    decide_resume,            refusing what cannot continue exactly (unless --allow_config_change) or at all, and
      check_resume,           what changed, said in the resume's line
      resume_differences,
      check_weights_only
    data_position_to_load,    another number of processes or DataLoader workers: the rest of the epoch shared out
      epoch_may_restart,      anew among the new readers (`lowmem.data.elastic`), which needs every old rank's
      merged_data_state,      position; steps, the schedule and the best-checkpoint ranking continue, the global
      steps_after_rescale,    batch changes with the number of processes, said in one line
      rescale_line
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from lowmem.checkpoint.contents import TRAINER_STATE_FILE, rank_part_file, read_part_file
from lowmem.checkpoint.folders import CheckpointManager
from lowmem.config import MODEL_SHAPE_FIELDS, RESUME_EXACT_FIELDS, OptimConfig, TrainConfig
from lowmem.config.settle import in_effect
from lowmem.data.elastic import merge_rank_states
from lowmem.tokenization.identity import check_same_tokenizer
from lowmem.distributed.collectives import broadcast_from_main, run_on_main
from lowmem.distributed.safe_load import check_checkpoint_files
from lowmem.distributed.strategy import DEEPSPEED_DIR, FSDP_OPTIMIZER_DIR
from lowmem.errors import ConfigError, DataContentChanged, DataError
from lowmem.train.schedule import LearningRateSchedule, schedule_state_of_train_state, total_steps

logger = logging.getLogger(__name__)

# The run's length only sets the schedule's total: changing it keeps a resume exact as long as every step
# already taken had the same learning rate under the old and the new total.
RUN_LENGTH_FIELDS = ("epochs", "max_steps")
# What decides the layout of the data readers: a change of any of them shares the epoch's rest out anew.
READER_FIELDS = ("dataloader_buffer_size", "dataloader_mix_row_groups")
READER_FACTS = ("world_size", "workers_per_rank")


@dataclass
class ResumeDecision:
    """What a resume continues from and how: the checkpoint, its trainer state, the changes that make it inexact
    (said in the resume's line), whether the optimizer state is loaded, and whether the readers' layout changed
    (the rest of the epoch shared out anew, the schedule stretched over the steps left)."""

    folder: Path
    saved: dict[str, Any]
    changes: list[str]
    with_optimizer: bool
    rescaled: bool


def choose_checkpoint(checkpoints: CheckpointManager, accelerator: Accelerator, allow_config_change: bool,
                      resume_from: str | Path | None) -> Path | None:
    """The checkpoint every rank resumes from, chosen by the main process: `resume_from` (the newer ones set aside),
    else the newest intact one, else None. Checkpoints that exist but are all damaged stop the resume: a run is
    never started fresh over them. Every file a rank will unpickle is checked to hold data only, once, before
    any rank loads anything."""
    is_main = accelerator.is_main_process
    if resume_from is not None:
        if not allow_config_change:  # refused before newer checkpoints are set aside
            check_weights_only(Path(resume_from), checkpoints.marker_of(resume_from), allow_config_change, is_main)
        if Path(resume_from).is_dir():  # a checkpoint that is not data is refused before anything is set aside too
            _check_files_are_data(accelerator, Path(resume_from))
        return Path(broadcast_from_main(accelerator, lambda: str(checkpoints.resume_from(resume_from))))

    def newest_intact() -> tuple[Path | None, str | None]:
        found = checkpoints.latest_complete()
        return found, checkpoints.no_usable_checkpoint(found)

    folder, refusal = broadcast_from_main(accelerator, newest_intact)
    if refusal is not None:
        raise ConfigError(refusal if is_main else "")
    if folder is not None:
        _check_files_are_data(accelerator, folder)
    return folder


def _check_files_are_data(accelerator: Accelerator, folder: Path) -> None:
    """Every file of `folder` a rank will unpickle holds data only: checked by the main process (a refusal stops
    every rank, with the main process's message)."""
    run_on_main(accelerator, lambda: check_checkpoint_files(folder, FSDP_OPTIMIZER_DIR, DEEPSPEED_DIR))


def decide_resume(folder: Path, saved: dict[str, Any], marker: dict[str, Any] | None, config: TrainConfig,
                  tokenizer_identity: dict[str, Any], run_facts: dict[str, Any], steps_per_epoch: int,
                  allow_config_change: bool, is_main: bool = True,
                  damaged: dict[str, list[str]] | None = None) -> ResumeDecision:
    """Whether the run may continue from `folder` (its trainer state `saved`, its completeness `marker`) with this
    config, tokenizer and layout (`run_facts`), and how: the tokenizer and the settings compared with the saved ones
    (`check_resume`, `check_weights_only`; `damaged` names the newer checkpoints the choice fell back from)."""
    check_same_tokenizer(saved.get("tokenizer"), tokenizer_identity, folder)
    changes = check_resume(folder, saved, config, allow_config_change, steps_per_epoch)
    with_optimizer = check_weights_only(folder, marker, allow_config_change, is_main, damaged)
    if not with_optimizer:
        changes.append("optimizer state started afresh")
    if "schedule" not in saved:  # saved before the schedule was a part of its own: its state is in `train`
        saved = {**saved, "schedule": schedule_state_of_train_state(saved.get("train", {}))}
    return ResumeDecision(folder, saved, changes, with_optimizer, processes_changed(saved, run_facts))


def data_position_to_load(decision: ResumeDecision, config: TrainConfig,
                          run_facts: dict[str, Any]) -> dict[str, Any] | None:
    """The data position to load when the readers' layout changed: every old rank's merged into one (None: the
    layout is the same, and each rank loads its own part)."""
    if not readers_changed(decision.saved, config, run_facts):
        return None
    return merged_data_state(decision.folder, int(decision.saved.get("world_size", 1)))


def epoch_may_restart(error: DataError, decision: ResumeDecision) -> bool:
    """Whether a saved data position that failed to load (`error`) restarts the epoch: only when settings changed
    (the position no longer fits them); other rows under a saved position are refused, whatever else changed."""
    return not isinstance(error, DataContentChanged) and (bool(decision.changes) or decision.rescaled)


def steps_after_rescale(config: OptimConfig, step: int, epoch: int, micro_batches_left: int,
                        steps_per_epoch: int) -> int:
    """The run's total steps after a resume on another number of processes: this epoch's rest (its
    `micro_batches_left` at the new rate) and the later epochs, from `step`, within --max_steps."""
    steps_left = (micro_batches_left // config.gradient_accumulation_steps
                  + max(0, config.epochs - epoch - 1) * steps_per_epoch)
    total = step + steps_left
    return min(total, config.max_steps) if config.max_steps else total


def check_weights_only(folder: Path, marker: dict[str, Any] | None, allow_config_change: bool, is_main: bool = True,
                       damaged: dict[str, list[str]] | None = None) -> bool:
    """True when `folder` holds the optimizer state a resume needs; a checkpoint kept for its score only (its
    `marker` says "weights_only") is refused unless `allow_config_change`, which resumes with a fresh optimizer.
    The refusal's message is the main process's (the others raise it empty); `damaged` names the newer
    checkpoints a resume fell back from."""
    if not (marker or {}).get("weights_only"):
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


def _run_length_is_harmless(saved: dict[str, Any], config: OptimConfig, steps_per_epoch: int) -> bool:
    """True when the steps already taken had the same learning rates under the saved and the new run length."""
    saved_config = saved["config"]
    old_total = total_steps(steps_per_epoch, saved_config["epochs"], saved_config["max_steps"])
    new_total = total_steps(steps_per_epoch, config.epochs, config.max_steps)
    # The schedule as saved: its shape from the config, the warmup the run started with (shortened to fit it,
    # `fitted_warmup`) from its own state where the checkpoint records it.
    schedule = LearningRateSchedule.from_config(config, old_total, warmup_kept_by=None)
    schedule.load_state_dict(saved.get("schedule", {}))
    return schedule.same_rates(int(saved["train"]["step"]), old_total, new_total)


def resume_differences(saved: dict[str, Any], config: TrainConfig, steps_per_epoch: int) -> tuple[list[str], list[str]]:
    """(changes that break exactness, changes that make the checkpoint unusable) between a save and now.

    `steps_per_epoch` is this run's; a changed run length counts only when it changed a learning rate
    already used. The run facts (processes, workers) are not among them: a resume may change them.
    """
    saved_config = in_effect(saved["config"])
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
    saved_config = in_effect(saved["config"])
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


def rescale_line(saved: dict[str, Any], config: OptimConfig, run_facts: dict[str, Any], rows_per_process: int,
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
