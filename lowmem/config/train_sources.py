"""--train_sources: several training sources, each a parquet file, folder or glob with a weight, as the
configuration holds them (text on the command line, a mapping in a config file). The data layer mixes them
(`lowmem.data.mixture`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowmem.config.demo import data_name
from lowmem.config.sections import DataConfig
from lowmem.errors import ConfigError


@dataclass(frozen=True)
class Source:
    """One source of a mixture: a parquet file, folder or glob, and its weight (any positive number)."""

    path: str
    weight: float


def parse_sources(text: str) -> list[Source]:
    """`PATH:WEIGHT,PATH:WEIGHT,...` (the --train_sources form) → Sources; a ConfigError that shows the form."""
    example = "--train_sources=data/pretrain/:0.7,data/chat.parquet:0.3"
    sources = []
    for item in (part.strip() for part in str(text).split(",")):
        if not item:
            continue
        path, _, weight = item.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if not path or value is None:
            raise ConfigError(f"--train_sources: '{item}' is not PATH:WEIGHT. Give each source as a file, folder or "
                              f"glob and its weight, separated by commas, e.g. {example}.")
        if not value > 0:
            raise ConfigError(f"--train_sources: the weight of '{path}' is {weight}; weights must be above 0 "
                              f"(leave a source out to not read it), e.g. {example}.")
        sources.append(Source(path, value))
    if not sources:
        raise ConfigError(f"--train_sources is empty: give at least one source, e.g. {example}.")
    return sources


def sources_text(value: Any) -> str:
    """The --train_sources text of a config file's value: the text itself, a mapping {path: weight}, or a list of
    {"path": ..., "weight": ...} (or "PATH:WEIGHT" strings)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return ",".join(f"{path}:{weight}" for path, weight in value.items())
    if isinstance(value, list):
        items = [item if isinstance(item, str) else f"{item.get('path')}:{item.get('weight')}"
                 for item in value if isinstance(item, (str, dict))]
        if len(items) == len(value):
            return ",".join(items)
    raise ConfigError(f"train_sources in a config file is {value!r}: give a mapping of paths to weights, e.g. "
                      '{"data/pretrain/": 0.7, "data/chat.parquet": 0.3}, or the command line\'s text form.')


def training_paths(config: DataConfig) -> list[str]:
    """The paths the training rows come from: each source's with --train_sources, else --train_file."""
    data = training_data(config)
    return [source.path for source in data] if isinstance(data, list) else [data]


def training_data(config: DataConfig) -> "str | list[Source]":
    """What the training loader reads: the sources with --train_sources, else the --train_file path."""
    return parse_sources(config.train_sources) if config.train_sources else config.train_file


def validation_sources(config: DataConfig) -> dict[str, str]:
    """--validation_sources by name (each path's file stem, or its folder's name), in the order given."""
    paths = [part.strip() for part in str(config.validation_sources).split(",") if part.strip()]
    named: dict[str, str] = {}
    for path in paths:
        name = data_name(path)
        while name in named:
            name += "_"
        named[name] = path
    return named
