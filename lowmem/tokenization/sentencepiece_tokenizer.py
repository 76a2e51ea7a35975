"""SentencePiece tokenizer: streamed training from parquet files, and fast encoding for the training loop.

Every model trained here has the same fixed special ids, so the model, the collate function and the
generation code can rely on them without reading the tokenizer:

    id  piece    meaning
    0   <pad>    padding (never trained on; the loss ignores it)
    1   <s>      beginning of a sequence (bos)
    2   </s>     end of a sequence (eos)
    3   <unk>    unknown; not produced in practice, byte fallback covers every character
    4   <sep>    separates the prompt from the response
    5..260       <0x00>..<0xFF>, the byte pieces used for characters outside the vocabulary

The training sequence layout is ``[bos] prompt [sep] response [eos]`` (see ``Tokenizer.encode_pair``), or
``[bos] text [eos]`` for one column of text (``Tokenizer.encode_text``).

Encoding is lossless: ``decode(encode(text)) == text`` for any text (Chinese, ASCII, spaces, tabs,
newlines, characters never seen in training), with one exception inherited from SentencePiece: the
character U+2581 (``▁``) is its whitespace marker and decodes as a plain space.
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import sentencepiece as spm

from lowmem.atomic_files import write_bytes_atomic
from lowmem.data.bad_text import bad_text_error, check_bad_text, raw_values, undecodable_rows
from lowmem.data.reader import iter_file_batches
from lowmem.data.sources import DEFAULT_COLUMNS, FileSpec, RowGroupIndex, build_row_group_index
from lowmem.tokenization.identity import write_training_record
from lowmem.errors import ConfigError, DataError
from lowmem.program import command_line

logger = logging.getLogger(__name__)

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
SEP_ID = 4
SEP_PIECE = "<sep>"
# Special pieces plus the 256 byte pieces: the smallest vocabulary that can exist at all.
NUM_RESERVED_PIECES = 5 + 256

TOKENIZER_FILE = "tokenizer.model"  # the model itself: what `Tokenizer.load` reads
VOCAB_FILE = "tokenizer.vocab"  # its pieces and scores, for people to read
DEFAULT_TOKENIZER_DIR = Path("model_save/tokenizer")

# Rows per Arrow batch while streaming the training text: small enough that a batch of long
# responses stays a few MB, large enough that the per-batch overhead does not matter.
READ_BATCH_SIZE = 1024
# SentencePiece silently drops sentences longer than this many bytes (its default is 4192);
# long lines are cut into chunks below it so long responses still count.
MAX_SENTENCE_BYTES = 4192


def available_cpus() -> int:
    """Number of CPU cores this process may run on (the affinity mask, which containers narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


# --------------------------------------------------------------------------------------------
# Streaming the training text
# --------------------------------------------------------------------------------------------


@dataclass
class _TextStats:
    """Counts gathered while streaming, for the log and for the error when nothing was usable."""

    values: int = 0
    skipped: int = 0  # null or empty values
    sentences: int = 0
    bad_text: int = 0  # values left out for text that is not UTF-8 (bad_text="skip")


def _stream_sentences(index: RowGroupIndex, stats: _TextStats, bad_text: str = "refuse") -> Iterator[str]:
    """Every training sentence of the indexed files, read one Arrow batch at a time."""
    for file_id in range(len(index.files)):
        for value in _stream_values(index, file_id, bad_text, stats):
            stats.values += 1
            if not value:
                stats.skipped += 1
                continue
            for sentence in _split_sentences(value):
                stats.sentences += 1
                yield sentence


def _stream_values(index: RowGroupIndex, file_id: int, bad_text: str = "refuse",
                   stats: _TextStats | None = None) -> Iterator[str | None]:
    """The values of the index's columns in one of its files: batch by batch, and column by column within
    a batch, with one Arrow batch in memory at a time. Text that is not UTF-8 is refused (a DataError naming
    where) or, with `bad_text="skip"`, left out and counted in `stats`."""
    first_row = 0  # of the batch, in the file
    for batch in iter_file_batches(index, file_id, READ_BATCH_SIZE):
        for name, column in zip(batch.schema.names, batch.columns):
            try:
                values = column.to_pylist()
            except UnicodeDecodeError:
                values = None  # handled below, so that a refusal does not carry this error's traceback
            if values is None:  # rare: only now are the values looked at one by one
                values = _decodable_values(index, file_id, first_row, name, column, bad_text, stats)
            yield from values
        first_row += batch.num_rows


def _decodable_values(index: RowGroupIndex, file_id: int, first_row: int, name: str, column: Any, bad_text: str,
                      stats: _TextStats | None) -> list[str | None]:
    """A column of a batch whose text is not all UTF-8: the DataError naming the first bad value, or (skip) the
    other values."""
    bad = undecodable_rows(pa.table([column], names=[name])).get(name)
    if bad is None:
        raise DataError(f"A value of column '{name}' in '{index.paths[file_id]}' could not be read as text, but none "
                        "is invalid UTF-8 when checked again. Report this, with the data file if you can.")
    if bad_text != "skip":
        first = int(np.flatnonzero(bad)[0])
        group, row = _row_group_of(index.metadata[file_id], first_row + first)
        raise bad_text_error(f"row {row} of row group {group} of '{index.paths[file_id]}'", name,
                             raw_values(column.slice(first, 1))[0])
    if stats is not None:
        stats.bad_text += int(bad.sum())
    return [None if value is None else value.decode("utf-8")
            for value, left_out in zip(raw_values(column), bad) if not left_out]


def _row_group_of(metadata: Any, row: int) -> tuple[int, int]:
    """(row group, row in it) of row `row` of a file, from its footer."""
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group).num_rows
        if row < rows:
            return group, row
        row -= rows
    return metadata.num_row_groups - 1, row


