"""`option()`: a config field that carries its help text, its bounds and its role on resume.

Everything the command line and the checks need to know about a field is declared once, next to its
default, and read back from `dataclasses.field(metadata=...)`:

    batch_size_per_gpu: int = option(32, "rows per micro-batch on each process", minimum=1, resume="exact")

A field added after checkpoints were written without it declares the value those runs had in effect
(`before=`), which a resume from such a checkpoint compares with (`values_before_the_field`).

A field that lowmem decides when it is left unset holds None, whatever the field; one that once spelled that
otherwise (-1, "auto") declares the old spellings (`none_spellings=`): they are read as None wherever a user can
still give them, on the command line, in a config file, or in a config built in Python (`automatic`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# Resume roles. Changing an "exact" field between a save and a resume changes what the rest of the run
# computes (data order, batches, schedule); changing a "model_shape" field makes the saved weights unusable.
EXACT = "exact"
MODEL_SHAPE = "model_shape"
RESUME_ROLES = (EXACT, MODEL_SHAPE)

_METADATA_KEY = "lowmem"


class _NoValue:
    """The `before` of a field that existed when the first checkpoints were written: there is no earlier value."""

    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE: Any = _NoValue()


@dataclass(frozen=True)
class OptionSpec:
    """What a field's metadata says about it: help text, bounds, allowed values, resume roles, aliases."""

    help: str
    minimum: float | None = None  # value >= minimum
    above: float | None = None  # value > above
    maximum: float | None = None  # value <= maximum
    below: float | None = None  # value < below
    choices: tuple[Any, ...] = ()
    hint: str = ""  # appended to a failed check: what the special values mean, or a good range
    resume: frozenset[str] = frozenset()
    aliases: tuple[str, ...] = ()
    alias_notes: tuple[tuple[str, str], ...] = ()  # (alias, why it exists) for the aliases that say so when used
    before: Any = NO_VALUE  # the value runs had in effect before the field existed (NO_VALUE: it always did)
    none_spellings: tuple[Any, ...] = ()  # older spellings of None ("lowmem decides"), read as None

    @property
    def added_later(self) -> bool:
        """Whether checkpoints were written before the field existed (it declares `before`)."""
        return not isinstance(self.before, _NoValue)

    def means_none(self, value: Any) -> bool:
        """Whether `value` leaves the field for lowmem to decide: None, or one of its older spellings."""
        if value is None:
            return True
        return not isinstance(value, bool) and value in self.none_spellings  # True == 1: no bool spells None

    def alias_note(self, alias: str, name: str) -> str | None:
        """The line said when `alias` sets field `name`, for an alias declared with a note; else None."""
        why = dict(self.alias_notes).get(alias)
        if why is None:
            return None
        return f"--{alias} is lowmem's --{name} ({why}): {self.help}."

    def allowed(self) -> str:
        """The allowed values in words ("at least 1", "in [0, 1)", "bleu4 or val_loss"); empty when any is."""
        if self.choices:
            names = [str(choice) for choice in self.choices]
            return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        if self.minimum is not None and self.maximum is not None:
            return f"between {self.minimum} and {self.maximum}"
        low = f"[{self.minimum}" if self.minimum is not None else f"({self.above}" if self.above is not None else ""
        high = f"{self.maximum}]" if self.maximum is not None else f"{self.below})" if self.below is not None else ""
        if low and high:
            return f"in {low}, {high}"  # interval notation: [ and ] include the bound, ( and ) do not
        if self.minimum is not None:
            return "0 or more" if self.minimum == 0 else f"at least {self.minimum}"
        if self.above is not None:
            return f"above {self.above}"
        if self.maximum is not None:
            return f"at most {self.maximum}"
        if self.below is not None:
            return f"below {self.below}"
        return ""

    def accepts(self, value: Any) -> bool:
        """Whether `value` is within the bounds and choices (None, or an older spelling of it, always is)."""
        return self.means_none(value) or self._within(value)

    def _within(self, value: Any) -> bool:
        if self.choices and value not in self.choices:
            return False
        try:
            return ((self.minimum is None or value >= self.minimum) and (self.above is None or value > self.above)
                    and (self.maximum is None or value <= self.maximum) and (self.below is None or value < self.below))
        except TypeError:  # a value of the wrong type set in code, not through apply_overrides
            return False

    def problem(self, name: str, value: Any) -> str | None:
        """The error message for `value`, or None when it is allowed."""
        if self.accepts(value):
            return None
        message = f"--{name} must be {self.allowed()} (it is {value!r})"
        return f"{message}; {self.hint}." if self.hint else f"{message}."


