"""Which fields of a record become which column: the layout a converted file takes, and the rows of one record.

A layout is chosen once per file, from its first record: the fields named on the command line, else the first of
these the record has: `prompt`/`response`; `text` (one column of text, for pretraining); `instruction`
(+ `input`)/`output` (Alpaca); `question`/`answer`; `query`/`response`; `prompt`/`completion`; `input`/`output`;
a conversation under `conversations` or `messages`. Records read from plain text are the text itself. A record
with two answers, `chosen` and `rejected` (or `response_j`/`response_k`, `response_chosen`/`response_rejected`), is
preference data, whatever else it holds: it gives one row of three columns, `prompt`, `chosen` and `rejected`.

A conversation (a list of turns `{"role"|"from": ..., "content"|"value": ...}`) gives one row per assistant turn,
whose prompt is the conversation before it: the system turns first, then the earlier turns. A first answer
after a single user turn gets that turn's text alone as its prompt, the same row a plain prompt/response file
gives; later answers get every earlier turn, each on its own line as `User: ...` / `Assistant: ...`, so that a
model learns to answer in context rather than from the last question alone.

Preference data comes in these layouts, told apart by the first record:
- text beside a prompt field (`prompt`, `instruction` + `input`, `question`, `query` or `input`): the fields as
  they are, a prompt given as a list of turns written as a conversation's prompt is;
- two lists of turns (TRL's conversational layout, UltraFeedback's), with or without a prompt field: the answers
  are the assistant turns that end each list, the prompt the turns the two lists share before them (or, when
  they share none, the prompt field);
- two texts of Human/Assistant turns and no prompt field (Anthropic's HH-RLHF): the prompt is everything up to
  the last `\\n\\nAssistant:` the two share, written as a conversation's prompt is; the answers are what follows.
The prompt is written the same way in each: one user turn as its text alone, more as `User: ...` lines.
"""

from __future__ import annotations

import json
import os
import re
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
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
# Preference data: the (chosen, rejected) fields looked for, in order, then the prompt fields beside them (joined by
# a line break); with no prompt field, the prompt is what the two answers share.
PREFERENCE_ANSWERS = (("chosen", "rejected"), ("response_j", "response_k"), ("response_chosen", "response_rejected"))
PREFERENCE_PROMPTS = (("prompt",), ("instruction", "input"), ("question",), ("query",), ("input",))
PREFERENCE_KINDS = ("preference", "preference_turns", "preference_dialogue")
_DIALOGUE_ANSWER = "\n\nAssistant:"  # where an answer starts in HH-RLHF's text
_DIALOGUE_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):")
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
    chosen: str | None = None
    rejected: str | None = None

    @property
    def given(self) -> bool:
        return any(name is not None for name in (self.prompt, self.response, self.text, self.chosen, self.rejected))