def _reservoir_sample(sentences: Iterable[str], k: int, seed: int) -> list[str]:
    """A uniform sample of at most ``k`` items in one pass and O(k) memory (Algorithm R).

    SentencePiece's own ``input_sentence_size`` sampling does apply to ``sentence_iterator`` input,
    but its random generator ignores ``set_random_generator_seed``: the same data gave a different
    model in every process. Sampling here makes the model a function of (files, seed).
    """
    rng = random.Random(seed)
    sample: list[str] = []
    for i, sentence in enumerate(sentences):
        if i < k:
            sample.append(sentence)
            continue
        j = rng.randrange(i + 1)
        if j < k:
            sample[j] = sentence
    return sample


def _drain(items: list[Any]) -> Iterator[Any]:
    """Yield and drop each item, so the sample is freed while SentencePiece copies it in."""
    for i, item in enumerate(items):
        items[i] = None
        yield item


def _split_sentences(text: str) -> Iterator[str]:
    """Split one value into the line-sized sentences SentencePiece trains on.

    SentencePiece's input is line based (it strips line ends), so multi-line values are split on
    newlines; lines over its length limit are cut into chunks instead of being dropped.
    """
    # 4 bytes is the longest UTF-8 character, so this many characters always fit the byte limit.
    max_chars = MAX_SENTENCE_BYTES // 4
    for line in text.splitlines():
        if not line:
            continue
        if len(line) <= max_chars or len(line.encode("utf-8")) <= MAX_SENTENCE_BYTES:
            yield line
            continue
        for start in range(0, len(line), max_chars):
            yield line[start : start + max_chars]


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def _trainer_options(vocab_size: int, hard_vocab_limit: bool, verbose: bool) -> dict[str, Any]:
    """The SentencePiece trainer options; each one is chosen for lossless Chinese + ASCII text."""
    return dict(
        # BPE rather than unigram: on 600k generated Chinese lines BPE trained in 25 s against 370 s
        # for unigram (same vocabulary, similar tokens per character), for about 1.4x the memory
        # (~75 vs ~50 bytes per sampled character), which max_sentences bounds. BPE with byte
        # fallback is also the LLaMA-style layout most Chinese GPT tokenizers use.
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=hard_vocab_limit,
        # Rare characters (the last 0.05 %) are left to byte fallback instead of taking vocabulary.
        character_coverage=0.9995,
        byte_fallback=True,
        # Lossless: no NFKC (it would turn full-width ，！ into ASCII), no dummy "▁" prefix, no
        # collapsing of repeated spaces. Runs of spaces (code indentation) may become pieces.
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        # One piece per digit: numbers do not get arbitrary multi-digit pieces.
        split_digits=True,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        # The first user-defined symbol takes the first free id, 4.
        user_defined_symbols=[SEP_PIECE],
        # The input is already a seeded sample of at most max_sentences (see _reservoir_sample):
        # 0 tells SentencePiece to take it all instead of sampling again with its unseeded RNG.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=available_cpus(),
        # 0 = INFO; 2 = ERROR keeps stderr quiet (failures still raise).
        minloglevel=0 if verbose else 2,
    )


