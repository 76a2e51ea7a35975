"""The run folder of data that is not the demo's: `model_save/<data name>` instead of the demo's, unless the
demo's folder already holds a run on the same data."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Collection, TypeVar

from lowmem.config.demo import DEMO_OUTPUT_DIR, DEMO_TOKENIZER_DIR, data_name, uses_demo_data
from lowmem.config.train_config import TrainConfig
from lowmem.config.train_sources import training_paths

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT", bound=TrainConfig)


def _earlier_run_on(train_file: str) -> bool:
    """Whether the demo's run folder holds checkpoints of a run on `train_file` (made before data of one's own
    got a folder of its own): that run goes on there."""
    from lowmem.checkpoint.contents import newest_saved_config  # loads torch: only for the commands that read data

    saved = newest_saved_config(DEMO_OUTPUT_DIR) if Path(DEMO_OUTPUT_DIR).is_dir() else None
    return saved is not None and saved.get("train_file") == train_file


def with_run_folders(config: ConfigT, given: Collection[str]) -> ConfigT:
    """`config` with folders of its own for data that is not the demo's: output_dir and tokenizer_dir left at the
    demo's (`model_save/demo`, `model_save/tokenizer`) become `model_save/<data name>` and
    `<output_dir>/tokenizer`, said in one line, so that a run on other data never resumes, overwrites or shares
    the tokenizer of the demo's run. Unchanged when the demo's folder already holds a run on the same file."""
    if uses_demo_data(config) or "output_dir" in given or config.output_dir != DEMO_OUTPUT_DIR:
        return config
    if not config.train_sources and _earlier_run_on(config.train_file):
        logger.info("%s holds an earlier run on %s: it goes on there.", DEMO_OUTPUT_DIR, config.train_file)
        return config
    train_data = config.train_sources or config.train_file
    changes: dict[str, Any] = {"output_dir": f"model_save/{data_name(training_paths(config)[0])}"}
    if "tokenizer_dir" not in given and config.tokenizer_dir == DEMO_TOKENIZER_DIR:
        changes["tokenizer_dir"] = f"{changes['output_dir']}/tokenizer"
    logger.info("Run folder for %s: %s (--output_dir=PATH chooses another).", train_data,
                ", ".join(f"{name} {value}" for name, value in changes.items()))
    return dataclasses.replace(config, **changes)
