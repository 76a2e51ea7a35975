"""What the commands share: the config they start from, and the program name that `--help` shows
(`lowmem.program`)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import sys
from typing import Any, Callable

from lowmem.cli.run_folder import with_run_folders
from lowmem.config import TrainConfig, apply_overrides, given_fields, with_demo_data
from lowmem.config.overrides import parse_bool
from lowmem.config.sources import choose_preset, read_config_file


# Settles a resolved config and the fields given into what `--print_config` prints: the values, and the lines
# that say where they come from.
SettleForPrint = Callable[[TrainConfig, frozenset[str]], tuple[dict[str, Any], list[str]]]


class ConfigPrinted(Exception):
    """`--print_config` printed the resolved config: the command stops there, successfully."""


def resolve_config(use_large_config: bool, overrides: dict[str, Any], demo_data: bool = True,
                   settle_for_print: SettleForPrint | None = None) -> tuple[TrainConfig, frozenset[str]]:
    """The config a command runs with, and the fields the user set (in a file or as flags).

    From lowest to highest: the preset (`--preset`, or `--use_large_config=True`), the `--config` file, the
    flags. Data paths left at their defaults point at the packaged demo data set when none of them exists (said in
    one line with `demo_data`; commands that read no data pass False); data of the user's own, or a model to start
    from, with the default run folder gets a run folder and tokenizer of its own (`with_run_folders`), for every
    command alike: `generate`, `evaluate`, `export` and `memlog` find the run `train` wrote with the same flags.
    `--print_config` prints the result as JSON and raises ConfigPrinted: as `settle_for_print` settles it (the
    config the run will use, with lines on stderr that say where its values come from) where a command gives one.
    """
    flags = dict(overrides)
    preset = flags.pop("preset", None)
    config_file = flags.pop("config", None)
    print_config = parse_bool("print_config", flags.pop("print_config", False))
    file_values = read_config_file(config_file) if config_file else {}
    preset = file_values.pop("preset", None) if preset is None else preset
    config = apply_overrides(choose_preset(use_large_config, preset)(), file_values)
    config = apply_overrides(config, flags)
    given = given_fields(config, file_values) | given_fields(config, flags)
    if config.mirror_cuda and "bf16_on_cpu" not in given:  # the GPU's precision: the rest follows from the device
        config = dataclasses.replace(config, bf16_on_cpu=True)
    config = with_run_folders(with_demo_data(config, announce=demo_data), given)
    if print_config:
        values, notes = settle_for_print(config, given) if settle_for_print else (dataclasses.asdict(config), [])
        print(json.dumps(values, indent=2, ensure_ascii=False))
        for note in notes:
            print(note, file=sys.stderr)
        raise ConfigPrinted()
    return config, given


def build_config(use_large_config: bool, overrides: dict[str, Any], demo_data: bool = True) -> TrainConfig:
    """The config a command runs with (`resolve_config`, without the fields the user set)."""
    return resolve_config(use_large_config, overrides, demo_data)[0]


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
