"""What the commands share: the config they start from, and the program name that `--help` shows."""

from __future__ import annotations

import os
import sys
from typing import Any

from lowmem.config import TrainConfig, TrainConfigPretrainLarge, apply_overrides, with_demo_data


def build_config(use_large_config: bool, overrides: dict[str, Any], demo_data: bool = True) -> TrainConfig:
    """The preset (TrainConfig, or TrainConfigPretrainLarge) with the command line's overrides applied.

    With `demo_data`, data paths left at their defaults are pointed at the packaged demo data set when they
    do not exist in the current folder (commands that read no data pass False, and say nothing about it).
    """
    config = apply_overrides(TrainConfigPretrainLarge() if use_large_config else TrainConfig(), overrides)
    return with_demo_data(config) if demo_data else config


def program_name() -> str:
    """How the user started us, for usage lines: `train_low_mem.py`, else `lowmem` (also for `python -m lowmem`)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and name not in ("-c", "-m", "__main__.py") else "lowmem"
