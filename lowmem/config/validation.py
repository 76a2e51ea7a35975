"""The checks a config passes before any work starts; each failure says what to change.

Each field is checked against the bounds and choices declared with it (see `lowmem.config.option`); then
the few rules that involve two fields. The data paths are checked by the data layer
(`lowmem.data.path_checks`).
"""

from __future__ import annotations

import dataclasses

from lowmem.config.columns import is_preference
from lowmem.config.option import spec_of
from lowmem.config.overrides import class_defaults
from lowmem.config.train_config import TrainConfig
from lowmem.config.train_sources import parse_sources
from lowmem.errors import ConfigError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate_config(config: TrainConfig) -> None:
    """Check values before any work starts; each failure says what to change.

    Each field is checked against the bounds and choices declared with it; then the few rules that
    involve two fields.
    """
    for field in dataclasses.fields(config):
        problem = spec_of(field).problem(field.name, getattr(config, field.name))
        _require(problem is None, problem or "")
    _require(config.n_embd % config.n_head == 0,
             f"--n_embd ({config.n_embd}) must be divisible by --n_head ({config.n_head}).")
    # Unset means llama for a new run; a resumed gpt2 run is settled to gpt2 only later, so it must pass here.
    _require(config.architecture == "gpt2" or (config.n_embd // config.n_head) % 2 == 0,
             f"The llama architecture rotates pairs of channels: --n_embd // --n_head "
             f"({config.n_embd // config.n_head}) must be even. Choose another --n_head or --n_embd, or pass "
             "--architecture=gpt2.")
    if config.train_sources:
        _check_train_sources(config)
    if is_preference(config):
        _check_preference(config)
    else:
        _require(config.best_metric != "rewards_accuracy",
                 "--best_metric=rewards_accuracy ranks checkpoints of preference training (--objective=dpo); this "
                 "run trains on the next token: use bleu4 or val_loss.")
        _require(config.dpo_reference != "precomputed",
                 "--dpo_reference=precomputed is for preference training: add --objective=dpo, or leave it out.")
    if config.text_column:
        _check_text_column(config)
    elif not is_preference(config):  # preference rows have no response column: their three are checked above
        _require(config.prompt_column != config.response_column,
                 "--prompt_column and --response_column must name two different columns.")


def _check_preference(config: TrainConfig) -> None:
    """Preference rows are a prompt and two answers: one text column cannot be, and the three columns differ."""
    _require(not config.text_column,
             f"--objective=dpo reads a prompt and two answers per row, and --text_column={config.text_column} reads "
             "one column of text: leave --text_column out (the columns are --prompt_column, --chosen_column and "
             "--rejected_column).")
    columns = (config.prompt_column, config.chosen_column, config.rejected_column)
    _require(len(set(columns)) == 3,
             f"--prompt_column={columns[0]}, --chosen_column={columns[1]} and --rejected_column={columns[2]} must name "
             "three different columns.")


def _check_text_column(config: TrainConfig) -> None:
    """One text column is read instead of the pairs: pair settings given with it would be silently ignored."""
    defaults = class_defaults(config)  # the preset's, for a preset
    pair_columns = [f"--{name}={getattr(config, name)}" for name in ("prompt_column", "response_column")
                    if getattr(config, name) != defaults[name]]
    _require(not pair_columns,
             f"--text_column={config.text_column} trains on one column of text, so {' and '.join(pair_columns)} "
             "would not be read. Leave them out to train on the text column, or leave --text_column out to train "
             "on prompt/response pairs.")
    _require(config.loss_on_response_only is not True,
             "--loss_on_response_only=True leaves the prompt out of the loss, but rows of one text column "
             f"(--text_column={config.text_column}) have no prompt: every token of the text is trained on. Leave "
             "--loss_on_response_only out (or pass False), or train on prompt/response pairs without --text_column.")


def _check_train_sources(config: TrainConfig) -> None:
    """The sources parse, and --train_file is not given beside them (it would not be read)."""
    parse_sources(config.train_sources)
    _require(config.train_file == class_defaults(config)["train_file"],
             f"--train_sources={config.train_sources} replaces --train_file, so --train_file={config.train_file} "
             "would not be read. Add it to the sources with its weight, or leave one of the two out.")
