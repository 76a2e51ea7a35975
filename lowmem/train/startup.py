"""The start-up of a training run, in one place: the run folder's saved state is read once, and every setting that
depends on it is settled from it before anything is built or written.

    start_up            the given values checked (config, data files, run folder, a new run's tokenizer), the saved
                        run read, the model a run starts from found and checked (`lowmem.source.settle`), and the
                        config the run uses settled from them
    read_saved_run      what a resume continues from, read once: the checkpoint named by --resume_from_checkpoint,
                        else the run's newest with a readable trainer state, and that trainer state (`SavedRun`)
    settled_config      the fields left to decide, decided: the architecture, the loss targets and the tokenizer
                        folder (a resume keeps its checkpoint's), and the checkpoint ranking

The memory savers are settled next, once the Accelerator exists (`lowmem.train.memory_fit.settle_memory`, handed
the saved run's choice). The Trainer receives the settled config and the saved run: it settles nothing again, and
its resume takes the trainer state read here (`SavedRun.state_of`) when it continues from that checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

from lowmem.checkpoint.contents import newest_readable_checkpoint, read_trainer_state
from lowmem.checkpoint.run_lock import check_output_dir
from lowmem.config import TrainConfig, validate_config
from lowmem.config.columns import response_only
from lowmem.data.path_checks import check_data_files
from lowmem.source.settle import StartingPoint, refuse_keep_training_without_run, settle_source
from lowmem.train.memory_fit import SAVED_KEY, explicit_fields
from lowmem.train.setup import NEW_RUN_ARCHITECTURE, check_tokenizer_data

logger = logging.getLogger(__name__)

# Fields added after checkpoints were written without them: the value those runs had in effect.
VALUES_BEFORE_THE_FIELD = {"dataloader_mix_row_groups": 1, "architecture": "gpt2", "text_column": "",
                           "train_sources": "", "init_from": "", "ddp_bf16_gradients": False}


def in_effect(saved_config: dict[str, Any]) -> dict[str, Any]:
    """A saved config with the values its run had in effect for the fields added after it was written."""
    return {**VALUES_BEFORE_THE_FIELD, **saved_config}


@dataclass(frozen=True)
class SavedRun:
    """What a resume continues from, as read at start-up: the checkpoint folder and its trainer state (both None
    for a new run, or for a run folder that holds no checkpoint yet)."""

    checkpoint: Path | None = None
    state: dict[str, Any] | None = None

    @property
    def config(self) -> dict[str, Any] | None:
        """The config the checkpoint was saved with, the fields added since it was written at their values then."""
        return None if self.state is None else in_effect(dict(self.state["config"]))

    def memory_choice(self, allow_config_change: bool) -> dict[str, Any] | None:
        """The memory savers the run chose, which a resume applies again (none to keep when
        `allow_config_change` lets the savers be chosen anew for this host's budget)."""
        return None if self.state is None or allow_config_change else self.state.get(SAVED_KEY)

    def state_of(self, folder: Path) -> dict[str, Any]:
        """The trainer state of the checkpoint `folder` a resume loads: the one read at start-up when it is that
        checkpoint (the usual case), else read now (the newest was found damaged, and an older one is resumed
        from)."""
        if self.state is not None and self.checkpoint is not None and \
                Path(self.checkpoint).resolve() == Path(folder).resolve():
            return self.state
        return read_trainer_state(Path(folder))


def read_saved_run(output_dir: str | Path, named: str | Path | None = None) -> SavedRun:
    """What a resume of the run in `output_dir` continues from: the checkpoint `named` (--resume_from_checkpoint),
    else the newest with a readable trainer state; an empty SavedRun when there is none."""
    if named:
        return SavedRun(Path(named), read_trainer_state(Path(named)))
    found = newest_readable_checkpoint(output_dir)
    return SavedRun() if found is None else SavedRun(*found)


def start_up(config: TrainConfig, given: Collection[str] | None, is_keep_training: bool,
             resume_from: str | Path | None = None) -> tuple[TrainConfig, SavedRun, StartingPoint | None]:
    """The config a run uses, the saved run it continues from and the model it starts from (None: random weights),
    before anything is built or written.

    The values as given are checked first (a mistake is named before anything is read), then the data files and
    the run folder. A resume (`is_keep_training`) reads the saved run once (`read_saved_run`) and settles from it
    (`settled_config`). A new run started from a model (--init_from) takes the model's shape and tokenizer, every
    tensor checked (`lowmem.source.settle`); any other new run's tokenizer must have been trained on its data
    (`check_tokenizer_data`).
    """
    validate_config(config)
    check_data_files(config)
    check_output_dir(config.output_dir)
    explicit = given if given is not None else explicit_fields(config)
    saved = read_saved_run(config.output_dir, resume_from) if is_keep_training else SavedRun()
    if is_keep_training and config.init_from and saved.state is None:
        refuse_keep_training_without_run(config)
    config, start = settle_source(config, explicit, saved.config, saved.checkpoint)
    if not is_keep_training and start is None:  # a resume checks the tokenizer against its checkpoint's instead
        check_tokenizer_data(config, explicit)
    return settled_config(config, saved, given), saved, start


def settled_config(config: TrainConfig, saved: SavedRun, given: Collection[str] | None = None) -> TrainConfig:
    """`config` with every field left to decide decided, from `saved` where a resume keeps the checkpoint's value:
    the architecture, the loss targets, the tokenizer folder (unless given) and the checkpoint ranking. With an
    empty `saved`, a new run's values: checkpoints always record concrete ones."""
    config = settle_loss_targets(settle_architecture(config, saved.config), saved.config)
    if given is not None and "tokenizer_dir" not in given:
        config = resumed_tokenizer_dir(config, saved.config)
    return settle_best_metric(config)


def settle_architecture(config: TrainConfig, saved_config: dict[str, Any] | None) -> TrainConfig:
    """`config` with its architecture decided: as given; else that of the checkpoint a resume continues from
    (`saved_config`, as `SavedRun.config` gives it: gpt2 for those saved before the option existed); else
    NEW_RUN_ARCHITECTURE. A resumed run thus keeps its model whatever the default, and an explicit other value is
    refused by the resume check."""
    if config.architecture is not None:
        return config
    if saved_config is None:
        return dataclasses.replace(config, architecture=NEW_RUN_ARCHITECTURE)
    return dataclasses.replace(config, architecture=saved_config["architecture"])


def settle_loss_targets(config: TrainConfig, saved_config: dict[str, Any] | None) -> TrainConfig:
    """`config` with --loss_on_response_only decided: as given; else, when resuming a run of the same columns,
    that of the checkpoint it continues from (`saved_config`, as `SavedRun.config` gives it; runs saved when every
    token was the default keep it); else from the data (`lowmem.config.columns.response_only`). Checkpoints thus
    always record a concrete value."""
    if config.loss_on_response_only is not None:
        return config
    saved = saved_config or {}
    kept = saved.get("loss_on_response_only")
    if kept is None or saved.get("text_column") != config.text_column:  # other columns: the resume check says so
        return dataclasses.replace(config, loss_on_response_only=response_only(config))
    if kept != response_only(config):
        logger.info("The run in %s was saved with --loss_on_response_only=%s: kept (a new run of this data would "
                    "take %s).", config.output_dir, kept, response_only(config))
    return dataclasses.replace(config, loss_on_response_only=bool(kept))


def resumed_tokenizer_dir(config: TrainConfig, saved_config: dict[str, Any] | None) -> TrainConfig:
    """`config` with the tokenizer folder the checkpoint it resumes from was trained with (`saved_config`): a
    resume that does not name one continues with the run's own, wherever today's defaults point."""
    saved_dir = (saved_config or {}).get("tokenizer_dir")
    if not saved_dir or saved_dir == config.tokenizer_dir:
        return config
    logger.info("Tokenizer of the run in %s: %s.", config.output_dir, saved_dir)
    return dataclasses.replace(config, tokenizer_dir=saved_dir)


def settle_best_metric(config: TrainConfig) -> TrainConfig:
    """`config` with a checkpoint ranking it can compute: without BLEU (--eval_bleu_samples=0, or one text
    column, which has no prompts to answer), ranking by bleu4 would keep no best checkpoint and write no best/,
    so the validation loss ranks them instead, said in one line."""
    if config.best_metric != "bleu4" or (config.eval_bleu_samples != 0 and not config.text_column):
        return config
    if config.text_column:
        logger.info("One text column (--text_column=%s) has no prompts to answer: validation computes the loss "
                    "and perplexity without BLEU-4, and best/ and the best checkpoints are chosen by validation "
                    "loss.", config.text_column)
        return dataclasses.replace(config, best_metric="val_loss")
    logger.warning("--eval_bleu_samples=0 computes no BLEU-4 to rank checkpoints by: best/ and the best "
                   "checkpoints are chosen by validation loss (--best_metric=val_loss says so; "
                   "--eval_bleu_samples=N ranks by BLEU-4 again).")
    return dataclasses.replace(config, best_metric="val_loss")
