"""Converting JSON Lines, JSON arrays, CSV, TSV and plain text into parquet files with small row groups.

Memory holds one row group of rows (and a read buffer) whatever the input's size: records are read as a stream
(`convert_formats`), none larger than `MAX_RECORD_BYTES`, mapped to rows (`convert_fields`) and written a row
group at a time. Each output is written to `<name>.partial` and renamed when complete, so a failure leaves no
output under the final name, and inputs are only ever read. Every record left out is counted by reason, and the
first lines of each reason named. Everything that can be refused (no input, two inputs with one output, an
existing output, a flag that does not apply) is refused before anything is written.
"""

from __future__ import annotations

import glob
import os
import shlex
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lowmem.atomic_files import file_built_aside
from lowmem.conversion.fields import FieldNames, RecordLayout, Skip, choose_layout
from lowmem.conversion.formats import (COMPRESSIONS, SUFFIX_FORMATS, Record, file_format, is_convertible,
                                         open_input, parquet_records, read_records, split_name)
from lowmem.errors import DataError
from lowmem.memory import release_arrow_memory, select_arrow_memory_pool
from lowmem.program import command_line
from lowmem.progress import progress_bar
from lowmem.units import MB

FIRST_LINES_NAMED = 5  # per reason, in the summary
# What a folder is searched for, named when an input finds nothing.
# What a folder is searched for: the text formats (a parquet file is converted when named).
_LOOKED_FOR = (f"{', '.join(suffix for suffix in SUFFIX_FORMATS if suffix != '.parquet')} files (also compressed: "
               f"{', '.join(COMPRESSIONS)})")


@dataclass
class Skipped:
    """Records and rows left out, counted by reason, with the first lines of each."""

    counts: Counter = field(default_factory=Counter)
    lines: dict[str, list[int]] = field(default_factory=dict)

    def add(self, reason: str, line: int) -> None:
        self.counts[reason] += 1
        first = self.lines.setdefault(reason, [])
        if len(first) < FIRST_LINES_NAMED:
            first.append(line)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        """E.g. "not valid JSON: 2, lines 4, 9; empty 'response': 1, line 7", most frequent first."""
        parts = []
        for reason, count in self.counts.most_common():
            lines = self.lines[reason]
            named = ", ".join(f"{line:,}" for line in lines) + (", ..." if count > len(lines) else "")
            parts.append(f"{reason}: {count:,}, line{'s' if count > 1 else ''} {named}")
        return "; ".join(parts)


@dataclass(frozen=True)
class ConvertResult:
    """One converted file."""

    source: str
    target: str
    rows: int
    row_groups: int
    mapping: str
    skipped: Skipped
    seconds: float
    input_bytes: int

    def summary(self) -> str:
        """One paragraph: what was written, what was left out and where, and how fast."""
        skipped = (f"{self.skipped.total:,} left out ({self.skipped.describe()})" if self.skipped.total
                   else "nothing left out")
        rate = self.input_bytes / MB / max(self.seconds, 1e-9)
        return (f"{self.source} → {self.target}: {self.rows:,} rows in {self.row_groups:,} row "
                f"group{'s' if self.row_groups != 1 else ''} ({self.mapping}); {skipped}. "
                f"{self.seconds:.1f} s, {rate:.1f} MB/s of input ({self.input_bytes / MB:.1f} MB).")


