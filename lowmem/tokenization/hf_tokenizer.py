"""The tokenizer of a transformers model folder (Llama, Qwen2, Mistral, ...): its tokenizer.json read through the
`tokenizers` library, with the model's own special tokens and chat template.

`HFTokenizer` has the interface of `sentencepiece_tokenizer.Tokenizer` (encode, decode, the pair and text layouts, the
special ids), so the collate function, validation, generation and the trainer take either. The layouts are
the model's instead of lowmem's fixed ones:

    chat row      the chat template rendered with one user message (the prompt) and one assistant message (the
                  response): the prompt ids are what `AutoTokenizer.apply_chat_template(..., add_generation_prompt=
                  True)` gives a transformers user, so a fine-tuned model is asked exactly as it was trained
    no template   `PLAIN_CHAT_TEMPLATE` (lowmem.tokenization.chat_template): [bos] prompt "\\n" response [eos]
    one column    [bos] text [eos], bos only where the tokenizer puts one before a text

The files read (`HF_TOKENIZER_FILES`): tokenizer.json (required: the vocabulary, merges, normalizer, pre-tokenizer,
decoder and added tokens), tokenizer_config.json (the special tokens, the chat template, add_bos_token),
chat_template.jinja (where transformers 5 writes the template), special_tokens_map.json (older folders' special
tokens) and generation_config.json (the ids that end an answer). transformers is never imported: a run needs only
`tokenizers` and jinja2.

The chat template is rendered as transformers renders it, in jinja2's sandbox, by `lowmem.tokenization.chat_template`,
which also finds at load the constant text around the prompt and the response, so that most rows are laid out by
concatenation and one batch encode instead of a rendering each.

A row's ids are `encode(prompt text) + encode(response part)`: encoded apart, so that the prompt's ids are those
of generation whatever the response. Where the tokenizer puts "▁" before every text it encodes (SentencePiece
style), the response part is encoded as the continuation it is in the full conversation instead: after a newline
whose ids are then dropped, the way transformers encodes a piece in the middle of a chat.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# PLAIN_CHAT_TEMPLATE is imported from here too (by code written before the chat template had its own module).
from lowmem.tokenization.chat_template import PLAIN_CHAT_TEMPLATE, ChatTemplate
from lowmem.tokenization.sentencepiece_tokenizer import available_cpus
from lowmem.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
# The tokenizer files of a transformers model folder, weights left out: what a run copies into its own folder.
HF_TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE, SPECIAL_TOKENS_MAP, GENERATION_CONFIG)

# The named special tokens transformers passes to a chat template, when set (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Texts that show whether the tokenizer adds something (SentencePiece's "▁") at the start of every text it encodes.
_START_PROBES = ("a", "Hello", "你好", "1")


def read_hf_tokenizer_files(folder: str | Path) -> dict[str, bytes]:
    """The tokenizer files of a transformers model folder, by name, as bytes: those of `HF_TOKENIZER_FILES` present
    (no weights), for a caller to copy into a run folder or to pass to `HFTokenizer`.

    Raises:
        ConfigError: the folder does not exist, or has no tokenizer.json (the message says how to write one).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"The tokenizer folder '{folder}' does not exist: give the folder of a transformers model "
                          "(the one holding its tokenizer.json).")
    if not (folder / TOKENIZER_JSON).is_file():
        raise _missing_tokenizer_json(folder)
    return {name: (folder / name).read_bytes() for name in HF_TOKENIZER_FILES if (folder / name).is_file()}