def option(default: Any, help: str, *, minimum: float | None = None, above: float | None = None,
           maximum: float | None = None, below: float | None = None, choices: Iterable[Any] = (), hint: str = "",
           resume: str | Iterable[str] = (), aliases: Iterable[str] = (),
           alias_notes: Mapping[str, str] | None = None, before: Any = NO_VALUE,
           none_spellings: Iterable[Any] = ()) -> Any:
    """A dataclass field with `default` whose metadata holds its help, bounds and resume roles.

    Args:
        default: the default value (immutable: every field is a str, number, bool or None).
        help: one line for `--help`.
        minimum / above / maximum / below: bounds checked by `validate_config` (>=, >, <=, <).
        choices: the only values allowed.
        hint: what to add when the check fails (what special values mean, or a good range).
        resume: "exact" and/or "model_shape": what changing it between a save and a resume breaks.
        aliases: other command-line names for the field.
        alias_notes: alias → why it exists (another library's name for the field, say): using that alias is then
            said in one line naming the field (`OptionSpec.alias_note`).
        before: for a field added after checkpoints were written without it, the value those runs had in effect
            (not necessarily today's default): what a resume from such a checkpoint compares with
            (`values_before_the_field`). Left out for a field that always existed.
        none_spellings: for a field whose "decided by lowmem" is None, the values that once said so (-1, "auto"):
            still accepted wherever a user gives them, and read as None (`automatic`, `apply_overrides`). None of
            them may be a value the bounds and choices allow.
    """
    roles = frozenset([resume] if isinstance(resume, str) else resume)
    unknown = roles - set(RESUME_ROLES)
    if unknown:
        raise ValueError(f"Unknown resume role(s) {sorted(unknown)}; use {RESUME_ROLES}.")
    names, notes = tuple(aliases), dict(alias_notes or {})
    if not set(notes) <= set(names):
        raise ValueError(f"Notes for {sorted(set(notes) - set(names))}, which are not aliases of the field {names}.")
    spec = OptionSpec(help=help, minimum=minimum, above=above, maximum=maximum, below=below, choices=tuple(choices),
                      hint=hint, resume=roles, aliases=names, alias_notes=tuple(notes.items()), before=before,
                      none_spellings=tuple(none_spellings))
    allowed_spellings = [spelling for spelling in spec.none_spellings if spec._within(spelling)]
    if allowed_spellings:
        raise ValueError(f"none_spellings {allowed_spellings} are values the field allows ({spec.allowed()}): "
                         "they could not also mean None.")
    if spec.added_later and not spec.accepts(before):
        raise ValueError(f"before={before!r} is not a value the field allows ({spec.allowed()}).")
    return dataclasses.field(default=default, metadata={_METADATA_KEY: spec})


def spec_of(field: dataclasses.Field) -> OptionSpec:
    """The OptionSpec of a field declared with `option()` (a bare spec with no help for any other field)."""
    return field.metadata.get(_METADATA_KEY, OptionSpec(help=""))


def fields_with_role(config_class: type, role: str) -> tuple[str, ...]:
    """Names of the fields of `config_class` with resume role `role`, in declaration order."""
    return tuple(field.name for field in dataclasses.fields(config_class) if role in spec_of(field).resume)


def values_before_the_field(config_class: type) -> dict[str, Any]:
    """Field name → the value runs had in effect before the field existed, for the fields of `config_class`
    declared with `before=` (those a checkpoint written before them lacks), in declaration order."""
    return {field.name: spec_of(field).before for field in dataclasses.fields(config_class)
            if spec_of(field).added_later}


def automatic(config_class: type, name: str, value: Any) -> bool:
    """Whether `value` of field `name` of `config_class` leaves it for lowmem to decide: None, or an older spelling
    of None the field declares (`none_spellings`, such as -1 for --dataloader_num_workers). The deciders read the
    field through this, so that a config built in Python with an old spelling decides as None does."""
    fields = {field.name: field for field in dataclasses.fields(config_class)}
    return spec_of(fields[name]).means_none(value)