class _RowGroupWriter:
    """Rows gathered a row group at a time, each group written as soon as it is full.

    Rows come in as Python strings, which take two to four times the bytes of their UTF-8 text: they are
    turned into Arrow arrays every `_CHUNK_ROWS` rows, so that most of a row group is held as compact Arrow data.
    """

    _CHUNK_ROWS = 1000

    def __init__(self, path: Path, columns: tuple[str, ...], row_group_rows: int):
        self.path, self.columns, self.row_group_rows = path, columns, row_group_rows
        self.schema = pa.schema([(name, pa.string()) for name in columns])
        self.pending: list[list[str]] = [[] for _ in columns]
        self.chunks: list[list[pa.Array]] = [[] for _ in columns]
        self.held = 0  # rows in chunks and pending
        self.writer: pq.ParquetWriter | None = None
        self.rows = self.row_groups = 0

    def add(self, row: tuple[str, ...]) -> bool:
        """Add one row; True when that filled a row group, which is then written."""
        for values, value in zip(self.pending, row):
            values.append(value)
        self.held += 1
        if len(self.pending[0]) >= self._CHUNK_ROWS:
            self._to_arrow()
        if self.held < self.row_group_rows:
            return False
        self.flush()
        return True

    def _to_arrow(self) -> None:
        for chunks, values in zip(self.chunks, self.pending):
            chunks.append(pa.array(values, pa.string()))
        self.pending = [[] for _ in self.columns]

    def flush(self) -> None:
        """Write the rows held as one row group."""
        if not self.held:
            return
        self._to_arrow()
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, self.schema, compression="zstd")
        table = pa.table([pa.chunked_array(chunks, pa.string()) for chunks in self.chunks], schema=self.schema)
        self.writer.write_table(table, row_group_size=self.row_group_rows)
        self.rows += table.num_rows
        self.row_groups += 1
        self.chunks, self.held = [[] for _ in self.columns], 0
        del table
        release_arrow_memory()  # the pool keeps freed buffers otherwise, and RSS grows with each group

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def convert_file(source: str, target: str, names: FieldNames | None = None, text_unit: str = "line",
                 row_group_rows: int = 10_000, input_format: str | None = None) -> ConvertResult:
    """Convert one file into the parquet file `target`, written aside and renamed into place when complete.

    `names`: the fields named on the command line (none by default: the first record decides, see
    `convert_fields`); `text_unit`: "line" or "paragraph", for plain text, which is written as the column
    `text` as it is: `names.text` is refused for it (see `check_text_field`).
    """
    names = names or FieldNames()
    started = time.perf_counter()
    select_arrow_memory_pool()  # jemalloc, as the stream uses: after the first row group, RSS stays flat
    fmt = file_format(source, input_format)
    check_text_field(source, fmt, names)
    size = os.path.getsize(source)
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    skipped = Skipped()
    with open_input(source) as (stream, bytes_read), file_built_aside(target) as partial, \
            progress_bar(total=size, unit="B", unit_scale=True, desc=os.path.basename(source), leave=False) as bar:
        layout, writer = None, None
        try:
            records = parquet_records(source) if fmt == "parquet" else read_records(stream, fmt, text_unit)
            for record in _named_in_errors(source, records):
                if record.problem is not None:
                    skipped.add(record.problem, record.line)
                    continue
                if layout is None:
                    layout = _layout_for(source, record.line, record.value, names)
                    writer = _RowGroupWriter(partial, layout.columns, row_group_rows)
                assert writer is not None  # made together with layout
                if _write_rows(layout, writer, record.value, record.line, skipped):
                    bar.update(bytes_read() - bar.n)
            if writer is not None:
                writer.flush()
        finally:
            if writer is not None:
                writer.close()
        if writer is None or writer.rows == 0:
            raise _nothing_converted(source, skipped)
    assert layout is not None  # made together with writer
    return ConvertResult(source, target, writer.rows, writer.row_groups, layout.describe(), skipped,
                         time.perf_counter() - started, size)


def check_text_field(source: str, fmt: str, names: FieldNames) -> None:
    """Refuse --text_field for plain text: its lines (or paragraphs) are the text, with no field to name."""
    if names.text is not None and fmt == "txt":
        raise DataError(f"--text_field={names.text} names a field of JSON or CSV records, but '{source}' is plain "
                        "text, whose lines (or paragraphs) are written as the column 'text' as they are. Convert "
                        "it without --text_field (in a run of its own when other inputs need it).")


def _named_in_errors(source: str, records: Iterator[Record]) -> Iterator[Record]:
    """The records, with the file named in an error that stops the reading (the readers know only the line), and
    a compressed file that cannot be decompressed to its end told as one (`compressed_input_problem`)."""
    line = 0
    try:
        for record in records:
            line = record.line
            yield record
    except DataError as error:
        raise DataError(f"'{source}': {error}") from None
    except OSError as error:
        compression = split_name(source)[2]
        # An error of the disk itself carries an errno, and is told as such; the decompressor's carry none.
        if compression is None or error.errno is not None:
            raise
        raise DataError(compressed_input_problem(source, compression, error, line)) from None


