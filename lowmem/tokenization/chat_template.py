"""A model's chat template, rendered as transformers renders it, and the constant text a row is laid out from.

A chat template is code from the model folder, so it is rendered in jinja2's sandbox, with the settings, globals
and variables transformers gives it (`transformers.utils.chat_template_utils`). A model folder without one gets
`PLAIN_CHAT_TEMPLATE`, lowmem's plain layout written as a Jinja template, so that an export can write it into
tokenizer_config.json and transformers users get the same layout.

Rendering is slow next to encoding, so it is done once at load, with sentinel strings in place of the prompt and
the response: the constant text around them (`_ChatPieces`) lays out every row by concatenation. Probe texts check
at load that the composition equals a real rendering; a template that changes the content otherwise than by
trimming it (or whose conversation does not start with its generation prompt) is rendered per row instead.
`ChatTemplate.texts` gives a row's two texts either way: the generation prompt, and the response part that follows
it in the full conversation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from lowmem.errors import ConfigError

logger = logging.getLogger(__name__)

# The start of lowmem's own chat templates: one user message, optionally followed by one assistant message, and
# anything else refused rather than laid out in a way the model never saw.
SINGLE_EXCHANGE_ONLY = (
    "{%- if not (messages | length in [1, 2] and messages[0]['role'] == 'user' and messages[0]['content'] is string"
    " and (messages | length == 1 or (messages[1]['role'] == 'assistant' and messages[1]['content'] is string)))"
    " -%}\n"
    "{{- raise_exception('This model was trained on single exchanges: pass one user message, optionally followed"
    " by one assistant message (no system message, no further turns; the content a string).') -}}\n"
    "{%- endif -%}\n"
)

# lowmem's layout for a tokenizer without a chat template: `[bos] prompt \n` for the user's turn (the generation
# prompt: add_generation_prompt has nothing to add), `response [eos]` for the assistant's. Like lowmem's own
# CHAT_TEMPLATE (lowmem.hf.tokenizer_files), it takes single exchanges only.
PLAIN_CHAT_TEMPLATE = (
    SINGLE_EXCHANGE_ONLY
    + "{%- if bos_token is defined and bos_token -%}{{- bos_token -}}{%- endif -%}\n"
    "{{- messages[0]['content'] + '\\n' -}}\n"
    "{%- if messages | length == 2 -%}{{- messages[1]['content'] + eos_token -}}{%- endif -%}"
)

# Stand-ins for the prompt and the response while the template is rendered at load. Private-use characters keep
# them apart from anything a template writes; a template that changes them (upper-cases them, say) is found out
# because they are then missing from the rendering.
_PROMPT_SENTINEL = "\ue000lowmem prompt\ue001"
_RESPONSE_SENTINEL = "\ue000lowmem response\ue001"
# (prompt, response) pairs whose real rendering must equal the one composed from the pieces: spaces and newlines
# at either end (which `trim` or `strip` would remove), text that looks like template code, and the reasoning tags
# some templates cut the response at.
_PROBES = (
    (" leading and trailing spaces ", "\nnewlines around the answer\n"),
    ("two lines\nthe second ends with a tab\t", "  indented answer"),
    ("中文提示，末尾两个换行\n\n", "回答 with a trailing space "),
    ("{{ braces }} {% if x %} <think>a thought</think> after", "</think>\n\nafter a closing think tag"),
)

# The sandbox of jinja2 before 3.1.6 has known escapes; transformers refuses to render chat templates with it.
_SAFE_JINJA = (3, 1, 6)


# --------------------------------------------------------------------------------------------
# The sandbox transformers renders chat templates in
# --------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text with it to build its
    assistant-token mask; rendered here as its body alone, so templates that use it compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the tag's name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so a template cannot store attributes that reach Python's
    internals (transformers guards its namespace the same way)."""

    # Namespace answers every attribute lookup from its own entries: the check is called on the class. Its
    # signature is Namespace's, so that `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set '{name}' on a namespace")


