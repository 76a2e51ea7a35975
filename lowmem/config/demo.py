"""The demo data set that ships inside the package, used when the data paths are left at their defaults.

`lowmem train` run from any folder then trains on the demo rows, while a user who puts their own files at
data/train.parquet (the default paths, relative to the current folder) keeps getting those.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TypeVar

from lowmem.config.sections import DataConfig

logger = logging.getLogger(__name__)

DEMO_DATA_DIR = Path(__file__).resolve().parents[1] / "demo_data"
# The config field → the demo file it falls back to.
DEMO_FILES = {"train_file": "train.parquet", "validation_file": "valid.parquet", "test_file": "test.parquet"}

DataConfigT = TypeVar("DataConfigT", bound=DataConfig)


def with_demo_data(config: DataConfigT) -> DataConfigT:
    """`config` with each data path that is at its default and absent from the current folder pointed at the
    packaged demo file (and one INFO line saying so); other paths are left as they are."""
    defaults = {field.name: field.default for field in dataclasses.fields(config)}
    changes = {}
    for name, file_name in DEMO_FILES.items():
        path = getattr(config, name)
        if path == defaults[name] and not os.path.exists(path) and (DEMO_DATA_DIR / file_name).is_file():
            changes[name] = str(DEMO_DATA_DIR / file_name)
    if not changes:
        return config
    logger.info("%s not found in %s: using the demo data set that ships with lowmem, in %s.",
                ", ".join(getattr(config, name) for name in changes), os.getcwd(), DEMO_DATA_DIR)
    return dataclasses.replace(config, **changes)
