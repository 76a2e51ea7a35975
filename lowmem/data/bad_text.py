"""Text that is not valid UTF-8 in a string column: finding the rows that hold it, and the message naming one.

Parquet readers do not check that a string column holds UTF-8 (pyarrow hands the bytes on as they are), so
bad text shows only when a value becomes a Python string, as a `UnicodeDecodeError` that names no file. The
readers catch that error on a chunk of rows and only then look for the rows here, so that text that is
valid, nearly always all of it, costs nothing more. What they do then is the `bad_text` setting:

- "refuse" (the default): stop with a DataError naming the file, row group, row and column;
- "skip": leave the rows out, counted with the rows with null or empty values.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from lowmem.errors import ConfigError, DataError

BAD_TEXT_CHOICES = ("refuse", "skip")
_SHOWN_BYTES = 24  # of a bad value, in the message


def check_bad_text(value: str) -> str:
    """`value` if it is a valid `bad_text` setting; else a ConfigError that says what each one does."""
    if value not in BAD_TEXT_CHOICES:
        raise ConfigError(
            f"bad_text must be 'refuse' or 'skip' (it is {value!r}). It says what to do with a row whose text is "
            "not valid UTF-8: refuse stops at the first such row and names its file, row group and column; skip "
            "leaves such rows out and counts them with the rows with empty values."
        )
    return value


def undecodable_rows(table: pa.Table | pa.RecordBatch) -> dict[str, np.ndarray]:
    """For each column holding text that is not valid UTF-8: a (rows,) bool mask of the rows holding it.

    Columns are validated whole first (fast, in Arrow); only a column that fails is decoded row by row.
    """
    found = {}
    for name, column in zip(table.column_names, table.columns):
        try:
            column.validate(full=True)
            continue
        except pa.ArrowInvalid:
            pass
        mask = np.zeros(len(column), dtype=bool)
        for row, value in enumerate(raw_values(column)):
            if value is not None and not _decodes(value):
                mask[row] = True
        if mask.any():
            found[name] = mask
    return found


def raw_values(column: pa.Array | pa.ChunkedArray) -> list[bytes | None]:
    """A string column's values as bytes (no UTF-8 check); None for nulls."""
    return column.cast(pa.large_binary()).to_pylist()


def _decodes(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def bad_text_error(where: str, column: str, value: bytes | None) -> DataError:
    """The DataError for text that is not UTF-8 at `where` (e.g. "row 7 of row group 2 of 'a.parquet'")."""
    start = "" if value is None else f" (it starts {value[:_SHOWN_BYTES]!r})"
    return DataError(
        f"{where[:1].upper()}{where[1:]} holds text that is not valid UTF-8 in column '{column}'{start}, which "
        "cannot be read as a string. Find such rows by reading the column as bytes (with pyarrow: "
        f"pq.read_table(path, columns=['{column}']).column(0).cast('binary')) and decoding each value, then write "
        "the file again with them decoded from their real encoding, or with errors='replace', or dropped; or pass "
        "--bad_text=skip (bad_text='skip' for a ParquetStream) to leave rows with undecodable text out, counted "
        "like rows with empty values."
    )
