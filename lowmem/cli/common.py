"""What the commands share: the config they start from, and the program name that `--help` shows."""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any, Callable

from lowmem.config import TrainConfig, TrainConfigPretrainLarge, apply_overrides, with_demo_data
from lowmem.config.overrides import parse_bool


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


def comma_separated(value: Any) -> list[str]:
    """A flag's list of names: fire hands `--stages=a,b` over as a tuple and `--stages=a` as a string."""
    return [name.strip() for name in (value.split(",") if isinstance(value, str) else value) if name.strip()]


def strict_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with its own yes/no parameters (`--use_large_config`, `--is_keep_training`, ...) read as the
    config's are (`parse_bool`): fire alone takes any text as true, so `--is_keep_training=false` resumed."""
    signature = inspect.signature(command)
    flags = [name for name, parameter in signature.parameters.items()
             if parameter.annotation in (bool, "bool") and isinstance(parameter.default, bool)]

    @functools.wraps(command)
    def checked(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        for name in flags:
            if name in bound.arguments:
                bound.arguments[name] = parse_bool(name, bound.arguments[name])
        return command(*bound.args, **bound.kwargs)

    return checked
