"""The data paths of a config checked before any work starts: each one there, and parquet; a failure says
where to put the data, or how to convert it."""

from __future__ import annotations

import os
from typing import Sequence

import pyarrow.parquet as pq

from lowmem.config.columns import data_columns
from lowmem.config.sections import DataConfig
from lowmem.config.train_sources import training_paths, validation_sources
from lowmem.data.sources import check_columns, not_parquet_problem, resolve_parquet_files
from lowmem.errors import ConfigError, DataError


def _label(name: str) -> str:
    return {"train_sources": "training source", "validation_sources": "validation source"}.get(
        name, name.replace("_", " "))


def check_data_files(config: DataConfig, names: tuple[str, ...] = ("train_file", "validation_file"),
                     columns: Sequence[str] | None = None) -> None:
    """Fail early, with where to put the data, when a configured local data path does not exist, or names a
    file that is not parquet (JSON Lines, CSV, text: the message says which, and how to convert it).

    URIs (s3://, gs://, hdfs://) pass: checking them costs requests, and the data stream resolves them
    with messages of its own (missing bucket, credentials, endpoint). Local files are checked by their
    first 4 bytes only, so a folder of thousands of files costs little, and the first file's footer for its
    `columns` (the config's data columns unless given): a file without them is refused before anything is written.
    """
    columns = data_columns(config) if columns is None else tuple(columns)
    for name, path in _named_paths(config, names):
        if "://" in path:
            continue
        if not any(ch in path for ch in "*?[") and not os.path.exists(path):
            raise ConfigError(
                f"The {_label(name)} '{path}' does not exist (looked in '{os.getcwd()}'). Put your "
                f"parquet files ({_string_columns(columns)}) there, or "
                f"pass --{name}=PATH (a file, a directory or a glob). The demo data set that ships with lowmem "
                "stands in only when no data path is given at all."
            )
        files = resolve_parquet_files(path)
        for file in files:
            problem = not_parquet_problem(file, columns, f"--{name}")
            if problem:
                raise ConfigError(f"The {_label(name)} {problem}")
        if files:  # the columns of the first file (its footer only): the stream checks every file as it opens it
            try:
                check_columns(files[0], pq.read_metadata(files[0]), columns)
            except DataError as error:  # which option named the file: a default one is easily not the one meant
                raise DataError(f"--{name}={path}: {error}") from None


def _named_paths(config: DataConfig, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(the option's name, a path) for each path to check: every source's in place of --train_file's with
    --train_sources."""
    named = []
    for name in names:
        if name == "train_file" and config.train_sources:
            named += [("train_sources", path) for path in training_paths(config)]
        else:
            named.append((name, getattr(config, name)))
        if name == "validation_file":
            named += [("validation_sources", path) for path in validation_sources(config).values()]
    return named


def _string_columns(columns: tuple[str, ...]) -> str:
    """The columns in words: string column 'text', or string columns 'prompt' and 'response'."""
    named = " and ".join(f"'{column}'" for column in columns)
    return f"string column{'s' if len(columns) > 1 else ''} {named}"