def _missing_tokenizer_json(folder: Path) -> ConfigError:
    """The error for a folder without tokenizer.json, naming what the folder holds instead."""
    if (folder / "tokenizer.model").is_file() and _is_lowmem_tokenizer(folder):
        return ConfigError(
            f"'{folder}' holds a SentencePiece tokenizer trained by lowmem (tokenizer.model), not a transformers "
            "model's tokenizer: give it as the run's tokenizer_dir, which lowmem's own Tokenizer reads.")
    held = [name for name in ("tokenizer.model", "vocab.json", "merges.txt") if (folder / name).is_file()]
    instead = f", and does not read {' or '.join(held)}" if held else ""
    return ConfigError(
        f"'{folder}' has no tokenizer.json. lowmem reads a transformers model's tokenizer from that file, through "
        f"the `tokenizers` library and without transformers{instead}. Write it once, in an environment with "
        f"transformers: `AutoTokenizer.from_pretrained('{folder}').save_pretrained('{folder}')` converts the "
        "tokenizer the folder holds and saves tokenizer.json beside it (with tokenizer_config.json and the chat "
        "template).")


def _is_lowmem_tokenizer(folder: Path) -> bool:
    """Whether the folder's tokenizer.model is one lowmem trained (its fixed special ids)."""
    from lowmem.tokenization.sentencepiece_tokenizer import Tokenizer

    try:
        Tokenizer.load(folder, num_threads=1)
    except ConfigError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Forked DataLoader workers
# --------------------------------------------------------------------------------------------


class _ForkGuard:
    """Keeps the `tokenizers` library's thread pool out of forked children, without its warning.

    `encode_batch` runs on the library's thread pool. Its threads do not survive a fork, so in a child (a DataLoader
    worker) the library turns parallelism off; older releases also print "The current process just got forked,
    after parallelism has already been used..." to stderr in every worker, unless TOKENIZERS_PARALLELISM is set.
    Setting it for the whole process would also slow the parent's own batches, so it is set only around a fork
    that follows a parallel batch: "false" just before the fork, which the child inherits (sequential, no warning,
    the same outcome the library picks), and removed again in the parent right after. A value the user set is
    never touched. Workers meant to run one thread each are given num_threads=1, which never uses the pool.
    """

    def __init__(self) -> None:
        self.pool_used = False
        self._set_for_fork = False

    # The variable's name is written out on every line that reads or sets the environment, not kept in a
    # constant: the architecture test finds the variables the package reads by the literal on such lines.
    def before_fork(self) -> None:
        self._set_for_fork = self.pool_used and "TOKENIZERS_PARALLELISM" not in os.environ
        if self._set_for_fork:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"

    def after_fork_in_parent(self) -> None:
        if self._set_for_fork:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
            self._set_for_fork = False


_fork_guard = _ForkGuard()
if hasattr(os, "register_at_fork"):  # POSIX; elsewhere workers are spawned, not forked
    os.register_at_fork(before=_fork_guard.before_fork, after_in_parent=_fork_guard.after_fork_in_parent)


# --------------------------------------------------------------------------------------------
# Reading the files
# --------------------------------------------------------------------------------------------


def _json_object(files: Mapping[str, bytes], name: str, source: str) -> dict[str, Any]:
    """The JSON object in file `name`, or {} when the file is absent."""
    if name not in files:
        return {}
    try:
        value = json.loads(files[name].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{_file_name(source, name)} is not valid JSON ({exc}): copy it again from the "
                          "model.") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{_file_name(source, name)} holds a JSON {type(value).__name__}, not an object: copy it "
                          "again from the model.")
    return value


def _file_name(source: str, name: str) -> str:
    return f"'{Path(source) / name}'" if source != "<memory>" else f"'{name}'"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken as a dict with "content"."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    return None


def _token_list(value: Any) -> list[str]:
    """The tokens of a list of special tokens (extra_special_tokens, additional_special_tokens)."""
    if not isinstance(value, list):
        return []
    return [text for text in map(_token_text, value) if text is not None]


