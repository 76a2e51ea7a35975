"""Reading the records of text data files (JSON Lines, JSON arrays, CSV, TSV, plain text) as a stream.

Every reader holds one record (and a read buffer) at a time, whatever the file's size, and numbers each record
with the line it starts on, so that what is skipped can be named. No record larger than `MAX_RECORD_BYTES` is
ever held: lines are read at most that long, and a longer record stops the reading. A record that cannot be
read is yielded with the reason instead of a value; only damage that makes the rest of the file unreadable (a
broken JSON array, CSV that is not UTF-8, a record over the cap) stops the reading, with a `DataError` that
names the line.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, BinaryIO

import pyarrow as pa

from lowmem.errors import DataError
from lowmem.units import MB

FORMATS = ("jsonl", "json", "csv", "tsv", "txt", "parquet")
TEXT_UNITS = ("line", "paragraph")
# The format each suffix means; `.json` is JSON Lines or one JSON array, told apart by its first character.
SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv",
                  ".txt": "txt", ".parquet": "parquet"}
# Rows of a parquet file read at a time: what the published preference and chat sets ship (lists of turns).
PARQUET_BATCH_ROWS = 1024
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}  # pyarrow decompresses both, no other package
_READ_BUFFER_BYTES = 1 << 20
_ARRAY_CHUNK_CHARS = 1 << 20
# The most text one record may hold (a line, a paragraph, a CSV row, an element of a JSON array), in bytes of
# the file. Every reader holds a record whole, so memory is bounded by the row group and this cap, not by the
# file: without it a text file with no blank line read by paragraph, a CSV quote never closed, or a file that
# is one huge line would be held whole. 64 MB is far above any prompt, response or document worth a row.
MAX_RECORD_BYTES = 64 * MB
_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class Record:
    """One record read: a dict (JSON, CSV) or a str (text), or None with the reason it could not be read."""

    line: int
    value: dict | str | None
    problem: str | None = None


def split_name(path: str) -> tuple[str, str, str | None]:
    """(stem, format suffix, compression) of a file name: `a/train.jsonl.gz` → ("a/train", ".jsonl", "gzip")."""
    stem, suffix = os.path.splitext(path)
    compression = COMPRESSIONS.get(suffix.lower())
    if compression:
        stem, suffix = os.path.splitext(stem)
    return stem, suffix.lower(), compression


def is_convertible(path: str) -> bool:
    """Whether the file's name says it is a format `read_records` reads."""
    return split_name(path)[1] in SUFFIX_FORMATS


def file_format(path: str, input_format: str | None = None) -> str:
    """The format to read `path` as: `input_format` when given, else the one its suffix names."""
    if input_format is not None:
        if input_format not in FORMATS:
            raise DataError(f"--input_format={input_format} is not a format convert reads; choose one of "
                            f"{', '.join(FORMATS)}.")
        return input_format
    suffix = split_name(path)[1]
    if suffix not in SUFFIX_FORMATS:
        raise DataError(
            f"'{path}' does not end in a suffix convert knows ({', '.join(SUFFIX_FORMATS)}, optionally followed "
            f"by {' or '.join(COMPRESSIONS)}). Rename it, or say what it holds with --input_format "
            f"({', '.join(FORMATS)})."
        )
    return SUFFIX_FORMATS[suffix]


@contextmanager
def open_input(path: str) -> Iterator[tuple[BinaryIO, Callable[[], int]]]:
    """Yield the file's bytes, decompressed when its name ends in .gz or .zst, and a function giving how many
    bytes of the file itself (compressed, for a compressed file) have been read so far: the progress."""
    raw = open(path, "rb", buffering=_READ_BUFFER_BYTES)
    try:
        compression = split_name(path)[2]
        if compression is None:
            yield raw, raw.tell
        else:
            stream: Any = pa.CompressedInputStream(raw, compression)
            yield io.BufferedReader(stream, _READ_BUFFER_BYTES), raw.tell
    finally:
        raw.close()


def read_records(stream: BinaryIO, file_format: str, text_unit: str = "line") -> Iterator[Record]:
    """The records of a file in `file_format` (see FORMATS); text gives one record per line, or per paragraph
    (lines up to a blank line) with `text_unit="paragraph"`."""
    if file_format == "json":
        return _json_array(stream) if _starts_array(stream) else _json_lines(stream)
    if file_format == "jsonl":
        return _json_lines(stream)
    if file_format in ("csv", "tsv"):
        return _delimited(stream, "," if file_format == "csv" else "\t")
    if text_unit not in TEXT_UNITS:
        raise DataError(f"--text_unit={text_unit} is not one of {', '.join(TEXT_UNITS)}: 'line' gives a row per "
                        "line of text, 'paragraph' a row per paragraph (lines up to a blank line).")
    return _paragraphs(stream) if text_unit == "paragraph" else _text_lines(stream)


def parquet_records(path: str) -> Iterator[Record]:
    """The rows of a parquet file as records (a dict of its columns per row, a list of turns kept a list of dicts),
    numbered from 1, read PARQUET_BATCH_ROWS at a time: its row groups are never held whole."""
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"'{path}' is not a parquet file convert can read ({error}).") from error
    number = 0
    for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            number += 1
            yield Record(number, row)