def _explain_trainer_error(exc: RuntimeError, vocab_size: int) -> ConfigError | None:
    """Turn SentencePiece's vocabulary-size failures into errors that say what to change."""
    message = str(exc)
    too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
    if too_high:
        return ConfigError(
            f"vocab_size={vocab_size} is more than the training text supports (at most {too_high.group(2)} "
            f"pieces); lower vocab_size to {too_high.group(2)} or less, add more text, "
            "or pass hard_vocab_limit=False to accept a smaller vocabulary"
        )
    too_small = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", message)
    if too_small:
        return ConfigError(
            f"vocab_size={vocab_size} is too small: the training text needs at least {too_small.group(2)} "
            "pieces for its characters and the special and byte pieces; raise vocab_size"
        )
    return None


def _vocab_text(sp: spm.SentencePieceProcessor) -> str:
    """The human-readable ``piece<TAB>score`` listing that SentencePiece writes as ``.vocab``."""
    lines = (f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    return "".join(lines)


def _check_training_arguments(vocab_size: int, max_sentences: int, bad_text: str) -> None:
    if vocab_size <= NUM_RESERVED_PIECES:
        raise ConfigError(
            f"vocab_size={vocab_size} is too small: {NUM_RESERVED_PIECES} ids are taken by special and byte pieces"
        )
    if max_sentences < 1:
        raise ConfigError(f"max_sentences={max_sentences} must be at least 1")
    check_bad_text(bad_text)


def train_tokenizer(
    files: FileSpec,
    out_dir: str | Path,
    vocab_size: int = 8000,
    columns: tuple[str, ...] = DEFAULT_COLUMNS,
    max_sentences: int = 2_000_000,
    seed: int = 0,
    *,
    hard_vocab_limit: bool = True,
    verbose: bool = False,
    bad_text: str = "refuse",
) -> Path:
    """Train a SentencePiece BPE tokenizer on parquet text, streamed, and save it atomically.

    Args:
        files: parquet files holding the training text: a path, a glob, a directory or a URI, or a list of
            them, or files already resolved (`lowmem.data.sources.resolve_data_files`, which saves listing
            object storage again).
        out_dir: folder for ``tokenizer.model`` and ``tokenizer.vocab`` (created if missing).
        vocab_size: number of pieces, the 261 special and byte pieces included; it must also
            leave room for every character kept by the 99.95 % character coverage.
        columns: string columns to read; null and empty values are skipped.
        max_sentences: cap on the sentences trained on, sampled uniformly from all of them
            (multi-line values count one sentence per line). It bounds the training memory, about
            75 bytes per character kept: 2,000,000 lines of 50 characters need ~8 GB; lower it on
            smaller hosts.
        seed: seed of the sampling; the same files, columns and seed give the same model.
        hard_vocab_limit: if False, a text too small for ``vocab_size`` gives a smaller vocabulary
            instead of an error.
        verbose: let SentencePiece log its progress to stderr.
        bad_text: a value whose text is not valid UTF-8: "refuse" stops with a DataError naming its file,
            row group, row and column; "skip" leaves it out (`lowmem.data.bad_text`).

    Returns:
        The path of ``tokenizer.model``. It is written last, by a rename, so it exists only if
        training succeeded.

    Raises:
        DataError: a file is missing, empty or unreadable, a column is missing or not strings, or the
            columns hold no text at all.
        ConfigError: vocab_size does not fit the training text.
    """
    _check_training_arguments(vocab_size, max_sentences, bad_text)
    # Every footer is read and every column checked before training, so a bad last file fails at once
    # rather than after streaming all the files before it.
    index = build_row_group_index(files, tuple(columns))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = out_dir / TOKENIZER_FILE
    if model_path.exists():
        logger.warning("replacing %s: models trained with the old tokenizer will not match the new one", model_path)

    stats = _TextStats()
    sample = _reservoir_sample(_stream_sentences(index, stats, bad_text), max_sentences, seed)
    if stats.bad_text:
        logger.warning("Left %d values whose text is not valid UTF-8 out of the tokenizer's training text "
                       "(bad_text=skip).", stats.bad_text)
    if not sample:
        raise DataError(
            f"no text to train the tokenizer on: columns {list(columns)} of {list(index.paths)} "
            "are all null or empty"
        )
    logger.info("training the tokenizer on %d of %d sentences (%d values, %d null or empty skipped, %d files)",
                len(sample), stats.sentences, stats.values, stats.skipped, len(index.files))
    proto = _run_trainer(sample, _trainer_options(vocab_size, hard_vocab_limit, verbose))

    sp = spm.SentencePieceProcessor(model_proto=proto)
    # The vocab listing and the record of the data go first: the model file, written last, marks a finished
    # training.
    write_bytes_atomic(out_dir / VOCAB_FILE, _vocab_text(sp).encode("utf-8"))
    write_training_record(out_dir, [str(path) for path in index.paths], columns, vocab_size, len(sample))
    write_bytes_atomic(model_path, proto)
    logger.info("saved tokenizer with %d pieces to %s", sp.get_piece_size(), model_path)
    return model_path


def _run_trainer(sentences: list[str], options: dict[str, Any]) -> bytes:
    """Run SentencePiece on the sampled sentences; return the serialized model (nothing on disk)."""
    writer = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=_drain(sentences), model_writer=writer, **options)
    except RuntimeError as exc:
        explained = _explain_trainer_error(exc, options["vocab_size"])
        if explained is not None:
            raise explained from exc
        raise
    return writer.getvalue()