def _generation_ids(value: Any) -> list[int]:
    """generation_config.json's eos_token_id (or another id): an int, a list of them, or absent."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _read_backend(files: Mapping[str, bytes], source: str) -> BackendTokenizer:
    try:
        import tokenizers
    except ImportError as exc:
        raise ConfigError("Reading a transformers model's tokenizer needs the `tokenizers` library: "
                          "pip install tokenizers (transformers installs it too).") from exc
    try:
        backend = tokenizers.Tokenizer.from_str(files[TOKENIZER_JSON].decode("utf-8"))
    except Exception as exc:  # the library raises plain Exception for every malformed file
        raise ConfigError(
            f"{_file_name(source, TOKENIZER_JSON)} could not be read by the tokenizers library "
            f"{tokenizers.__version__} ({exc}). The file is damaged or cut short, or was written by a newer "
            "library: copy it again from the model, or upgrade tokenizers.") from exc
    # Padding or truncation saved in the file would pad and cut every batch this class encodes; transformers
    # turns them on per call instead.
    backend.no_padding()
    backend.no_truncation()
    return backend


def _template_of(files: Mapping[str, bytes], config: Mapping[str, Any], source: str) -> tuple[str | None, str]:
    """The model's chat template and the file it came from; chat_template.jinja wins, as in transformers 5."""
    if CHAT_TEMPLATE_FILE in files:
        try:
            text = files[CHAT_TEMPLATE_FILE].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{_file_name(source, CHAT_TEMPLATE_FILE)} is not UTF-8 text: copy it again from "
                              "the model.") from exc
        return (text or None), CHAT_TEMPLATE_FILE
    value = config.get("chat_template")
    if isinstance(value, list):  # several named templates: the default one is the chat template
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return (value if isinstance(value, str) and value else None), TOKENIZER_CONFIG


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