def compressed_input_problem(source: str, compression: str, error: OSError, line: int) -> str:
    """One paragraph for a compressed file that cannot be decompressed to its end: cut short (an interrupted
    download or copy), or damaged, or not compressed data at all despite its name."""
    where = f"its first {line:,} lines were read" if line else "not one line of it could be read"
    test = f"{compression} -t {source}"
    if "truncated" in str(error).lower():
        return (f"'{source}' ends in the middle of its {compression} data: the file was cut short (an interrupted "
                f"download or copy?); {where}. Fetch or copy it again (`{test}` checks it). Nothing was written.")
    return (f"'{source}' is not valid {compression} data ({error}); {where}. The file is damaged, or it is not "
            f"{compression} data at all despite its name: check it with `{test}`, fetch it again, or name it for "
            "what it is. Nothing was written.")


def _layout_for(source: str, line: int, value: object, names: FieldNames) -> RecordLayout:
    try:
        return choose_layout(value, names)
    except DataError as error:
        raise DataError(f"'{source}', line {line}: {error}") from None


def _write_rows(layout: RecordLayout, writer: _RowGroupWriter, value: object, line: int, skipped: Skipped) -> bool:
    """Write the rows of one record (counting those left out); True when a row group was completed."""
    filled = False
    for row in layout.rows(value):
        if isinstance(row, Skip):
            skipped.add(row.reason, line)
        else:
            filled = writer.add(row) or filled
    return filled


def _nothing_converted(source: str, skipped: Skipped) -> DataError:
    left_out = f": {skipped.total:,} left out ({skipped.describe()})" if skipped.total else " (it is empty)"
    return DataError(f"No rows could be read from '{source}'{left_out}. Nothing was written. Check the file's format "
                     "and fields (--input_format, --prompt_field, --response_field, --text_field, --chosen_field, "
                     "--rejected_field).")


def check_field_names(names: FieldNames) -> None:
    """Refuse fields named for different rows: one column of text, prompt/response pairs, preference data."""
    answers = [f"--{kind}_field" for kind, name in (("chosen", names.chosen), ("rejected", names.rejected))
               if name is not None]
    if names.text is not None and (names.prompt is not None or names.response is not None or answers):
        raise DataError("--text_field writes one column of text, so the prompt, response and answer fields would not "
                        "be read. Give either --text_field or the fields of the prompt and its answers.")
    if names.response is not None and answers:
        raise DataError(f"--response_field names the response of prompt/response pairs, and {' and '.join(answers)} "
                        "the answers of preference data, which has no single response. Give either --response_field "
                        "or --chosen_field and --rejected_field.")


def check_output_not_given_as_input(inputs: str | list[str], output: str | None) -> None:
    """Refuse `convert data.jsonl data.parquet` (the `cp` idiom) with the command that works: without --output, a
    last input that ends in .parquet and does not exist was meant as the output, not as a file to read."""
    entries = [inputs] if isinstance(inputs, str) else [os.fspath(entry) for entry in inputs]
    if output is not None or len(entries) < 2:
        return
    *sources, last = entries
    if not last.endswith(".parquet") or os.path.exists(last) or any(char in last for char in "*?["):
        return  # a parquet file that exists, or a pattern, is an input (find_inputs says what it finds)
    several = (" (with several inputs --output is a folder that receives one .parquet file each)"
               if len(sources) > 1 else "")
    command = command_line(f"convert {' '.join(shlex.quote(source) for source in sources)} "
                           f"--output={shlex.quote(last)}")
    raise DataError(f"Nothing to convert at '{last}': no such file. convert takes the files to read as arguments and "
                    f"the parquet file to write as --output{several}: did you mean `{command}`? Nothing was written.")


