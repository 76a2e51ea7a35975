"""Command-line values → a typed config, and the listing of every option that `--help` shows.

Everything here is read from the fields' metadata (see `lowmem.config.option`): their types, help, bounds
and aliases are declared once, beside their defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import numbers
import typing
from typing import TYPE_CHECKING, Any, Collection, Iterable, TypeVar

from lowmem.config.option import spec_of
from lowmem.errors import ConfigError
from lowmem.log_format import launch_rank
from lowmem.program import command_line

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

logger = logging.getLogger(__name__)

_AUTO = ("auto", "none", "")
# What a yes/no option accepts on the command line, in any case; anything else is an error, not "true".
TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")


def parse_bool(name: str, value: Any, optional: bool = False) -> bool:
    """A command-line yes/no value: True/False, 1/0, or the words true/false, 1/0, yes/no (any case).

    Raises ConfigError for anything else, so that `--is_keep_training=flase` is caught instead of meaning True.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    expected = "True or False (also 1/0, yes/no, in any case)" + (", or None for automatic" if optional else "")
    raise ConfigError(f"--{name}={value!r} is not valid: {name} takes {expected}.")
ConfigT = TypeVar("ConfigT", bound="DataclassInstance")


def config_fields(config: DataclassInstance | type[DataclassInstance]) -> dict[str, Any]:
    """Field name → declared type of a config dataclass or instance (with string annotations resolved)."""
    config_class = config if isinstance(config, type) else type(config)
    hints = typing.get_type_hints(config_class)
    return {field.name: hints[field.name] for field in dataclasses.fields(config_class)}


def class_defaults(config: DataclassInstance) -> dict[str, Any]:
    """Field name → the default of the config's class: for a preset's class, the preset's defaults."""
    return {field.name: field.default for field in dataclasses.fields(config)}


def config_aliases(config: DataclassInstance | type[DataclassInstance]) -> dict[str, str]:
    """Alias → field name, for the fields that have other command-line names (`--keep_best_n`)."""
    return {alias: field.name for field in dataclasses.fields(config) for alias in spec_of(field).aliases}


def alias_notes(config: DataclassInstance | type[DataclassInstance]) -> dict[str, str]:
    """Alias → the line said when it is used, for the aliases declared with a note (`--gradient_checkpointing`)."""
    notes: dict[str, str] = {}
    for field in dataclasses.fields(config):
        spec = spec_of(field)
        for alias in spec.aliases:
            note = spec.alias_note(alias, field.name)
            if note is not None:
                notes[alias] = note
    return notes


def _coerce(name: str, value: Any, declared: Any) -> Any:
    """Convert a command-line value to the field's type, or raise a ConfigError that says what is expected."""
    optional = typing.get_origin(declared) is typing.Union and type(None) in typing.get_args(declared)
    base = next((t for t in typing.get_args(declared) if t is not type(None)), declared) if optional else declared
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in _AUTO)):
        return None
    if base is bool:
        return parse_bool(name, value, optional)
    elif base is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)  # 1e4 on the command line arrives as a float
        expected = "a whole number"
    elif base is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        expected = "a number"
    elif base is str:
        if isinstance(value, (str, numbers.Number)) and not isinstance(value, bool):
            return str(value)  # fire turns `--train_file=2024` into an int
        if isinstance(value, (tuple, list)) and value and all(
                isinstance(item, (str, numbers.Number)) and not isinstance(item, bool) for item in value):
            return ",".join(str(item) for item in value)  # fire splits `--lora_targets=q_proj,v_proj` at the comma
        expected = "a text value"
    else:
        return value
    raise ConfigError(f"--{name}={value!r} is not valid: {name} takes {expected}.")


def _unknown_option(name: str, fields: dict[str, Any], aliases: dict[str, str]) -> ConfigError:
    close = difflib.get_close_matches(name.replace("-", "_"), [*fields, *aliases], n=1)
    hint = f" Did you mean --{close[0]}?" if close else ""
    listed = [f"--{field}" for field in fields] + [f"--{alias} (= --{field})" for alias, field in aliases.items()]
    return ConfigError(f"Unknown option --{name}.{hint} Valid options: " + ", ".join(listed)
                       + f". (`{command_line('train --help')}` describes the command.)")


def apply_overrides(config: ConfigT, overrides: dict[str, Any]) -> ConfigT:
    """Return a copy of `config` with `overrides` applied, each converted to its field's type.

    Names may use - for _ and may be an alias (`keep_best_n` for `keep_latest_n_ckp`); an alias given
    together with its field is an error, and an alias declared with a note says so in one line
    (`--gradient_checkpointing`, HF's name for `--activation_checkpointing`). An unknown name is an error listing
    the valid ones (and the closest match). A value the field declares as an older spelling of None
    (`--dataloader_num_workers=-1`, `--attention=auto`) becomes None.
    """
    fields = config_fields(config)
    specs = {field.name: spec_of(field) for field in dataclasses.fields(config)}
    aliases = config_aliases(config)
    changes: dict[str, Any] = {}
    given_as: dict[str, str] = {}  # field → the name it was given as
    for name, value in overrides.items():
        key = name.replace("-", "_")
        key = aliases.get(key, key)
        if key not in fields:
            raise _unknown_option(name, fields, aliases)
        if key in given_as:
            raise ConfigError(f"--{given_as[key]} and --{name} set the same option ({key}): give only one of them.")
        given_as[key] = name
        value = _coerce(key, value, fields[key])
        changes[key] = None if specs[key].means_none(value) else value  # an older spelling of None (-1, "auto")
    _say_alias_notes(config, given_as.values())
    return dataclasses.replace(config, **changes)


def _say_alias_notes(config: DataclassInstance, names: Iterable[str]) -> None:
    """One line for each alias used that declares a note, once everything given was accepted; from the first
    process of a launch only (every process reads the same flags)."""
    if launch_rank() != 0:
        return
    notes = alias_notes(config)
    for name in names:
        note = notes.get(name.replace("-", "_"))
        if note is not None:
            logger.info(note)


def given_fields(config: DataclassInstance | type[DataclassInstance], overrides: dict[str, Any]) -> frozenset[str]:
    """The field names `overrides` set (`-` read as `_`, aliases resolved); unknown names are left out."""
    fields, aliases = config_fields(config), config_aliases(config)
    names = (aliases.get(name.replace("-", "_"), name.replace("-", "_")) for name in overrides)
    return frozenset(name for name in names if name in fields)


def explicit_fields(config: DataclassInstance, given: Collection[str] | None = None) -> frozenset[str]:
    """The fields a user set: those named on the command line (`given`), and any that differ from the
    defaults of the config's class (a preset's defaults count as defaults)."""
    defaults = type(config)()
    differing = {item.name for item in dataclasses.fields(config)
                 if getattr(config, item.name) != getattr(defaults, item.name)}
    return frozenset(differing | set(given or ()))


def describe_fields(config: DataclassInstance) -> str:
    """Every option with its value in `config` (its default, for a fresh one) and its help, one per line; a None
    is followed by the older spellings the field still accepts for it (`--attention=None (or auto)`)."""
    lines = []
    for field in dataclasses.fields(config):
        spec = spec_of(field)
        value = getattr(config, field.name)
        spelled = "".join(f" (or {spelling})" for spelling in spec.none_spellings) if value is None else ""
        also = "".join(f" (also --{alias})" for alias in spec.aliases)
        lines.append(f"--{field.name}={value!r}{spelled}{also}: {spec.help}".rstrip(": "))
    return "\n".join(lines)