@dataclass(frozen=True)
class RecordLayout:
    """How the records of one file become rows.

    kind: "pairs" (prompt fields → prompt, the response field → response), "text" (one field → text),
    "conversation" (a list of turns → one row per assistant turn), "lines" (text records as they are), or one of
    PREFERENCE_KINDS (prompt and two answers → prompt, chosen, rejected; module docstring): "preference" (texts),
    "preference_turns" (lists of turns) or "preference_dialogue" (Human/Assistant texts). For preference data
    `response_field` holds the chosen answer and `rejected_field` the rejected one.
    """

    kind: str
    prompt_fields: tuple[str, ...] = ()
    response_field: str = ""
    rejected_field: str = ""

    @property
    def columns(self) -> tuple[str, ...]:
        if self.kind in PREFERENCE_KINDS:
            return PREFERENCE_COLUMNS
        return TEXT_COLUMNS if self.kind in ("text", "lines") else PAIR_COLUMNS

    def describe(self) -> str:
        """The mapping in words, for the summary."""
        if self.kind == "lines":
            return "text → text"
        if self.kind == "conversation":
            return f"'{self.response_field}' → prompt/response, one row per assistant turn"
        if self.kind in PREFERENCE_KINDS:
            return self._describe_preference()
        source = " + ".join(f"'{name}'" for name in self.prompt_fields)
        if self.kind == "text":
            return f"{source} → text"
        return f"{source} → prompt, '{self.response_field}' → response"

    def _describe_preference(self) -> str:
        chosen, rejected = self.response_field, self.rejected_field
        prompt = " + ".join(f"'{name}'" for name in self.prompt_fields)
        if self.kind == "preference":
            return f"{prompt} → prompt, '{chosen}' → chosen, '{rejected}' → rejected"
        if self.kind == "preference_dialogue":
            return (f"'{chosen}'/'{rejected}' Human/Assistant text: up to the last 'Assistant:' they share → prompt, "
                    "the rest → chosen/rejected")
        shared = f"the turns they share (else {prompt})" if prompt else "the turns they share"
        return f"'{chosen}'/'{rejected}' turns: {shared} → prompt, the last assistant turns → chosen/rejected"

    def rows(self, record: Any) -> Iterator[tuple[str, ...] | Skip]:
        """The rows of one record, and a Skip for each one left out."""
        if self.kind == "lines":
            yield (record,)
        elif self.kind == "conversation":
            yield from conversation_rows(field_value(record, self.response_field), self.response_field)
        elif self.kind in PREFERENCE_KINDS:
            yield self._preference(record)
        else:
            yield self._pair(record)

    def _pair(self, record: dict) -> tuple[str, ...] | Skip:
        prompt = self._prompt_text(record)
        if isinstance(prompt, Skip) or self.kind == "text":
            return prompt if isinstance(prompt, Skip) else (prompt,)
        response = text_of(field_value(record, self.response_field), self.response_field)
        return response if isinstance(response, Skip) else (prompt, response)

    def _prompt_text(self, record: dict) -> str | Skip:
        """The text of the prompt fields: the first, and each other one on its own line when it has text."""
        first, *extra = self.prompt_fields
        prompt = text_of(field_value(record, first), first)
        if isinstance(prompt, Skip):
            return prompt
        for name in extra:  # Alpaca's optional `input`: added on its own line when there is one
            more = field_value(record, name)
            if isinstance(more, str) and more.strip():
                prompt = f"{prompt}\n{more}"
        return prompt

    def _prompt_turns(self, record: dict) -> list[tuple[str, str]] | Skip:
        """The prompt fields as turns: a list of turns as it is, a text as one user turn."""
        value = field_value(record, self.prompt_fields[0])
        if isinstance(value, list):
            return _turns(value, self.prompt_fields[0])
        text = self._prompt_text(record)
        return text if isinstance(text, Skip) else [("user", text)]

    def _preference(self, record: dict) -> tuple[str, str, str] | Skip:
        names = (self.response_field, self.rejected_field)
        chosen, rejected = (field_value(record, name) for name in names)
        if self.kind == "preference_dialogue":
            return dialogue_preference(chosen, rejected, names)
        prompt = self._prompt_turns(record) if self.prompt_fields else []
        if isinstance(prompt, Skip):
            return prompt
        if self.kind == "preference_turns":
            return turns_preference(prompt, chosen, rejected, names)
        answers = _answer_texts(chosen, rejected, names)
        return answers if isinstance(answers, Skip) else (prompt_text(prompt), *answers)


def choose_layout(record: Any, names: FieldNames) -> RecordLayout:
    """The layout for a file whose first record is `record`: the named fields, or the first known one it has."""
    if isinstance(record, str):
        return RecordLayout("lines")
    if names.text is not None:
        return RecordLayout("text", (names.text,))
    preference = preference_layout(record, names)
    if preference is not None:
        return preference
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
        f"The first record has none of the fields convert looks for ({known}, text, a conversation under "
        f"{' or '.join(CONVERSATION_FIELDS)}, or preference data's chosen/rejected); its fields are: "
        f"{', '.join(map(str, record)) or 'none'}. Name the fields to read with --prompt_field=... "
        "--response_field=... (or --text_field=... for one column of text, --chosen_field=... --rejected_field=... "
        "for preference data)."
    )


