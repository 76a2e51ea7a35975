"""Applying command-line overrides to a config dataclass, and checking its values up front."""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import os
import typing
from typing import Any

from lowmem.errors import ConfigError

_AUTO = ("auto", "none", "")


def config_fields(config: Any) -> dict[str, Any]:
    """Field name → declared type of a config dataclass (with string annotations resolved)."""
    hints = typing.get_type_hints(type(config))
    return {field.name: hints[field.name] for field in dataclasses.fields(config)}


def _coerce(name: str, value: Any, declared: Any) -> Any:
    """Convert a command-line value to the field's type, or raise a ConfigError that says what is expected."""
    optional = typing.get_origin(declared) is typing.Union and type(None) in typing.get_args(declared)
    base = next((t for t in typing.get_args(declared) if t is not type(None)), declared) if optional else declared
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in _AUTO)):
        return None
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        expected = "True or False" + (" (or None for automatic)" if optional else "")
    elif base is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)  # 1e4 on the command line arrives as a float
        expected = "a whole number"
    elif base is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        expected = "a number"
    elif base is str:
        if isinstance(value, (str, numbers.Number)) and not isinstance(value, bool):
            return str(value)  # fire turns `--train_file=2024` into an int
        expected = "a text value"
    else:
        return value
    raise ConfigError(f"--{name}={value!r} is not valid: {name} takes {expected}.")


def apply_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """Return a copy of `config` with `overrides` applied, each converted to its field's type.

    An unknown name is an error listing the valid ones (and the closest match).
    """
    fields = config_fields(config)
    changes = {}
    for name, value in overrides.items():
        key = name.replace("-", "_")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean --{close[0]}?" if close else ""
            raise ConfigError(
                f"Unknown option --{name}.{hint} Valid options: "
                + ", ".join(f"--{field}" for field in fields)
                + ". (`python train_low_mem.py train --help` describes the command.)"
            )
        changes[key] = _coerce(key, value, fields[key])
    return dataclasses.replace(config, **changes)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate_config(config: Any) -> None:
    """Check values before any work starts; each failure says what to change."""
    positive = ["batch_size_per_gpu", "gradient_accumulation_steps", "max_seq_len", "n_layer", "n_head", "n_embd",
                "vocab_size", "dataloader_buffer_size", "logging_steps", "save_steps", "epochs",
                "tokenizer_max_sentences", "sample_max_new_tokens"]
    for name in positive:
        value = getattr(config, name)
        _require(value >= 1, f"--{name} must be at least 1 (it is {value}).")
    for name in ("max_steps", "warmup_steps", "keep_latest_n_ckp", "eval_batches", "cleanup_steps", "memory_log_steps",
                 "eval_steps", "eval_no_repeat_ngram_size"):
        value = getattr(config, name)
        _require(value >= 0, f"--{name} must be 0 or more (it is {value}).")
    _require(config.learn_rate > 0, f"--learn_rate must be above 0 (it is {config.learn_rate}); try 1e-4 to 3e-3.")
    _require(0 <= config.min_lr_ratio <= 1, f"--min_lr_ratio must be between 0 and 1 (it is {config.min_lr_ratio}).")
    _require(config.weight_decay >= 0, f"--weight_decay must be 0 or more (it is {config.weight_decay}).")
    _require(config.grad_clip >= 0, f"--grad_clip must be 0 (off) or more (it is {config.grad_clip}).")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(config, name)
        _require(0 <= value < 1, f"--{name} must be in [0, 1) (it is {value}); the usual values are 0.9 and 0.95.")
    _require(0 <= config.dropout < 1, f"--dropout must be in [0, 1) (it is {config.dropout}).")
    _require(config.n_embd % config.n_head == 0,
             f"--n_embd ({config.n_embd}) must be divisible by --n_head ({config.n_head}).")
    _require(config.dataloader_num_workers >= -1,
             f"--dataloader_num_workers must be -1 (automatic), 0 or more (it is {config.dataloader_num_workers}).")
    _require(config.ultra_low_mem_threshold_gb > 0,
             f"--ultra_low_mem_threshold_gb must be above 0 (it is {config.ultra_low_mem_threshold_gb}).")
    _require(0 < config.memory_watchdog_fraction <= 1,
             f"--memory_watchdog_fraction must be in (0, 1] (it is {config.memory_watchdog_fraction}).")
    _require(config.memory_budget_gb >= 0, f"--memory_budget_gb must be 0 (detect) or more (it is {config.memory_budget_gb}).")
    _require(config.vocab_size >= 64, f"--vocab_size must be at least 64 (it is {config.vocab_size}).")
    _require(config.eval_bleu_samples >= -1,
             f"--eval_bleu_samples must be -1 (all), 0 (none) or more (it is {config.eval_bleu_samples}).")
    _require(config.best_metric in ("bleu4", "val_loss"),
             f"--best_metric must be bleu4 or val_loss (it is {config.best_metric!r}).")
    _require(config.eval_max_new_tokens >= 1, f"--eval_max_new_tokens must be at least 1 (it is {config.eval_max_new_tokens}).")
    _require(config.prompt_column != config.response_column,
             "--prompt_column and --response_column must name two different columns.")


def check_data_files(config: Any, names: tuple[str, ...] = ("train_file", "validation_file")) -> None:
    """Fail early, with where to put the data, when a configured local data path does not exist.

    URIs (s3://, gs://, hdfs://) pass: checking them costs requests, and the data stream resolves them
    with messages of its own (missing bucket, credentials, endpoint).
    """
    for name in names:
        path = getattr(config, name)
        if "://" in path or any(ch in path for ch in "*?[") or os.path.exists(path):
            continue
        raise ConfigError(
            f"The {name.replace('_', ' ')} '{path}' does not exist (looked in '{os.getcwd()}'). Put your parquet "
            f"files (string columns '{config.prompt_column}' and '{config.response_column}') there, or pass "
            f"--{name}=PATH (a file, a directory or a glob). The demo data set is in data/: run from the "
            "project's root folder to use it."
        )


def field_comments(config_class: type) -> dict[str, str]:
    """The one-line comment after each field in the class's source (what `--help` shows for each option)."""
    import inspect
    import io
    import tokenize

    comments: dict[str, str] = {}
    for klass in reversed(config_class.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        source = inspect.getsource(klass)
        field_on_line: dict[int, str] = {}
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.NAME and token.start[1] == 4 and token.start[0] not in field_on_line:
                field_on_line[token.start[0]] = token.string
            elif token.type == tokenize.COMMENT and token.start[0] in field_on_line:
                comments[field_on_line[token.start[0]]] = token.string.lstrip("# ").strip()
    return comments


def describe_fields(config: Any) -> str:
    """Every option with its default and comment, one per line."""
    comments = field_comments(type(config))
    return "\n".join(
        f"--{name}={getattr(config, name)!r}: {comments.get(name, '')}".rstrip(": ")
        for name in config_fields(config)
    )
