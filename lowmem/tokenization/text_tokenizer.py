"""The tokenizer a run trains with, whichever kind: lowmem's SentencePiece model (`sentencepiece_tokenizer.Tokenizer`,
trained on the run's data) or a transformers model's `tokenizer.json` (`hf_tokenizer.HFTokenizer`, which comes with a
model a run starts from). Both have the interface `TextTokenizer` lists; the collate function, the
validation, generation and the trainer use nothing else.

    folder holds                                        loaded as
    tokenizer.model with lowmem's special ids 0..4      Tokenizer (the layout [bos] prompt <sep> response [eos])
    tokenizer.json                                      HFTokenizer (the model's own chat template)
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from lowmem.atomic_files import folder_built_aside
from lowmem.tokenization.hf_tokenizer import HF_TOKENIZER_FILES, HFTokenizer
from lowmem.tokenization.sentencepiece_tokenizer import TOKENIZER_FILE, VOCAB_FILE, Tokenizer
from lowmem.tokenization.identity import TRAINING_RECORD_FILE, write_origin_record
from lowmem.errors import ConfigError
from lowmem.program import command_line

HF_TOKENIZER_JSON = "tokenizer.json"
# The files that make lowmem's tokenizer, as `copy_tokenizer` copies them (those present; a transformers model's:
# `HF_TOKENIZER_FILES`).
SENTENCEPIECE_FILES = (TOKENIZER_FILE, VOCAB_FILE, TRAINING_RECORD_FILE)


class TextTokenizer(Protocol):
    """What the pipeline needs of a tokenizer (see `sentencepiece_tokenizer.Tokenizer` for the contract of each)."""

    num_threads: int

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def encode_pair(self, prompt: str, response: str | None) -> tuple[list[int], int]: ...

    def encode_pair_batch(self, prompts: Sequence[str],
                          responses: Sequence[str | None]) -> list[tuple[list[int], int]]: ...

    def encode_text(self, text: str, finished: bool = True) -> tuple[list[int], int]: ...

    def encode_text_batch(self, texts: Sequence[str]) -> list[tuple[list[int], int]]: ...

    def describe(self) -> str: ...


def is_lowmem_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` holds a SentencePiece model with lowmem's special ids (a Llama 2 tokenizer.model has others)."""
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        return False
    try:
        Tokenizer.load(folder, num_threads=1)
    except ConfigError:
        return False
    return True


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` holds a tokenizer of either kind."""
    return (Path(folder) / TOKENIZER_FILE).is_file() or (Path(folder) / HF_TOKENIZER_JSON).is_file()


def load_tokenizer(folder: str | Path, num_threads: int | None = None) -> TextTokenizer:
    """The tokenizer in `folder`: lowmem's SentencePiece model when it holds one, else its tokenizer.json."""
    folder = Path(folder)
    if is_lowmem_tokenizer(folder) or not (folder / HF_TOKENIZER_JSON).is_file():
        # Tokenizer.load says what is missing (and how to train one) when there is nothing at all.
        return Tokenizer.load(folder, num_threads=num_threads)
    return HFTokenizer.load(folder, num_threads=num_threads)


def check_fits_model(tokenizer: TextTokenizer, tokenizer_dir: str | Path, vocab_rows: int, model: str) -> None:
    """Refuse a tokenizer whose ids go past the model's embedding rows (`vocab_rows`): they would index nothing, or
    another token's row."""
    if tokenizer.vocab_size > vocab_rows:
        raise ConfigError(
            f"The tokenizer in '{tokenizer_dir}' has {tokenizer.vocab_size:,} ids but {model} has {vocab_rows:,} "
            f"embedding rows: its ids would not fit. Pass --tokenizer_dir with the tokenizer the model was trained "
            f"with (or leave it out to take the model's own), or train a new model for this tokenizer with "
            f"`{command_line('train')}` without --init_from.")


def tokenizer_files(folder: str | Path, essential: bool = False) -> list[Path]:
    """The files that make the tokenizer in `folder` (lowmem's SentencePiece files, or a transformers tokenizer's),
    without the model's weights or anything else beside them; with `essential`, of lowmem's the model file only
    (what a model folder carries beside its weights)."""
    folder = Path(folder)
    lowmem = is_lowmem_tokenizer(folder)
    names = ((TOKENIZER_FILE,) if essential else SENTENCEPIECE_FILES) if lowmem else HF_TOKENIZER_FILES
    return [folder / name for name in names if (folder / name).is_file()]


def copy_tokenizer(source: str | Path, target: str | Path, came_with: str | None = None) -> None:
    """Copy the tokenizer in `source` into the folder `target` (replaced whole: built aside, then renamed), with a
    record of the model it `came_with` when given."""
    files = tokenizer_files(source)
    with folder_built_aside(target) as staged:
        for path in files:
            shutil.copyfile(path, staged / path.name)
        if came_with:
            write_origin_record(staged, came_with)
