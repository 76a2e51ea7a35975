"""The rules that settle a run's config, in one place for every command: the fields a config leaves to decide
(None), decided from the run a resume continues from, from the model a command uses, or as a new run's.

    settled_config      `train` and `plan` (through `lowmem.train.startup.settle_run`): the architecture, the loss
                        targets and the tokenizer folder (a resume keeps its checkpoint's), and the checkpoint ranking
    settled_for_model   `evaluate`, `generate` and `export`: the columns and loss targets of the model they use, by
                        the rules a resume follows
    in_effect           a saved config with the values its run had for the fields added after it was written

The functions only decide: what is read (a run folder, a model folder) is read by the caller and handed in.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Collection

from lowmem.config.columns import is_preference, response_only
from lowmem.config.option import values_before_the_field
from lowmem.config.read_only import read_only
from lowmem.config.train_config import TrainConfig

logger = logging.getLogger(__name__)

# The architecture of a new run whose config leaves it unset: the one that reached the lower validation loss
# on the demo data in the same training time (README, "Architectures").
NEW_RUN_ARCHITECTURE = "llama"

# Fields added after checkpoints were written without them: the value those runs had in effect, as each field
# declares it (`option(..., before=...)`).
VALUES_BEFORE_THE_FIELD = values_before_the_field(TrainConfig)


def in_effect(saved_config: dict[str, Any]) -> dict[str, Any]:
    """A saved config with the values its run had in effect for the fields added after it was written."""
    return {**VALUES_BEFORE_THE_FIELD, **saved_config}


def settled_config(config: TrainConfig, saved_config: dict[str, Any] | None,
                   given: Collection[str] | None = None) -> TrainConfig:
    """`config` with every field left to decide decided, from the config of the checkpoint a resume continues from
    (`saved_config`, with `in_effect`'s values; None for a new run) where a resume keeps its value: the
    architecture, the loss targets, the tokenizer folder (unless given) and the checkpoint ranking. Checkpoints
    thus always record concrete values."""
    config = settle_loss_targets(settle_architecture(config, saved_config), saved_config)
    if given is not None and "tokenizer_dir" not in given:
        config = resumed_tokenizer_dir(config, saved_config)
    return settle_best_metric(config)


def settle_architecture(config: TrainConfig, saved_config: dict[str, Any] | None) -> TrainConfig:
    """`config` with its architecture decided: as given; else that of the checkpoint a resume continues from
    (`saved_config`, with `in_effect`'s values: gpt2 for those saved before the option existed); else
    NEW_RUN_ARCHITECTURE. A resumed run thus keeps its model whatever the default, and an explicit other value is
    refused by the resume check."""
    if config.architecture is not None:
        return config
    if saved_config is None:
        return dataclasses.replace(config, architecture=NEW_RUN_ARCHITECTURE)
    return dataclasses.replace(config, architecture=saved_config["architecture"])


def settle_loss_targets(config: TrainConfig, saved_config: dict[str, Any] | None) -> TrainConfig:
    """`config` with --loss_on_response_only decided: as given; else, when resuming a run of the same columns,
    that of the checkpoint it continues from (`saved_config`, with `in_effect`'s values; runs saved when every
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
    if is_preference(config) and config.best_metric == "bleu4":
        logger.info("Preference training ranks checkpoints by rewards/accuracy on the held-out pairs of "
                    "--validation_file (--best_metric=val_loss ranks them by the DPO loss there).")
        return dataclasses.replace(config, best_metric="rewards_accuracy")
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


def settled_for_model(config: TrainConfig, trained_config: dict[str, Any] | None, folder: Path) -> TrainConfig:
    """`config` of a command that uses the trained model in `folder` (evaluate, generate, export), settled from the
    config it was trained with (`trained_config`: `lowmem.checkpoint.export.trained_config`) by the rules a resume
    follows: the one text column it was trained on unless columns were given, then the loss targets
    (`settle_loss_targets`). What was taken from the model is said in one line; the config comes back read-only."""
    saved_config = None if trained_config is None else in_effect(trained_config)
    trained = saved_config or {}
    settled = config
    if not config.text_column and trained.get("text_column"):
        settled = dataclasses.replace(settled, text_column=trained["text_column"])
    settled = settle_loss_targets(settled, saved_config)
    taken = [f"--{name}={getattr(settled, name)}" for name in ("text_column", "loss_on_response_only")
             if getattr(settled, name) != getattr(config, name) and trained.get(name) == getattr(settled, name)]
    if taken:
        logger.info("As %s was trained: %s.", folder, ", ".join(taken))
    return read_only(settled)
