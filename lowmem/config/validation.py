"""The checks a config passes before any work starts; each failure says what to change.

Each field is checked against the bounds and choices declared with it (see `lowmem.config.option`); then
the few rules that involve two fields, and the data paths.
"""

from __future__ import annotations

import dataclasses
import os

from lowmem.config.option import spec_of
from lowmem.config.sections import DataConfig
from lowmem.config.train_config import TrainConfig
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
             f"({config.n_embd // config.n_head}) must be even. Choose another --n_head or --n_embd, or pass --architecture=gpt2.")
    _require(config.prompt_column != config.response_column,
             "--prompt_column and --response_column must name two different columns.")


def check_data_files(config: DataConfig, names: tuple[str, ...] = ("train_file", "validation_file")) -> None:
    """Fail early, with where to put the data, when a configured local data path does not exist, or names a
    file that is not parquet (JSON Lines, CSV, text: the message says which, and how to convert it).

    URIs (s3://, gs://, hdfs://) pass: checking them costs requests, and the data stream resolves them
    with messages of its own (missing bucket, credentials, endpoint). Local files are checked by their
    first 4 bytes only, so a folder of thousands of files costs little.
    """
    from lowmem.data.sources import not_parquet_problem, resolve_parquet_files  # the data layer loads torch

    for name in names:
        path = getattr(config, name)
        if "://" in path:
            continue
        if not any(ch in path for ch in "*?[") and not os.path.exists(path):
            raise ConfigError(
                f"The {name.replace('_', ' ')} '{path}' does not exist (looked in '{os.getcwd()}'). Put your "
                f"parquet files (string columns '{config.prompt_column}' and '{config.response_column}') there, or "
                f"pass --{name}=PATH (a file, a directory or a glob). The demo data set that ships with lowmem "
                "stands in only when no data path is given at all."
            )
        for file in resolve_parquet_files(path):
            problem = not_parquet_problem(file, (config.prompt_column, config.response_column), f"--{name}")
            if problem:
                raise ConfigError(f"The {name.replace('_', ' ')} {problem}")