def preference_layout(record: dict, names: FieldNames) -> RecordLayout | None:
    """The preference layout for a file whose first record is `record` (module docstring), or None when it is not
    preference data: no answer field named and no known pair of answers in it (or a response field named)."""
    answers = _answer_fields(record, names)
    if answers is None:
        return None
    prompt: tuple[str, ...] = (names.prompt,) if names.prompt is not None else next(
        (fields for fields in PREFERENCE_PROMPTS if has_field(record, fields[0])), ())
    chosen = field_value(record, answers[0])
    if isinstance(chosen, list):
        kind = "preference_turns"
    elif prompt:
        kind = "preference"
    elif isinstance(chosen, str) and _DIALOGUE_ANSWER in chosen:
        kind = "preference_dialogue"
    else:
        fields = ", ".join(fields[0] for fields in PREFERENCE_PROMPTS)
        raise DataError(
            f"The first record has the answers '{answers[0]}' and '{answers[1]}' but no prompt: no prompt field "
            f"({fields}), and its answers are neither lists of turns nor Human/Assistant text (\"\\n\\nHuman: ..."
            "\\n\\nAssistant: ...\") that carries the prompt. Name the field that holds the prompt with "
            "--prompt_field=... (a.b reaches into nested objects)."
        )
    return RecordLayout(kind, prompt, *answers)


def _answer_fields(record: dict, names: FieldNames) -> tuple[str, str] | None:
    """The (chosen, rejected) fields: those named (either one alone with the other's usual name), else the first
    known pair the record has, unless a response field was named (pairs, then)."""
    if names.chosen is not None or names.rejected is not None:
        return names.chosen or PREFERENCE_COLUMNS[1], names.rejected or PREFERENCE_COLUMNS[2]
    if names.response is not None:
        return None
    return next((pair for pair in PREFERENCE_ANSWERS if all(has_field(record, name) for name in pair)), None)


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
    asked = answered = False  # asked: a turn other than a system turn seen
    for index, (role, text) in enumerate(parsed):
        if role == "assistant":
            answered = True
            if not asked:
                yield Skip("an assistant turn with no turn before it")
            elif not text.strip():
                yield Skip("an empty assistant turn")
            else:
                yield prompt_text(parsed[:index]), text
        asked = asked or role != "system"
    if not answered:
        yield Skip(f"no assistant turn in '{name}'")


def prompt_text(turns: list[tuple[str, str]]) -> str:
    """The prompt the turns before an answer make: the system turns first, then a single other turn's text alone,
    or every other turn on its own line as `User: ...` / `Assistant: ...` (module docstring)."""
    system = [text for role, text in turns if role == "system"]
    context = [(role, text) for role, text in turns if role != "system"]
    if len(context) == 1:
        return "\n".join([*system, context[0][1]])
    return "\n".join([*system, *(f"{role.capitalize()}: {text}" for role, text in context)])


def turns_preference(prompt: list[tuple[str, str]], chosen: Any, rejected: Any,
                     names: tuple[str, str]) -> tuple[str, str, str] | Skip:
    """(prompt, chosen, rejected) of two lists of turns: the answers are the assistant turns that end each, the
    prompt the turns the two share before them, or `prompt` (the prompt field's turns) when they share none."""
    chosen_turns = _turns(chosen, names[0])
    if isinstance(chosen_turns, Skip):
        return chosen_turns
    rejected_turns = _turns(rejected, names[1])
    if isinstance(rejected_turns, Skip):
        return rejected_turns
    # A shared turn at most up to each list's last answer: identical answers stay answers, not part of the prompt.
    start = min(_shared_turns(chosen_turns, rejected_turns), _answer_start(chosen_turns), _answer_start(rejected_turns))
    answers = []
    for turns, name in ((chosen_turns, names[0]), (rejected_turns, names[1])):
        answer = turns[start:]
        if not answer:
            return Skip(f"no assistant turn at the end of '{name}'")
        if any(role != "assistant" for role, _ in answer):
            return Skip(f"'{names[0]}' and '{names[1]}' differ before their last assistant turns")
        text = "\n".join(text for _, text in answer)
        if not text.strip():
            return Skip(f"an empty answer in '{name}'")
        answers.append(text)
    context = chosen_turns[:start] or prompt
    if all(role == "system" for role, _ in context):
        return Skip(f"no prompt: '{names[0]}' and '{names[1]}' share no turn before their answers")
    return prompt_text(context), answers[0], answers[1]