class HFTokenizer:
    """A transformers model's tokenizer (tokenizer.json), with the interface of `sentencepiece_tokenizer.Tokenizer`.

    Picklable (it is sent to DataLoader worker processes): the pickle carries the tokenizer files' bytes, so
    workers need no file access, and each unpickled copy renders the template's pieces again.
    """

    def __init__(self, files: Mapping[str, bytes], num_threads: int | None = None, source: str = "<memory>") -> None:
        """Build from the tokenizer files of a model folder (`HFTokenizer.load` reads them from disk).

        Args:
            files: file name -> bytes, as `read_hf_tokenizer_files` returns them; tokenizer.json is required.
            num_threads: 1 encodes batches on the calling thread alone (DataLoader workers, as many as the cores);
                any other value uses the library's thread pool, which spans every core (or RAYON_NUM_THREADS);
                default all available cores.
            source: where the files came from (the folder), for messages.
        """
        if TOKENIZER_JSON not in files:
            raise ConfigError(f"No tokenizer.json among the tokenizer files of {source}: it is the file a "
                              "transformers model's tokenizer is read from.")
        self._files = dict(files)
        self.source = source
        self.num_threads = num_threads if num_threads is not None else available_cpus()
        self._backend = _read_backend(files, source)
        config = _json_object(files, TOKENIZER_CONFIG, source)
        special_map = _json_object(files, SPECIAL_TOKENS_MAP, source)
        generation = _json_object(files, GENERATION_CONFIG, source)
        # Special tokens inside a text are matched as tokens (what transformers does unless split_special_tokens).
        self._backend.encode_special_tokens = config.get("split_special_tokens") is True

        self._template_tokens = self._special_token_texts(config, special_map)
        self._add_missing_special_tokens(config, special_map)
        self._vocab_size = max(self._backend.get_vocab(with_added_tokens=True).values()) + 1
        self._added_ids = frozenset(self._backend.get_added_tokens_decoder())

        self._bos_id = self._special_id("bos_token", config, special_map, generation.get("bos_token_id"))
        eos_id = self._special_id("eos_token", config, special_map, generation.get("eos_token_id"))
        if eos_id is None:
            raise ConfigError(f"The tokenizer of {source} has no eos token (eos_token in tokenizer_config.json, or "
                              "eos_token_id in generation_config.json): lowmem ends every row with it. Set it there.")
        self._eos_id: int = eos_id
        self._unk_id = self._special_id("unk_token", config, special_map, None)
        if self._unk_id is None:
            self._unk_id = self._id_of(getattr(self._backend.model, "unk_token", None))
        # Llama 2 and 3 have no pad token: any id does, as the loss never counts padding; unk, else eos.
        pad_id = self._special_id("pad_token", config, special_map, generation.get("pad_token_id"))
        self._pad_id: int = next(i for i in (pad_id, self._unk_id, self._eos_id) if i is not None)
        self._text_bos = self._bos_id if self._bos_id is not None and self._adds_bos(config) else None

        template, template_file = _template_of(files, config, source)
        self._template = ChatTemplate(template if template is not None else PLAIN_CHAT_TEMPLATE,
                                      self._template_tokens, source, from_source=template is not None,
                                      location=_file_name(source, template_file))
        self._newline_ids = self.encode("\n")
        self._continuation_trick = self._adds_text_start()
        self._stop_ids = self._find_stop_ids(generation, self._template.turn_end)

    @classmethod
    def load(cls, folder: str | Path, num_threads: int | None = None) -> HFTokenizer:
        """Read the tokenizer of a transformers model folder (tokenizer.json and the files beside it).

        Args:
            folder: the model folder (or the path of its tokenizer.json).
            num_threads: see `HFTokenizer.__init__`.

        Raises:
            ConfigError: no tokenizer.json (the message says how to write one), a file that cannot be read, a
                chat template that fails on a one-exchange conversation.
        """
        folder = Path(folder)
        if folder.name == TOKENIZER_JSON and folder.is_file():
            folder = folder.parent
        return cls(read_hf_tokenizer_files(folder), num_threads=num_threads, source=str(folder))

    # Pickling: the compiled template holds code objects, so carry the files and build again.
    def __getstate__(self) -> dict[str, Any]:
        return {"files": self._files, "num_threads": self.num_threads, "source": self.source}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["files"], num_threads=state["num_threads"], source=state["source"])

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"bos_id={self.bos_id}, pad_id={self.pad_id})")

    # ---- special tokens ----

    def _special_token_texts(self, config: Mapping[str, Any], special_map: Mapping[str, Any]) -> dict[str, str]:
        """The special tokens a chat template sees, by name: the named ones set in tokenizer_config.json (else in
        special_tokens_map.json), and the model-specific ones tokenizer_config.json names in a dict."""
        texts = {}
        for name in NAMED_SPECIAL_TOKENS:
            text = _token_text(config[name] if name in config else special_map.get(name))
            if text is not None:
                texts[name] = text
        extra = config.get("extra_special_tokens")
        if isinstance(extra, dict):  # e.g. {"image_token": "<image>"}: transformers makes them named tokens
            for name, value in extra.items():
                text = _token_text(value)
                if isinstance(name, str) and text is not None:
                    texts.setdefault(name, text)
        return texts

    def _add_missing_special_tokens(self, config: Mapping[str, Any], special_map: Mapping[str, Any]) -> None:
        """Add the configured special tokens that tokenizer.json lacks, as transformers does when it loads them,
        so that both give them the same ids (appended after the vocabulary)."""
        from tokenizers import AddedToken

        wanted = list(self._template_tokens.values())
        for key in ("extra_special_tokens", "additional_special_tokens"):
            wanted += _token_list(config.get(key)) + _token_list(special_map.get(key))
        missing = [token for token in dict.fromkeys(wanted) if self._backend.token_to_id(token) is None]
        if missing:
            logger.info("Adding %d special tokens that %s names but its tokenizer.json lacks: %s", len(missing),
                        self.source, " ".join(missing))
            self._backend.add_special_tokens([AddedToken(token, special=True) for token in missing])

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _special_id(self, name: str, config: Mapping[str, Any], special_map: Mapping[str, Any],
                    generation_value: Any) -> int | None:
        """A special token's id: tokenizer_config.json's, else generation_config.json's (the first of a list), else
        special_tokens_map.json's. A key set to null in tokenizer_config.json means none (Qwen2's bos): the
        generation config's bos_token_id is not taken in its place."""
        if name in config:
            return self._id_of(_token_text(config[name]))
        ids = [i for i in _generation_ids(generation_value) if i < self._vocab_size]
        if ids:
            return ids[0]
        return self._id_of(_token_text(special_map.get(name)))

    def _adds_bos(self, config: Mapping[str, Any]) -> bool:
        """Whether a text starts with bos: tokenizer_config.json's add_bos_token, else what the post-processor of
        tokenizer.json does (Llama 3's adds it; GPT-2's bos is its eos and is not put first)."""
        flag = config.get("add_bos_token")
        if isinstance(flag, bool):
            return flag
        return self._backend.encode("a", add_special_tokens=True).ids[:1] == [self._bos_id]

    def _find_stop_ids(self, generation: Mapping[str, Any], turn_end: str | None) -> tuple[int, ...]:
        """Every id that ends an answer: generation_config.json's eos ids, the tokenizer's eos, and the added token
        that the chat template writes right after the response (ChatML's <|im_end|>, Llama 3's <|eot_id|>)."""
        ids = [i for i in _generation_ids(generation.get("eos_token_id")) if i < self._vocab_size]
        ids.append(self._eos_id)
        if turn_end and turn_end.strip():
            first = self.encode(turn_end.lstrip())[:1]  # Llama 2 writes " </s>": the space is not the end
            if first and first[0] in self._added_ids:
                ids.append(first[0])
        return tuple(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce: the highest id (added tokens included) + 1. A model's embedding
        may have more rows; `decode` skips ids past this."""
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        """Padding id: the pad token if the tokenizer has one, else unk, else eos (the loss never counts padding)."""
        return self._pad_id

    @property
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, or None (Qwen2 has none)."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """End-of-sequence id: what ends a text row, and the tokenizer's end of an answer."""
        return self._eos_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends an answer (generation stops at the first): eos, generation_config.json's eos ids and
        the token that ends the assistant's turn in the chat template."""
        return self._stop_ids

    @property
    def unk_id(self) -> int | None:
        """Unknown-token id, or None (byte-level tokenizers have none)."""
        return self._unk_id

    @property
    def chat_template(self) -> str:
        """The chat template in use: the model's, or `PLAIN_CHAT_TEMPLATE` when it has none."""
        return self._template.text

    @property
    def template_from_source(self) -> bool:
        """Whether the chat template is the model's own (False: `PLAIN_CHAT_TEMPLATE`)."""
        return self._template.from_source

    def describe(self) -> str:
        """One line for the log: what the tokenizer is and which special tokens it uses."""
        token = self._backend.id_to_token
        if not self.template_from_source:
            layout = "lowmem's plain chat layout (no chat template in the source)"
        elif self._template.rendered_per_row:
            layout = "chat template from the source, rendered per row"
        else:
            layout = "chat template from the source"
        parts = [TOKENIZER_JSON, f"{self.vocab_size:,} ids", layout, f"eos {token(self.eos_id)}",
                 f"pad {token(self.pad_id)}", "no bos" if self.bos_id is None else f"bos {token(self.bos_id)}"]
        if self.stop_ids != (self.eos_id,):
            parts.append("stops at " + " ".join(str(token(i)) for i in self.stop_ids))
        return ", ".join(parts)

    # ---- encoding and decoding ----

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, nothing added around it; special-token strings in it are matched as those tokens."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text: one call into the library, on its thread pool unless num_threads is 1."""
        texts = list(texts)
        if not texts:
            return []
        if self.num_threads == 1:
            # On this thread: a loop of `encode` costs about what the library's sequential batch does, and
            # leaves the thread pool (and the process-wide TOKENIZERS_PARALLELISM) alone.
            return [self.encode(text) for text in texts]
        _fork_guard.pool_used = True
        return [encoding.ids for encoding in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (a list, numpy array or torch tensor), special tokens left out. Ids the tokenizer cannot
        produce (a model's padding rows past `vocab_size`, negative fill values) are skipped."""
        if hasattr(ids, "tolist"):  # numpy arrays and torch tensors
            ids = ids.tolist()
        kept = [int(i) for i in ids if 0 <= i < self._vocab_size]
        return self._backend.decode(kept, skip_special_tokens=True)

    def _adds_text_start(self) -> bool:
        """Whether encoding a text adds something at its start (SentencePiece-style "▁"), which a response encoded
        apart from its prompt must not get: in the full conversation it continues the prompt's text."""
        return any(self.encode(text) != self._continuation(text) for text in _START_PROBES)

    def _continuation(self, text: str) -> list[int]:
        """Ids of `text` as it is encoded after other text: encoded after a newline, whose ids are then removed
        (the way transformers encodes a piece in the middle of a chat); plainly where the newline merged."""
        ids = self.encode("\n" + text)
        n = len(self._newline_ids)
        return ids[n:] if ids[:n] == self._newline_ids else self.encode(text)

    def _continuation_batch(self, texts: list[str]) -> list[list[int]]:
        if not self._continuation_trick:
            return self.encode_batch(texts)
        n = len(self._newline_ids)
        marked = self.encode_batch(["\n" + text for text in texts])
        return [ids[n:] if ids[:n] == self._newline_ids else self.encode(text) for text, ids in zip(texts, marked)]

    # ---- the chat layout ----

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The chat template rendered with `messages` (dicts with "role" and "content"), as text: what
        `apply_chat_template(messages, tokenize=False)` returns in transformers (see `ChatTemplate.render`).

        Raises:
            ConfigError: the template refused the conversation (its raise_exception) or failed on it.
        """
        return self._template.render(messages, add_generation_prompt=add_generation_prompt)

    def encode_pair(self, prompt: str, response: str | None) -> tuple[list[int], int]:
        """The chat layout of one exchange and where the response starts.

        Returns `(ids, start)`: `ids[:start]` are the ids of the generation prompt, equal to transformers'
        `apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)`, and
        `ids[start:]` the response and what ends its turn (ChatML's `<|im_end|>\\n`; eos in the plain layout),
        encoded apart so that the prompt's ids stay those of generation. With `response` None the ids are the
        generation prompt and `start == len(ids)`.
        """
        return self.encode_pair_batch([prompt], [response])[0]

    def encode_pair_batch(self, prompts: Sequence[str], responses: Sequence[str | None]) -> list[tuple[list[int], int]]:
        """`encode_pair` over a batch: the texts laid out by concatenation, then encoded by two batch calls."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        texts = [self._template.texts(prompt, response) for prompt, response in zip(prompts, responses)]
        prompt_ids = self.encode_batch([prompt_text for prompt_text, _ in texts])
        response_ids = iter(self._continuation_batch([part for _, part in texts if part is not None]))
        rows = []
        for ids, (_, part) in zip(prompt_ids, texts):
            start = len(ids)
            rows.append((ids + next(response_ids) if part is not None else ids, start))
        return rows

    # ---- the text layout ----

    def encode_text(self, text: str, finished: bool = True) -> tuple[list[int], int]:
        """The layout of one column of text, `[bos] text [eos]`, and where the counted targets start.

        Returns `(ids, start)` with start 1 after a bos, 0 where the tokenizer puts none before a text (Qwen2). With
        `finished` False the layout is `[bos] text`, a beginning for the model to continue.
        """
        return self._text_layout(self.encode(text), finished)

    def encode_text_batch(self, texts: Sequence[str]) -> list[tuple[list[int], int]]:
        """`encode_text` over a batch, with the texts encoded by `encode_batch` (the fast path)."""
        return [self._text_layout(ids, finished=True) for ids in self.encode_batch(texts)]

    def _text_layout(self, text_ids: list[int], finished: bool) -> tuple[list[int], int]:
        ids = text_ids if self._text_bos is None else [self._text_bos, *text_ids]
        if finished:
            ids = [*ids, self._eos_id]
        return ids, 0 if self._text_bos is None else 1
