"""Which fields of a record become which column: the layout a converted file takes, and the rows of one record.

A layout is chosen once per file, from its first record: the fields named on the command line, else the first of
these the record has: `prompt`/`response`; `text` (one column of text, for pretraining); `instruction`
(+ `input`)/`output` (Alpaca); `question`/`answer`; `query`/`response`; `prompt`/`completion`; `input`/`output`;
a conversation under `conversations` or `messages`. Records read from plain text are the text itself.

A conversation (a list of turns `{"role"|"from": ..., "content"|"value": ...}`) gives one row per assistant turn,
whose prompt is the conversation before it: the system turns first, then the earlier turns. A first answer
after a single user turn gets that turn's text alone as its prompt, the same row a plain prompt/response file
gives; later answers get every earlier turn, each on its own line as `User: ...` / `Assistant: ...`, so that a
model learns to answer in context rather than from the last question alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lowmem.errors import DataError

PAIR_COLUMNS = ("prompt", "response")
TEXT_COLUMNS = ("text",)
# Known layouts, in the order they are looked for: (prompt fields joined by a line break, response field).
ALIASES = ((("prompt",), "response"), (("instruction", "input"), "output"), (("question",), "answer"),
           (("query",), "response"), (("prompt",), "completion"), (("input",), "output"))
CONVERSATION_FIELDS = ("conversations", "messages")
_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
          "bot": "assistant", "model": "assistant"}
_MISSING = object()


@dataclass(frozen=True)
class Skip:
    """A row, or a whole record, left out, and why."""

    reason: str


@dataclass(frozen=True)
class FieldNames:
    """The fields named on the command line (None: not named)."""

    prompt: str | None = None
    response: str | None = None
    text: str | None = None

    @property
    def given(self) -> bool:
        return any(name is not None for name in (self.prompt, self.response, self.text))


@dataclass(frozen=True)
class RecordLayout:
    """How the records of one file become rows.

    kind: "pairs" (prompt fields → prompt, the response field → response), "text" (one field → text),
    "conversation" (a list of turns → one row per assistant turn) or "lines" (text records as they are).
    """

    kind: str
    prompt_fields: tuple[str, ...] = ()
    response_field: str = ""

    @property
    def columns(self) -> tuple[str, ...]:
        return TEXT_COLUMNS if self.kind in ("text", "lines") else PAIR_COLUMNS

    def describe(self) -> str:
        """The mapping in words, for the summary."""
        if self.kind == "lines":
            return "text → text"
        if self.kind == "conversation":
            return f"'{self.response_field}' → prompt/response, one row per assistant turn"
        source = " + ".join(f"'{name}'" for name in self.prompt_fields)
        if self.kind == "text":
            return f"{source} → text"
        return f"{source} → prompt, '{self.response_field}' → response"

    def rows(self, record: Any) -> Iterator[tuple[str, ...] | Skip]:
        """The rows of one record, and a Skip for each one left out."""
        if self.kind == "lines":
            yield (record,)
        elif self.kind == "conversation":
            yield from conversation_rows(field_value(record, self.response_field), self.response_field)
        else:
            yield self._pair(record)

    def _pair(self, record: dict) -> tuple[str, ...] | Skip:
        first, *extra = self.prompt_fields
        prompt = text_of(field_value(record, first), first)
        if isinstance(prompt, Skip) or self.kind == "text":
            return prompt if isinstance(prompt, Skip) else (prompt,)
        for name in extra:  # Alpaca's optional `input`: added on its own line when there is one
            more = field_value(record, name)
            if isinstance(more, str) and more.strip():
                prompt = f"{prompt}\n{more}"
        response = text_of(field_value(record, self.response_field), self.response_field)
        return response if isinstance(response, Skip) else (prompt, response)


def choose_layout(record: Any, names: FieldNames) -> RecordLayout:
    """The layout for a file whose first record is `record`: the named fields, or the first known one it has."""
    if isinstance(record, str):
        return RecordLayout("lines")
    if names.text is not None:
        return RecordLayout("text", (names.text,))
    if names.given:
        return RecordLayout("pairs", (names.prompt or PAIR_COLUMNS[0],), names.response or PAIR_COLUMNS[1])
    if has_field(record, "text") and not has_field(record, "prompt") and not has_field(record, "response"):
        return RecordLayout("text", ("text",))
    for prompt_fields, response_field in ALIASES:
        if has_field(record, prompt_fields[0]) and has_field(record, response_field):
            return RecordLayout("pairs", prompt_fields, response_field)
    for name in CONVERSATION_FIELDS:
        if isinstance(field_value(record, name), list):
            return RecordLayout("conversation", response_field=name)
    known = ", ".join("/".join((*fields[:1], response)) for fields, response in ALIASES)
    raise DataError(
        f"The first record has none of the fields convert looks for ({known}, text, or a conversation under "
        f"{' or '.join(CONVERSATION_FIELDS)}); its fields are: {', '.join(map(str, record)) or 'none'}. Name the "
        "fields to read with --prompt_field=... --response_field=... (or --text_field=... for one column of text)."
    )


def has_field(record: dict, name: str) -> bool:
    return field_value(record, name) is not _MISSING


def field_value(record: dict, name: str) -> Any:
    """The value under `name`; a dotted name (`meta.question`) reaches into nested objects. _MISSING if none."""
    if name in record:
        return record[name]
    value: Any = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def text_of(value: Any, name: str) -> str | Skip:
    """A field's value as text: strings as they are, numbers written out; null, empty or nested values skipped."""
    if type(value) is str and value and not value.isspace():
        return value  # the usual case, first
    if value is _MISSING:
        return Skip(f"missing '{name}'")
    if value is None:
        return Skip(f"null '{name}'")
    if isinstance(value, bool):
        value = json.dumps(value)  # true/false, as the file wrote them
    elif isinstance(value, (int, float)):
        value = str(value)
    elif not isinstance(value, str):
        return Skip(f"'{name}' is a {'list' if isinstance(value, list) else 'JSON object'}, not text")
    if not value.strip():
        return Skip(f"empty '{name}'")
    return value