def _shared_turns(first: list[tuple[str, str]], second: list[tuple[str, str]]) -> int:
    """How many turns the two lists start with alike."""
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    return shared


def _answer_start(turns: list[tuple[str, str]]) -> int:
    """Where the assistant turns that end the list start (its length when it does not end with one)."""
    start = len(turns)
    while start > 0 and turns[start - 1][0] == "assistant":
        start -= 1
    return start


def dialogue_preference(chosen: Any, rejected: Any, names: tuple[str, str]) -> tuple[str, str, str] | Skip:
    """(prompt, chosen, rejected) of two Human/Assistant texts (HH-RLHF): the prompt is what they share up to the
    last `\\n\\nAssistant:`, written as a conversation's prompt is; the answers are what follows it in each."""
    texts = _answer_texts(chosen, rejected, names)
    if isinstance(texts, Skip):
        return texts
    chosen_text, rejected_text = texts
    shared = len(os.path.commonprefix([chosen_text, rejected_text]))
    end = chosen_text.rfind(_DIALOGUE_ANSWER, 0, shared)
    if end < 0:
        return Skip(f"no 'Assistant:' turn shared by '{names[0]}' and '{names[1]}'")
    answers = [text[end + len(_DIALOGUE_ANSWER):].lstrip() for text in (chosen_text, rejected_text)]
    for answer, name in zip(answers, names):
        if not answer:
            return Skip(f"an empty answer in '{name}'")
    turns = _dialogue_turns(chosen_text[:end])
    if all(role == "system" for role, _ in turns):
        return Skip(f"no prompt: '{names[0]}' and '{names[1]}' share no turn before their answers")
    return prompt_text(turns), answers[0], answers[1]


def _answer_texts(chosen: Any, rejected: Any, names: tuple[str, str]) -> tuple[str, str] | Skip:
    """The two answers as text (`text_of`), or the Skip of the first that is not."""
    chosen_text = text_of(chosen, names[0])
    if isinstance(chosen_text, Skip):
        return chosen_text
    rejected_text = text_of(rejected, names[1])
    return rejected_text if isinstance(rejected_text, Skip) else (chosen_text, rejected_text)


def _dialogue_turns(text: str) -> list[tuple[str, str]]:
    """The turns of `\\n\\nHuman: ...\\n\\nAssistant: ...` text; any text before the first turn is a system turn."""
    before, *parts = _DIALOGUE_TURN.split(text)  # before, role, text, role, text, ...
    turns = [("system", before.strip())] if before.strip() else []
    return turns + [(_ROLES[role.lower()], body.strip()) for role, body in zip(parts[::2], parts[1::2])]


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
    if len(columns) >= len(PREFERENCE_COLUMNS):  # preference training: a prompt and two answers (data_columns)
        return _preference_flags(record, columns[:len(PREFERENCE_COLUMNS)])
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
    if auto.kind in PREFERENCE_KINDS:
        return [], (" Its records are preference data: it writes the columns 'prompt', 'chosen' and 'rejected', "
                    "which train reads with --objective=dpo.")
    return [], _text_note(columns) if auto.kind == "text" else ""


def _preference_flags(record: dict, columns: tuple[str, ...]) -> tuple[list[str], str]:
    """suggest_flags for preference training, whose columns are a prompt and two answers."""
    if tuple(columns) != PREFERENCE_COLUMNS and all(has_field(record, name) for name in columns):
        return ([f"--prompt_field={columns[0]}", f"--chosen_field={columns[1]}", f"--rejected_field={columns[2]}"],
                (" It writes them as the columns 'prompt', 'chosen' and 'rejected', which train reads without "
                 "--prompt_column, --chosen_column and --rejected_column."))
    auto = _auto_layout(record)
    if auto is not None and auto.kind in PREFERENCE_KINDS:
        return [], ""
    return (["--prompt_field=FIELD", "--chosen_field=FIELD", "--rejected_field=FIELD"],
            _fields_note(record, "the names of the fields that hold the prompt, the chosen and the rejected answer"))


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