# --------------------------------------------------------------------------------------------
# Loading and encoding
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A trained SentencePiece model with the project's special ids.

    Picklable (it is sent to DataLoader worker processes): the pickle carries the serialized model,
    a few hundred KB, not a path, so workers need no file access.
    """

    def __init__(self, model_proto: bytes, num_threads: int | None = None, source: str = "<memory>") -> None:
        """Build from a serialized model (``Tokenizer.load`` reads one from disk).

        Args:
            model_proto: the bytes of a ``tokenizer.model`` file.
            num_threads: threads for ``encode_batch``; default all available cores. Set 1 in
                DataLoader workers when there are as many workers as cores.
            source: where the model came from, for error messages.
        """
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.load_from_serialized_proto(model_proto)
        except (RuntimeError, OSError, ValueError) as exc:
            raise ConfigError(
                f"{source} is not a valid SentencePiece model ({exc}); retrain it with `{command_line('tokenizer')}`"
            ) from exc
        self.num_threads = num_threads if num_threads is not None else available_cpus()
        self._check_special_ids(source)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TOKENIZER_DIR, num_threads: int | None = None) -> Tokenizer:
        """Load ``tokenizer.model`` from a folder or a file path (default ``model_save/tokenizer``)."""
        path = Path(path)
        # A folder, or a path without a suffix that does not exist yet: the default layout.
        if path.is_dir() or (not path.exists() and not path.suffix):
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise ConfigError(f"tokenizer not found at {path}; train one first with `{command_line('tokenizer')}`")
        return cls(path.read_bytes(), num_threads=num_threads, source=str(path))

    def _check_special_ids(self, source: str) -> None:
        sp = self._sp
        found = (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id(), sp.piece_to_id(SEP_PIECE))
        if found != (PAD_ID, BOS_ID, EOS_ID, UNK_ID, SEP_ID):
            raise ConfigError(
                f"{source} has special ids pad/bos/eos/unk/sep = {found}, expected "
                f"{(PAD_ID, BOS_ID, EOS_ID, UNK_ID, SEP_ID)}; it was not trained by lowmem, "
                f"retrain with `{command_line('tokenizer')}`"
            )

    # Pickling: SentencePieceProcessor wraps a C++ object, so carry the model bytes instead.
    def __getstate__(self) -> dict[str, Any]:
        return {"model_proto": self._sp.serialized_model_proto(), "num_threads": self.num_threads}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["model_proto"], num_threads=state["num_threads"])

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special and byte pieces included (the model's embedding size)."""
        return self._sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        """Padding id (0)."""
        return PAD_ID

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (1)."""
        return BOS_ID

    @property
    def eos_id(self) -> int:
        """End-of-sequence id (2)."""
        return EOS_ID

    @property
    def unk_id(self) -> int:
        """Unknown-piece id (3); byte fallback means encode never returns it."""
        return UNK_ID

    @property
    def sep_id(self) -> int:
        """Prompt/response separator id (4)."""
        return SEP_ID

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end an answer: eos."""
        return (EOS_ID,)

    def describe(self) -> str:
        """One line for the log: the kind, the size and the layout."""
        return f"SentencePiece, {self.vocab_size:,} pieces, the layout [bos] prompt <sep> response [eos]"

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, without special tokens."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text; SentencePiece encodes the batch in C++ on ``num_threads`` threads."""
        texts = list(texts)
        if not texts:
            return []
        return self._sp.encode(texts, num_threads=self.num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; pad, bos and eos are dropped, ``<sep>`` shows as the text "<sep>"."""
        if hasattr(ids, "tolist"):  # numpy arrays and torch tensors
            ids = ids.tolist()
        kept = [int(i) for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)]
        return self._sp.decode(kept)

    def encode_pair(self, prompt: str, response: str | None) -> tuple[list[int], int]:
        """The training layout ``[bos] prompt [sep] response [eos]`` and where the response starts.

        Returns ``(ids, start)``: ``ids[start:]`` are the response ids followed by eos. The trainer
        counts the loss only for target tokens at index ``>= start``, so the first prediction that
        counts is the one made at the ``[sep]`` position. With ``response`` None the layout is
        ``[bos] prompt [sep]``, a generation prompt, and ``start == len(ids)``.
        """
        prompt_ids = self.encode(prompt)
        response_ids = None if response is None else self.encode(response)
        return _pair_layout(prompt_ids, response_ids)

    def encode_pair_batch(self, prompts: Sequence[str], responses: Sequence[str | None]) -> list[tuple[list[int], int]]:
        """``encode_pair`` over a batch, with the texts encoded by ``encode_batch`` (the fast path)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        prompt_ids = self.encode_batch(prompts)
        present = [r for r in responses if r is not None]
        encoded = iter(self.encode_batch(present))
        response_ids = [None if r is None else next(encoded) for r in responses]
        return [_pair_layout(p, r) for p, r in zip(prompt_ids, response_ids)]

    def encode_text(self, text: str, finished: bool = True) -> tuple[list[int], int]:
        """The layout of one column of text, ``[bos] text [eos]``, and where the counted targets start.

        Returns ``(ids, 1)``: every token after bos is a target, as for ``encode_pair``'s ``ids[start:]``.
        With ``finished`` False the layout is ``[bos] text``, a beginning for the model to continue.
        """
        return _text_layout(self.encode(text), finished)

    def encode_text_batch(self, texts: Sequence[str]) -> list[tuple[list[int], int]]:
        """``encode_text`` over a batch, with the texts encoded by ``encode_batch`` (the fast path)."""
        return [_text_layout(ids, finished=True) for ids in self.encode_batch(texts)]


def _text_layout(text_ids: list[int], finished: bool) -> tuple[list[int], int]:
    ids = [BOS_ID, *text_ids]
    if finished:
        ids.append(EOS_ID)
    return ids, 1


def _pair_layout(prompt_ids: list[int], response_ids: list[int] | None) -> tuple[list[int], int]:
    ids = [BOS_ID, *prompt_ids, SEP_ID]
    start = len(ids)
    if response_ids is not None:
        ids += response_ids
        ids.append(EOS_ID)
    return ids, start
