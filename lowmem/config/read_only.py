"""The settled config, read-only: once a command has settled its run (`lowmem.train.startup`), the config it hands to
the Trainer, setup and the commands is a copy whose fields cannot be set, so that nothing below the settle decides a
setting again by writing it.

`read_only(config)` returns that copy: an instance of a subclass of the config's own class (a preset's class
included), equal to the config it was made from, as JSON the same, and read-only in every copy
`dataclasses.replace` makes of it (a change is a new settled value, made where it is decided). Setting a field
raises `SettledConfigError`, a bug in the code that tried, not a user's mistake.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")

_READ_ONLY_CLASSES: dict[type, type] = {}


class SettledConfigError(AttributeError):
    """A field of a settled (read-only) config was set."""


def read_only(config: ConfigT) -> ConfigT:
    """A read-only copy of the dataclass `config` (itself when it is one already)."""
    if is_read_only(config):
        return config
    values = {item.name: getattr(config, item.name) for item in dataclasses.fields(config)  # type: ignore[arg-type]
              if item.init}
    return _read_only_class(type(config))(**values)


def is_read_only(config: Any) -> bool:
    """Whether `config` is a settled, read-only config (`read_only`)."""
    return getattr(type(config), "_read_only_of", None) is not None


def _rebuild(base: type, values: dict[str, Any]) -> Any:
    """Unpickling a read-only config: its class is made anew from `base`, as `read_only` makes it."""
    return _read_only_class(base)(**values)


def _read_only_class(base: type) -> type:
    if base not in _READ_ONLY_CLASSES:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(self, *args, **kwargs)  # type: ignore[misc]
            object.__setattr__(self, "_sealed", True)

        def __setattr__(self: Any, name: str, value: Any) -> None:
            if self.__dict__.get("_sealed"):
                raise SettledConfigError(
                    f"The run's config is settled and read-only: {name} cannot be set here. Decide it where the run "
                    f"is settled (lowmem.train.startup), or make a changed copy with dataclasses.replace.")
            object.__setattr__(self, name, value)

        def __delattr__(self: Any, name: str) -> None:
            raise SettledConfigError(f"The run's config is settled and read-only: {name} cannot be deleted.")

        def __eq__(self: Any, other: Any) -> bool:  # equal to the writable config it was made from
            if not dataclasses.is_dataclass(other) or isinstance(other, type):
                return NotImplemented
            return (getattr(type(other), "_read_only_of", None) or type(other)) is base and \
                dataclasses.astuple(self) == dataclasses.astuple(other)

        def __reduce__(self: Any) -> tuple[Any, ...]:
            return _rebuild, (base, {item.name: getattr(self, item.name) for item in dataclasses.fields(self)
                                     if item.init})

        _READ_ONLY_CLASSES[base] = type(base.__name__, (base,), {
            "__init__": __init__, "__setattr__": __setattr__, "__delattr__": __delattr__, "__eq__": __eq__,
            "__hash__": None, "__reduce__": __reduce__, "_read_only_of": base, "__module__": base.__module__,
            "__qualname__": base.__qualname__, "__doc__": base.__doc__,
        })
    return _READ_ONLY_CLASSES[base]
