"""The demo data set that ships inside the package, used when no data is given at all: every data path at its
default, and none of them present in the current folder; the demo's run and tokenizer folders.

`lowmem train` run from any folder then trains on the demo rows, while a user who gives any data of their own
(a path on the command line, or files at data/train.parquet, the default paths relative to the current
folder) never gets demo rows mixed in: a missing validation file is then an error that names it, not the
demo's Chinese poetry silently ranking their checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, TypeVar

from lowmem.config.overrides import class_defaults
from lowmem.config.sections import DataConfig

logger = logging.getLogger(__name__)

DEMO_DATA_DIR = Path(__file__).resolve().parents[1] / "demo_data"
# The config field → the demo file it falls back to.
DEMO_FILES = {"train_file": "train.parquet", "validation_file": "valid.parquet", "test_file": "test.parquet"}

DataConfigT = TypeVar("DataConfigT", bound=DataConfig)


def with_demo_data(config: DataConfigT, announce: bool = True) -> DataConfigT:
    """`config` with its data paths pointed at the packaged demo files (and, with `announce`, one INFO line saying
    so) when no data was given: every data path at its default and absent from the current folder. Otherwise
    unchanged. Commands that read no data (generate, export) resolve the paths too, silently: the run folder
    depends on them."""
    defaults = class_defaults(config)
    no_data_given = all(getattr(config, name) == defaults[name] and not os.path.exists(getattr(config, name))
                        for name in DEMO_FILES)
    if not no_data_given or config.train_sources:
        return config
    changes: dict[str, Any] = {name: str(DEMO_DATA_DIR / file_name) for name, file_name in DEMO_FILES.items()
                               if (DEMO_DATA_DIR / file_name).is_file()}
    if not changes:
        return config
    if announce:
        logger.info("%s not found in %s: using the demo data set that ships with lowmem, in %s.",
                    ", ".join(getattr(config, name) for name in changes), os.getcwd(), DEMO_DATA_DIR)
    return dataclasses.replace(config, **changes)


# TrainConfig's run and tokenizer folders: the demo's. Data of the user's own gets folders of its own instead.
DEMO_OUTPUT_DIR = "model_save/demo"
DEMO_TOKENIZER_DIR = "model_save/tokenizer"


def is_demo_file(path: str) -> bool:
    """Whether `path` is one of the packaged demo data set's files."""
    return Path(path).resolve().parent == DEMO_DATA_DIR


def uses_demo_data(config: DataConfig) -> bool:
    """Whether `config` trains on the packaged demo data set."""
    return is_demo_file(config.train_file)


def data_name(train_file: str) -> str:
    """A folder name for a run on `train_file`: the file's stem, or the folder's name for a folder or a glob."""
    path = Path(str(train_file).rstrip("/"))
    while any(char in path.name for char in "*?[") and path.parent != path:
        path = path.parent
    return (path.stem if path.suffix else path.name) or "run"