class _TemplateDict:
    """`dict()` and `dict.fromkeys()` for templates, without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the JSON text as it is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment chat templates are written for: transformers' settings, globals and filters."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


def _version_tuple(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits) if digits else 0)
    return tuple(numbers)


# Errors a template's code can raise while rendering: its own raise_exception, undefined names, bad operations.
_RENDER_ERRORS = (jinja2.exceptions.TemplateError, ArithmeticError, LookupError, TypeError, ValueError)


# --------------------------------------------------------------------------------------------
# The pieces a row is composed from, and the template
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChatPieces:
    """The constant text of the chat template around one user message and one assistant message:

        prompt text:    prefix + prompt + generation_suffix              (the generation prompt)
        response part:  response_lead + response + turn_end              (what follows it in the full conversation)

    with prompt and response stripped of surrounding whitespace first where the template trims them.
    """

    prefix: str
    generation_suffix: str
    response_lead: str
    turn_end: str
    strip_prompt: bool = False
    strip_response: bool = False

    def prompt_text(self, prompt: str) -> str:
        return self.prefix + (prompt.strip() if self.strip_prompt else prompt) + self.generation_suffix

    def response_text(self, response: str) -> str:
        return self.response_lead + (response.strip() if self.strip_response else response) + self.turn_end


def _shared_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _user(prompt: str) -> dict[str, str]:
    return {"role": "user", "content": prompt}


def _assistant(response: str) -> dict[str, str]:
    return {"role": "assistant", "content": response}


class ChatTemplate:
    """A chat template compiled in jinja2's sandbox, with the constant pieces of a row found at load.

    `render` renders any conversation, as transformers' `apply_chat_template(..., tokenize=False)` does. `texts`
    lays out one exchange (a user message, the prompt, then an assistant message, the response): composed from the
    pieces where the probes showed that equals a real rendering, rendered otherwise (`rendered_per_row`).
    """

    def __init__(self, text: str, tokens: Mapping[str, str], source: str, from_source: bool,
                 location: str | None = None) -> None:
        """Compile the template and find its pieces.

        Args:
            text: the template's Jinja code: the model's, or `PLAIN_CHAT_TEMPLATE`.
            tokens: the special tokens the template sees, by name (bos_token, eos_token, image_token, ...).
            source: where the model's files came from (the folder), for messages.
            from_source: whether the template is the model's (False: lowmem's `PLAIN_CHAT_TEMPLATE`).
            location: the file the template came from, quoted, for messages; default the source.

        Raises:
            ConfigError: jinja2 older than 3.1.6 with a model's template, a template that is not valid Jinja, or
                one that fails on a one-exchange conversation.
        """
        self._text = text
        self._tokens = dict(tokens)
        self.source = source
        self._from_source = from_source
        self._location = location if location is not None else f"'{source}'"
        self._compiled = self._compile()
        self._pieces, self._turn_end = self._find_pieces()

    @property
    def text(self) -> str:
        """The template's Jinja code."""
        return self._text

    @property
    def from_source(self) -> bool:
        """Whether the template is the model's own (False: lowmem's `PLAIN_CHAT_TEMPLATE`)."""
        return self._from_source

    @property
    def rendered_per_row(self) -> bool:
        """Whether every row is rendered for real: the template transforms the content otherwise than by trimming
        it, or its conversation does not start with its generation prompt."""
        return self._pieces is None

    @property
    def turn_end(self) -> str | None:
        """The text the template writes right after the assistant's response (ChatML's "<|im_end|>\\n"), or None
        where the response does not show unchanged in the rendering."""
        return self._turn_end

    def _compile(self) -> jinja2.Template:
        where = self._location if self._from_source else "PLAIN_CHAT_TEMPLATE"
        if self._from_source and _version_tuple(jinja2.__version__) < _SAFE_JINJA:
            raise ConfigError(
                f"jinja2 {jinja2.__version__} has known sandbox escapes, and the chat template in {where} is code "
                "from the model folder: upgrade it (pip install -U \"jinja2>=3.1.6\").")
        try:
            return _template_environment().from_string(self._text)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ConfigError(f"The chat template in {where} is not valid Jinja (line {exc.lineno}: {exc.message}): "
                              "fix it, or copy the file again from the model.") from exc

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template rendered with `messages` (dicts with "role" and "content"), as text: what
        `apply_chat_template(messages, tokenize=False)` returns in transformers.

        Raises:
            ConfigError: the template refused the conversation (its raise_exception) or failed on it.
        """
        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._tokens)
        except _RENDER_ERRORS as exc:
            where = "the chat template of " + self.source if self._from_source else "PLAIN_CHAT_TEMPLATE"
            roles = ", ".join(str(m.get("role")) for m in messages if isinstance(m, dict))
            raise ConfigError(
                f"{where} failed on a conversation ({roles}): {str(exc).rstrip('.')}. Each row is laid "
                "out as one user message, then one assistant message: the template must accept that conversation; "
                "fix the chat template (chat_template.jinja or tokenizer_config.json) if it should.") from exc

    def _find_pieces(self) -> tuple[_ChatPieces | None, str | None]:
        """The template's constant pieces (None: render per row) and the text that ends the assistant's turn."""
        generation = self.render([_user(_PROMPT_SENTINEL)], add_generation_prompt=True)
        full = self.render([_user(_PROMPT_SENTINEL), _assistant(_RESPONSE_SENTINEL)])
        turn_end = full.rsplit(_RESPONSE_SENTINEL, 1)[1] if _RESPONSE_SENTINEL in full else None
        if generation.count(_PROMPT_SENTINEL) != 1 or full.count(_PROMPT_SENTINEL) != 1 or turn_end is None \
                or full.count(_RESPONSE_SENTINEL) != 1:
            logger.info("The chat template of %s changes or repeats the message content: it is rendered per row.",
                        self.source)
            return None, turn_end
        prefix, generation_suffix = generation.split(_PROMPT_SENTINEL)
        full_prefix, rest = full.split(_PROMPT_SENTINEL)
        middle = rest.split(_RESPONSE_SENTINEL)[0]
        if full_prefix != prefix or not middle.startswith(generation_suffix):
            logger.warning("The chat template of %s does not start a conversation with an answer by its generation "
                           "prompt: rows are rendered per row, and the answer follows the generation prompt from "
                           "where the two renderings part.", self.source)
            return None, turn_end
        base = _ChatPieces(prefix, generation_suffix, middle[len(generation_suffix):], turn_end)
        pieces = self._check_pieces(base)
        if pieces is None:
            logger.info("The chat template of %s transforms the message content: it is rendered per row.",
                        self.source)
        return pieces, turn_end

    def _check_pieces(self, base: _ChatPieces) -> _ChatPieces | None:
        """`base` with the content transform that makes every probe's composition equal its real rendering, or
        None. Llama 2 and 3 templates trim the content; any other transform is left to rendering per row."""
        rendered = []
        for prompt, response in _PROBES:
            try:
                rendered.append((prompt, response, self.render([_user(prompt)], add_generation_prompt=True),
                                 self.render([_user(prompt), _assistant(response)])))
            except ConfigError:  # a template that refuses some content: per row, where the refusal is reported
                return None
        for strip_prompt, strip_response in ((False, False), (True, True), (True, False), (False, True)):
            pieces = replace(base, strip_prompt=strip_prompt, strip_response=strip_response)
            if all(generation == pieces.prompt_text(prompt)
                   and full == pieces.prompt_text(prompt) + pieces.response_text(response)
                   for prompt, response, generation, full in rendered):
                return pieces
        return None

    def texts(self, prompt: str, response: str | None) -> tuple[str, str | None]:
        """The texts of one exchange: the generation prompt's (the user message rendered with
        add_generation_prompt), and the response part, what follows it in the full conversation (None without a
        response)."""
        pieces = self._pieces
        # Empty content is rendered for real: the probes do not show how a template treats it.
        if pieces is not None and prompt and response != "":
            return pieces.prompt_text(prompt), None if response is None else pieces.response_text(response)
        generation = self.render([_user(prompt)], add_generation_prompt=True)
        if response is None:
            return generation, None
        full = self.render([_user(prompt), _assistant(response)])
        return generation, full[_shared_prefix_length(generation, full):]