def _starts_array(stream: Any) -> bool:
    """Whether the first character that is not white space (a byte-order mark aside) is `[`."""
    head = stream.peek(4096)[:4096].lstrip(codecs.BOM_UTF8).lstrip()
    return head[:1] == b"["


def _lines(stream: BinaryIO) -> Iterator[bytes]:
    """The file's lines, line endings kept. A line longer than MAX_RECORD_BYTES comes cut after
    MAX_RECORD_BYTES + 1 bytes, which every reader takes for a record over the cap: no more of it is read."""
    return iter(partial(stream.readline, MAX_RECORD_BYTES + 1), b"")


def _record_too_long(line: int, advice: str) -> DataError:
    """The error for a record over MAX_RECORD_BYTES starting at `line`; `advice` says what to do in that format."""
    return DataError(f"The record that starts at line {line:,} holds more than {MAX_RECORD_BYTES / MB:g} MB of "
                     f"text, the most convert holds at once (so that memory stays bounded). {advice}")


def _json_lines(stream: BinaryIO) -> Iterator[Record]:
    decode = json.JSONDecoder().decode  # json.loads would guess each line's encoding again
    for number, line in enumerate(_lines(stream), start=1):
        if len(line) > MAX_RECORD_BYTES:
            raise _record_too_long(number, "In JSON Lines a record is one line: split it into smaller records. A "
                                   "file that is one JSON array is read as such when named .json (or with "
                                   "--input_format=json).")
        if not line.strip():
            yield Record(number, None, "blank line")
            continue
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError:
            yield Record(number, None, "not UTF-8")
            continue
        try:
            value = decode(text)
        except ValueError:
            yield Record(number, None, "not valid JSON")
            continue
        yield _json_record(number, value)


def _json_record(number: int, value: Any) -> Record:
    if isinstance(value, dict):
        return Record(number, value)
    return Record(number, None, "not a JSON object")


class _ArrayReader:
    """The records of one JSON array, parsed a chunk of text at a time: `[` first, then values and commas."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.decoder = json.JSONDecoder()
        self.text = codecs.getincrementaldecoder("utf-8-sig")()
        self.buffer, self.pos, self.line, self.eof = "", 0, 1, False

    def fill(self) -> int:
        """Drop the text already read and append the next chunk (or note the end of the file); the bytes read."""
        data = self.stream.read(_ARRAY_CHUNK_CHARS)
        try:
            chunk = self.text.decode(data, final=not data)
        except UnicodeDecodeError as error:
            raise DataError(f"The JSON array is not UTF-8 text after line {self.line} ({error.reason}). Save the "
                            "file as UTF-8 (e.g. iconv -f GBK -t UTF-8) and convert it again.") from error
        self.buffer, self.pos, self.eof = self.buffer[self.pos:] + chunk, 0, not data
        return len(data)

    def next_char(self) -> str:
        """The next character that is not white space ('' at the end of the file), left unread."""
        while True:
            space = _SPACE.match(self.buffer, self.pos)
            assert space is not None  # _SPACE matches the empty string too
            end = space.end()
            self.line += self.buffer.count("\n", self.pos, end)
            self.pos = end
            if self.pos < len(self.buffer) or self.eof:
                return self.buffer[self.pos:self.pos + 1]
            self.fill()

    def value(self) -> Any:
        """Parse the value that starts here, reading more text while it is unfinished, up to MAX_RECORD_BYTES."""
        read = 0
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.pos)
                # A number cut at the end of the chunk parses too: it is complete only before more text.
                if end < len(self.buffer) or self.eof:
                    break
            except json.JSONDecodeError as error:
                if self.eof:
                    raise self.broken(f"{error.msg}") from error
                # Text cut mid-record and broken JSON fail alike: past the cap, the message names both.
                if read > MAX_RECORD_BYTES:
                    raise _record_too_long(self.line, "If it is not that long, the JSON is broken there "
                                           f"({error.msg}): fix it, or write the file as JSON Lines, one record "
                                           "per line, where a bad line is skipped and counted. If it is, split "
                                           "the record.") from error
            read += self.fill()
        self.line += self.buffer.count("\n", self.pos, end)
        self.pos = end
        return value

    def broken(self, what: str) -> DataError:
        return DataError(f"The JSON array is not valid at line {self.line} ({what}); the records after it cannot be "
                         "read. Fix the file there (or write it as JSON Lines, one record per line, where a bad "
                         "line is skipped and counted) and convert it again.")

    def records(self) -> Iterator[Record]:
        if self.next_char() != "[":
            raise self.broken("it does not start with '['")
        self.pos += 1
        first = True
        while True:
            char = self.next_char()
            if char == "]":
                self.pos += 1
                yield from self.after_end()
                return
            if not first:
                if char != ",":
                    raise self.broken(f"expected ',' or ']' between records, found {char!r}" if char
                                      else "the file ends before the closing ']'")
                self.pos += 1
                self.next_char()
            first, start = False, self.line
            yield _json_record(start, self.value())

    def after_end(self) -> Iterator[Record]:
        """What follows the closing `]`: nothing, or text counted as left out; a second array is refused."""
        char = self.next_char()
        if char == "[":
            raise DataError(f"A second JSON array starts at line {self.line} (after the first one's closing ']'); "
                            "convert reads one array per file. Join them into one array, or write the records as "
                            "JSON Lines, one per line.")
        if char:
            yield Record(self.line, None, "text after the array's closing ']'")


def _json_array(stream: BinaryIO) -> Iterator[Record]:
    yield from _ArrayReader(stream).records()


class _CsvLines:
    """The file's lines as text, line endings kept (the csv module reads quoted line breaks from them), with the
    bytes of the record being read counted: a quote never closed makes the rest of the file one field, which
    stops at MAX_RECORD_BYTES instead of filling memory."""

    def __init__(self, stream: BinaryIO):
        self.stream, self.record_start, self.record_bytes = stream, 1, 0

    def next_record(self, line: int) -> None:
        """Count afresh from `line`, where the next record starts."""
        self.record_start, self.record_bytes = line, 0

    def __iter__(self) -> Iterator[str]:
        for number, line in enumerate(_lines(self.stream), start=1):
            self.record_bytes += len(line)
            if self.record_bytes > MAX_RECORD_BYTES:
                raise _record_too_long(self.record_start, "A quote that is never closed makes the rest of the file "
                                       "one field: fix the quote there (or split the record) and convert it again.")
            try:
                yield line.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"Line {number} is not UTF-8 text ({error.reason}). Save the file as UTF-8 (e.g. "
                                "iconv -f GBK -t UTF-8) and convert it again.") from error


def _delimited(stream: BinaryIO, delimiter: str) -> Iterator[Record]:
    """CSV or TSV with a header line: one dict per row, keyed by the header's names."""
    # The default limit (128 KB per field) would refuse a long response; no field is longer than its record.
    csv.field_size_limit(MAX_RECORD_BYTES)
    lines = _CsvLines(stream)
    reader = csv.reader(lines, delimiter=delimiter)
    header = next(reader, None)
    if header is None:
        return
    header = [name.strip() for name in header]
    start = reader.line_num + 1
    while True:
        lines.next_record(start)
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error:
            yield Record(start, None, "not valid CSV")
        else:
            if not any(cell.strip() for cell in row):
                yield Record(start, None, "blank line")
            elif len(row) != len(header):
                yield Record(start, None, "a different number of fields than the header")
            else:
                yield Record(start, dict(zip(header, row)))
        start = reader.line_num + 1


