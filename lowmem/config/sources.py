"""Where a command's config comes from, lowest first: a preset (`--preset=large`, or `--use_large_config=True`),
a config file (`--config=FILE`: YAML, TOML or JSON, the same field names as the flags), then the flags.

A run's own `train_config.json` (in its final/ and best/ folders) is such a file, so a run can be repeated with
`--config=model_save/demo/final/train_config.json`.
"""

from __future__ import annotations

import difflib
import json
import logging
import tomllib
from pathlib import Path
from typing import Any, Collection

from lowmem.config.overrides import config_aliases, config_fields
from lowmem.config.train_config import PRESETS, TrainConfig, TrainConfigPretrainLarge
from lowmem.config.train_sources import sources_text
from lowmem.errors import ConfigError
from lowmem.program import command_line

logger = logging.getLogger(__name__)

DEFAULT_PRESET = "default"
# In a run's saved train_config.json: the fields the user gave, which `--config` applies again (the others were
# chosen for the host it ran on: the memory plan's savers and micro-batches, the values settled at start).
GIVEN_KEY = "given_fields"
# The preset name → its config class; `--use_large_config=True` is `--preset=large`.
PRESET_CLASSES: dict[str, type[TrainConfig]] = {DEFAULT_PRESET: TrainConfig, "large": TrainConfigPretrainLarge}
# The flags that choose where the config comes from rather than setting a field (`--help` lists them).
SOURCE_FLAGS = {
    "preset": f"start from a named set of defaults: {', '.join(PRESET_CLASSES)} (large = --use_large_config=True)",
    "config": "a YAML, TOML or JSON file of config fields (the flags' names); flags given as well win over it",
    "print_config": "print the config the run will use (train and plan: settled from the saved run, the data and "
                    "the memory plan; stderr says where each value comes from) as JSON, and exit",
}
assert set(PRESETS) <= set(PRESET_CLASSES), "every preset has its class"


def choose_preset(use_large_config: bool, preset: str | None) -> type[TrainConfig]:
    """The config class `--preset` (or `--use_large_config`) names; the two must not disagree."""
    if preset is None or str(preset).strip() == "":
        return TrainConfigPretrainLarge if use_large_config else TrainConfig
    name = str(preset).strip().lower()
    if name not in PRESET_CLASSES:
        raise ConfigError(f"--preset={preset!r} is not a preset: choose one of {', '.join(PRESET_CLASSES)}.")
    if use_large_config and name != "large":
        raise ConfigError(f"--use_large_config=True and --preset={name} ask for two presets: give only one of them.")
    return PRESET_CLASSES[name]


def _parse(path: Path, text: str) -> Any:
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(text)
    if suffix == ".toml":
        return tomllib.loads(text)
    return json.loads(text)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The fields a config file sets (YAML by its .yaml/.yml suffix, TOML by .toml, else JSON), checked by name.

    A `preset` key names the preset to start from, as `--preset` does. Unknown names are an error that lists
    them and the file, before anything starts.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config={path}: no such file. Pass a YAML, TOML or JSON file of config fields, for "
                          "example a run's final/train_config.json.")
    try:
        values = _parse(path, path.read_text(encoding="utf-8"))
    except Exception as error:  # noqa: BLE001 - every parser's error means the same to the user
        raise ConfigError(f"--config={path} could not be read as {path.suffix.lstrip('.') or 'JSON'}: {error}. "
                          "Fix the file (YAML for .yaml/.yml, TOML for .toml, JSON otherwise).") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config={path} must hold a mapping of field names to values, such as "
                          '{"n_layer": 8, "output_dir": "model_save/mine"}.')
    if "train_sources" in values:  # a mapping of paths to weights reads best in a file; the field holds text
        values["train_sources"] = sources_text(values["train_sources"])
    values = _given_values_of_a_saved_run(path, values)
    known = {*config_fields(TrainConfig), *config_aliases(TrainConfig()), "preset"}
    unknown = sorted(name for name in values if str(name).replace("-", "_") not in known)
    if unknown:
        what = "is not a config field" if len(unknown) == 1 else "are not config fields"
        close = difflib.get_close_matches(unknown[0].replace("-", "_"), sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"--config={path} sets {', '.join(unknown)}, which {what}{hint}. "
                          f"`{command_line('train --help')}` lists the fields; rename or remove them.")
    return {str(name): value for name, value in values.items()}


def saved_config_record(config: TrainConfig, given: Collection[str]) -> dict[str, Any]:
    """What a run's saved train_config.json holds besides its fields: its preset and the fields the user gave."""
    preset = next(name for name, preset in reversed(PRESET_CLASSES.items()) if isinstance(config, preset))
    return {"preset": preset, GIVEN_KEY: sorted(given)}


def _given_values_of_a_saved_run(path: Path, values: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config (it lists its given fields): the preset and the given values only, said in one line;
    any other file as it is."""
    if GIVEN_KEY not in values:
        return values
    given = values[GIVEN_KEY]
    if not isinstance(given, list):
        raise ConfigError(f"--config={path}: {GIVEN_KEY} must list field names; remove it to apply every field.")
    kept = {name: values[name] for name in given if name in values}
    chosen = sorted(name for name in values if name not in kept and name not in ("preset", GIVEN_KEY))
    logger.info("--config=%s is a run's saved config: applying the %d values its run was given (%s) and its preset; "
                "the other %d were chosen for the host it ran on (memory savers, micro-batches, settled values) "
                "and are chosen again here.", path, len(kept), ", ".join(sorted(kept)) or "none", len(chosen))
    return {**kept, **({"preset": values["preset"]} if "preset" in values else {})}
