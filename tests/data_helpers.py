"""Parquet files the data tests write, and their in-process and command-line halves share: text that is not
UTF-8, a row group whose pages are damaged, and one `text` column (with its tokenizer)."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from training_helpers import write_chat_rows

from lowmem.config import TrainConfig, apply_overrides

# ----- text that is not UTF-8 ---------------------------------------------------------------------------------
BAD_TEXT_GROUP_ROWS = 100
BAD_TEXT_ROWS = 1000
# (row in the file, column): rows in several row groups, one with both columns bad.
BAD_TEXT_CELLS = {(37 + 2 * BAD_TEXT_GROUP_ROWS, "response"), (5, "prompt"), (640, "prompt"), (640, "response"),
                  (999, "prompt")}
EMPTY_PROMPT_ROWS = {412}  # a row with an empty prompt: skipped as before, counted with the others


def write_bad_text(path, bad=BAD_TEXT_CELLS, empty=EMPTY_PROMPT_ROWS, clean: bool = False):
    """BAD_TEXT_ROWS rows `x<i>` / `r:x<i>`; the values at `bad` hold bytes that are not UTF-8 (valid marker text
    instead when `clean`, so that the file has the same row groups and the same order)."""
    columns = {"prompt": [f"x{i}".encode() for i in range(BAD_TEXT_ROWS)],
               "response": [f"r:x{i}".encode() for i in range(BAD_TEXT_ROWS)]}
    for row, column in bad:
        columns[column][row] = b"ok-marker" if clean else b"\xff\xfe broken \xc3"
    for row in empty:
        columns["prompt"][row] = b""
    # Parquet writers do not check UTF-8: a binary array viewed as strings is written as it is.
    table = pa.table({name: pa.array(values, pa.binary()).view(pa.string()) for name, values in columns.items()})
    pq.write_table(table, path, row_group_size=BAD_TEXT_GROUP_ROWS)
    return path


# ----- a damaged row group ------------------------------------------------------------------------------------
DAMAGED_ROWS, DAMAGED_GROUP_ROWS = 2000, 200


def write_damaged(path, group: int = 5):
    """DAMAGED_ROWS chat rows in row groups of DAMAGED_GROUP_ROWS whose row group `group` has its compressed pages
    scrambled."""
    write_chat_rows(path, DAMAGED_ROWS, seed=3, row_group_rows=DAMAGED_GROUP_ROWS)
    metadata = pq.ParquetFile(path).metadata.row_group(group)
    data = bytearray(path.read_bytes())
    for column in range(metadata.num_columns):
        chunk = metadata.column(column)
        start = chunk.data_page_offset + 40  # past the page header, inside the compressed values
        for offset in range(start, min(start + 64, chunk.data_page_offset + chunk.total_compressed_size)):
            data[offset] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


# ----- one text column (--text_column=text) ---------------------------------------------------------------------
_SYLLABLES = list("春风明月江南归去相思落花流水千里故人长亭夜雨西楼山青云白酒醉梦")
# What the training log says of the loss of a text column.
EVERY_TOKEN_LINE = "loss on every token (one text column)"


def write_text_rows(path: Path, rows: int, seed: int, row_group_rows: int = 64) -> Path:
    """Rows of one `text` column of made-up text (and an `id` column the run must not need)."""
    rng = random.Random(seed)
    texts = ["".join(rng.choices(_SYLLABLES, k=rng.randint(10, 40))) + "。" for _ in range(rows)]
    pq.write_table(pa.table({"id": list(range(rows)), "text": texts}), path, row_group_size=row_group_rows)
    return path


# The fixtures reach a test module that imports them as themselves (`from data_helpers import text_data as
# text_data`): each such module makes its own.
@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """600 training rows and 40 validation rows of one `text` column."""
    folder = tmp_path_factory.mktemp("text")
    return write_text_rows(folder / "train.parquet", 600, seed=1), write_text_rows(folder / "valid.parquet", 40, seed=2)


@pytest.fixture(scope="module")
def text_tokenizer(tmp_path_factory, text_data) -> Path:
    """A tokenizer trained on `text_data`'s text column."""
    from lowmem.train.setup import train_tokenizer_for

    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer_for(apply_overrides(TrainConfig(), {"train_file": str(text_data[0]), "text_column": "text",
                                                        "tokenizer_dir": str(folder), "vocab_size": 400}))
    return folder