def _text_lines(stream: BinaryIO) -> Iterator[Record]:
    for number, line in enumerate(_lines(stream), start=1):
        if len(line) > MAX_RECORD_BYTES:
            raise _record_too_long(number, "Split the line into shorter ones and convert the file again.")
        text = _line_text(line, number)
        if text is None:
            yield Record(number, None, "not UTF-8")
        elif text.strip():
            yield Record(number, text)
        else:
            yield Record(number, None, "blank line")


def _paragraphs(stream: BinaryIO) -> Iterator[Record]:
    """Runs of lines that are not blank, each joined with line breaks; blank lines separate them."""
    lines: list[str] = []
    start, damaged, held = 0, False, 0  # held: the paragraph's bytes
    for number, line in enumerate(_lines(stream), start=1):
        text = _line_text(line, number)
        if text is not None and not text.strip() and len(line) <= MAX_RECORD_BYTES:
            if lines or damaged:
                yield Record(start, None, "not UTF-8") if damaged else Record(start, "\n".join(lines))
            lines, damaged, held = [], False, 0
            continue
        if not lines and not damaged:
            start = number
        held += len(line)
        if held > MAX_RECORD_BYTES:
            raise _record_too_long(start, "A paragraph runs up to a blank line: put blank lines between the "
                                   "paragraphs, or convert with --text_unit=line (a row per line).")
        if text is None:
            damaged = True
        else:
            lines.append(text)
    if lines or damaged:
        yield Record(start, None, "not UTF-8") if damaged else Record(start, "\n".join(lines))


def _line_text(line: bytes, number: int) -> str | None:
    """A line without its line ending, as text; None when it is not UTF-8."""
    try:
        text = line.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError:
        return None
    return text.rstrip("\r\n")


def first_record(head: bytes, file_format: str) -> dict | str | None:
    """The first record in the first bytes of a file, to suggest how to convert it; None when they do not hold
    a whole one (or hold something else)."""
    try:
        if file_format in ("csv", "tsv"):
            line = head.decode("utf-8-sig").splitlines()[0]
            names = next(csv.reader([line], delimiter="," if file_format == "csv" else "\t"))
            return {name.strip(): "" for name in names}
        if file_format == "txt":
            return head.decode("utf-8-sig", errors="replace").splitlines()[0]
        text = head.decode("utf-8-sig").lstrip()
        if text.startswith("["):
            text = text[1:].lstrip()
        value = json.JSONDecoder().raw_decode(text)[0]
    except (ValueError, IndexError, StopIteration, csv.Error):
        return None
    return value if isinstance(value, dict) else None