def find_inputs(inputs: str | list[str]) -> list[str]:
    """The files to convert: each entry a file, a folder (every file below it with a suffix convert reads) or a
    glob; sorted within each entry, in the order given, each file once."""
    entries = [inputs] if isinstance(inputs, str) else list(inputs)
    if not entries:
        raise DataError(f"No input named: give the files to convert, folders (every one of their {_LOOKED_FOR} "
                        "is converted) or globs, e.g. lowmem convert data/train.jsonl.")
    found: list[str] = []
    seen: set[str] = set()
    for entry in entries:
        entry = os.fspath(entry)
        if os.path.isdir(entry):
            # Parquet files in a folder are what convert writes there: only one named (or a *.parquet pattern) is read.
            matches = sorted(str(path) for path in Path(entry).rglob("*")
                             if path.is_file() and is_convertible(str(path)) and not _is_parquet(str(path)))
        elif any(char in entry for char in "*?["):
            matches = sorted(path for path in glob.glob(entry, recursive=True) if os.path.isfile(path)
                             and (entry.endswith(".parquet") or not _is_parquet(path)))
        else:
            matches = [entry] if os.path.isfile(entry) else []
        if not matches:
            raise DataError(f"Nothing to convert at '{entry}': no such file, or no {_LOOKED_FOR} in that folder "
                            "or matching that pattern. Check the path.")
        for path in matches:  # the same file named twice (raw/a.jsonl, ./raw/a.jsonl) is converted once
            if os.path.abspath(path) not in seen:
                seen.add(os.path.abspath(path))
                found.append(path)
    return found


def _is_parquet(path: str) -> bool:
    return split_name(path)[1] == ".parquet"


def plan_targets(sources: list[str], output: str | None) -> list[tuple[str, str]]:
    """Pair each source with its parquet file: beside it (same stem; `<stem>_converted.parquet` for a parquet
    source) without `output`; `output` itself for one
    source and an output ending in .parquet; else `output` is a folder that receives each under its stem. Two
    sources with one stem are refused: the second would replace the first."""
    if output is None:  # a parquet input's rows are written beside it under another name
        pairs = [(source, f"{split_name(source)[0]}{'_converted' if _is_parquet(source) else ''}.parquet")
                 for source in sources]
    elif len(sources) == 1 and output.endswith(".parquet") and not os.path.isdir(output):
        return [(sources[0], output)]
    else:
        pairs = [(source, os.path.join(output, os.path.basename(split_name(source)[0]) + ".parquet"))
                 for source in sources]
    first: dict[str, str] = {}  # each target's first source
    for source, target in pairs:
        other = first.setdefault(os.path.abspath(target), source)
        if other != source:
            raise DataError(f"'{other}' and '{source}' would both be written to '{target}' (the same stem), the "
                            "second replacing the first; nothing was written. Convert them one by one, each with "
                            "--output=... naming its own .parquet file (or rename one of them).")
    return pairs


def convert(inputs: str | list[str], output: str | None = None, names: FieldNames | None = None,
            text_unit: str = "line", row_group_rows: int = 10_000, input_format: str | None = None,
            overwrite: bool = False) -> list[ConvertResult]:
    """Convert each input into a parquet file (see `plan_targets` for where), refusing to replace a file unless
    `overwrite`; the inputs, their outputs and the flags are all checked before anything is written."""
    names = names or FieldNames()
    if row_group_rows < 1:
        raise DataError(f"row_group_rows must be at least 1; got {row_group_rows}. 10000 is a good size.")
    check_field_names(names)
    check_output_not_given_as_input(inputs, output)
    pairs = plan_targets(find_inputs(inputs), output)
    for source, _ in pairs:  # each file's format now, so that a refusal comes before anything is written
        check_text_field(source, file_format(source, input_format), names)
    for source, target in pairs:
        if os.path.exists(target) and os.path.samefile(source, target):
            raise DataError(f"The output '{target}' is the input itself. Pass --output=... with another name.")
    existing = [target for _, target in pairs if os.path.exists(target)]
    if existing and not overwrite:
        raise DataError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}. Pass "
                        "--overwrite=True to replace, or --output=... to write elsewhere.")
    return [convert_file(source, target, names, text_unit, row_group_rows, input_format) for source, target in pairs]