def conversation_rows(turns: Any, name: str) -> Iterator[tuple[str, str] | Skip]:
    """One (prompt, response) row per assistant turn: its prompt is the conversation before it (module docstring)."""
    parsed = _turns(turns, name)
    if isinstance(parsed, Skip):
        yield parsed
        return
    system: list[str] = []
    context: list[tuple[str, str]] = []
    answered = False
    for role, text in parsed:
        if role == "system":
            system.append(text)
            continue
        if role == "assistant":
            answered = True
            if not context:
                yield Skip("an assistant turn with no turn before it")
            elif not text.strip():
                yield Skip("an empty assistant turn")
            else:
                yield "\n".join([*system, _context_text(context)]), text
        context.append((role, text))
    if not answered:
        yield Skip(f"no assistant turn in '{name}'")


def _context_text(context: list[tuple[str, str]]) -> str:
    if len(context) == 1:
        return context[0][1]
    return "\n".join(f"{role.capitalize()}: {text}" for role, text in context)


def _turns(turns: Any, name: str) -> list[tuple[str, str]] | Skip:
    """(role, text) of each turn, roles named as user/assistant/system; a Skip when the list is not turns."""
    if turns is _MISSING or turns is None:
        return Skip(f"missing '{name}'")
    if not isinstance(turns, list):
        return Skip(f"'{name}' is not a list of turns")
    parsed = []
    for turn in turns:
        role = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
        content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        if isinstance(content, list):  # content given in parts: [{"type": "text", "text": ...}, ...]
            content = "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
        if not isinstance(role, str) or not isinstance(content, str):
            return Skip(f"a turn of '{name}' without role and text content")
        parsed.append((_ROLES.get(role.lower(), role.lower()), content))
    return parsed


def suggest_flags(record: dict | str | None, columns: tuple[str, ...]) -> tuple[list[str], str]:
    """The convert flags for a file whose first record is `record`, to be trained on with `columns` (one text
    column, or prompt and response), and a sentence to add about the result (or "")."""
    if record is None:
        return [], ""
    if isinstance(record, str):
        return [], _text_note(columns)
    if len(columns) == 1:
        if not has_field(record, columns[0]):
            return ["--text_field=FIELD"], _fields_note(record, "the name of the field that holds the text")
        auto = _auto_layout(record)
        named = auto is not None and auto.kind == "text" and auto.prompt_fields == columns
        return ([] if named else [f"--text_field={columns[0]}"]), _text_note(columns)
    if tuple(columns) != PAIR_COLUMNS and all(has_field(record, name) for name in columns):
        return ([f"--prompt_field={columns[0]}", f"--response_field={columns[1]}"],
                (" It writes them as the columns 'prompt' and 'response', which train reads without "
                 "--prompt_column and --response_column."))
    auto = _auto_layout(record)
    if auto is None:
        return (["--prompt_field=FIELD", "--response_field=FIELD"],
                _fields_note(record, "the names of the fields that hold the prompt and the response"))
    return [], _text_note(columns) if auto.kind == "text" else ""


def _auto_layout(record: dict) -> RecordLayout | None:
    try:
        return choose_layout(record, FieldNames())
    except DataError:
        return None


def _text_note(columns: tuple[str, ...]) -> str:
    if tuple(columns) == TEXT_COLUMNS:
        return ""
    return " It writes one column of text, 'text': train on it with --text_column=text."


def _fields_note(record: dict, what: str) -> str:
    fields = ", ".join(map(str, record))
    return f" For FIELD, put {what} (its first record has: {fields})."
