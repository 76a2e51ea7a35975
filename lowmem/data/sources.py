"""Finding parquet files and indexing their row groups from the footers alone.

Nothing here reads row data: row counts, sizes and schemas all come from each file's footer, which is
kept (as pyarrow FileMetaData) so that readers can reopen a file without parsing the footer again.
Paths may be local or URIs on object storage (s3://, gs://, hdfs://; see `lowmem.data.storage`).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lowmem.data.storage import DataFile, is_uri, read_remote_metadata, resolve_uri
from lowmem.errors import DataError
from lowmem.program import command_line
from lowmem.units import MB

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
# Files already resolved (`resolve_data_files`) may be passed again: object storage is not listed twice.
FileSpec = Union[PathLike, DataFile, Sequence[Union[PathLike, DataFile]]]

DEFAULT_COLUMNS = ("prompt", "response")  # the text columns read unless told otherwise: prompt, then response

_GLOB_CHARS = set("*?[")
REPACK_ROW_GROUP_ROWS = 10_000
# Remote footers are fetched this many at a time: each is a round trip, and there may be thousands of files.
_FOOTER_FETCH_THREADS = 16


def _is_text_type(type_: pa.DataType) -> bool:
    if pa.types.is_dictionary(type_):
        return _is_text_type(type_.value_type)
    return pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_string_view(type_)


def resolve_parquet_files(files: FileSpec) -> list[str]:
    """Expand a path, a glob, a directory, or a list of them into a sorted, de-duplicated list of files.

    A directory contributes every `*.parquet` file below it. Order is stable (sorted within each
    entry, entries in the order given) because the epoch plan is a function of the file list. URIs
    (s3://bucket/prefix/, s3://bucket/prefix/*.parquet, gs://..., hdfs://...) are listed the same way
    and come back as the URIs of single files.
    """
    return [file.name for file in resolve_data_files(files)]


def resolve_data_files(files: FileSpec) -> list[DataFile]:
    """Like `resolve_parquet_files`, with each file's filesystem (None for local files) kept for reading.

    `DataFile`s among `files` are taken as they are.
    """
    entries: Iterable[PathLike | DataFile] = [files] if isinstance(files, (str, os.PathLike, DataFile)) else files
    resolved: list[DataFile] = []
    for entry in entries:
        if isinstance(entry, DataFile):
            resolved.append(entry)
            continue
        text = os.fspath(entry)
        if is_uri(text):
            resolved.extend(resolve_uri(text))
        else:
            resolved.extend(DataFile(name=path, path=path) for path in _resolve_local(text))
    if not resolved:
        raise DataError("No data files were given. Pass a parquet file, a directory, a glob or a list of them.")
    # Keep the first occurrence of each file: the same file twice would give its rows twice per epoch.
    seen: set[str] = set()
    unique = []
    for file in resolved:
        key = file.name if file.is_remote else os.path.realpath(file.path)
        if key not in seen:
            seen.add(key)
            unique.append(file)
    return unique


def _resolve_local(text: str) -> list[str]:
    """The local files a path, a glob or a directory names, sorted."""
    if any(ch in text for ch in _GLOB_CHARS):
        matches = sorted(m for m in glob.glob(text, recursive=True) if os.path.isfile(m))
        if not matches:
            raise DataError(
                f"No parquet files match the pattern '{text}'. Check the pattern, or pass the files or "
                "their directory directly."
            )
        return matches
    if os.path.isdir(text):
        matches = sorted(str(p) for p in Path(text).rglob("*.parquet") if p.is_file())
        if not matches:
            raise DataError(
                f"No parquet files found in the directory '{text}' (looked for *.parquet, recursively). "
                "Put your .parquet files there or point to the files themselves."
            )
        return matches
    if os.path.exists(text):
        return [text]
    raise DataError(
        f"Data file not found: '{text}'. Check the path (relative paths are taken from "
        f"'{os.getcwd()}'), or pass a directory or a glob such as 'data/*.parquet'."
    )


def open_parquet_metadata(path: str) -> pq.FileMetaData:
    """Read one file's footer, turning pyarrow's errors into a message that names the file."""
    if os.path.getsize(path) == 0:
        raise DataError(f"The data file '{path}' is empty (0 bytes). Remove it or write it again.")
    try:
        return pq.read_metadata(path)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise DataError(
            f"'{path}' is not a readable parquet file ({exc}). It may be truncated (an interrupted copy "
            "or write) or not parquet at all: write it again, or leave it out of the data files."
        ) from exc


PARQUET_MAGIC = b"PAR1"  # the first 4 bytes of every parquet file (and its last 4)


def not_parquet_problem(path: str, columns: Sequence[str] = DEFAULT_COLUMNS,
                        option: str = "the data path") -> str | None:
    """None when the local file `path` starts as parquet does; else what it looks like and how to convert it
    (then to point `option` at the result).

    Only the first 4 bytes are read for a parquet file, so that a folder of thousands of files is checked
    cheaply; a few KB more only for one that is not. A parquet file damaged past its header is not noticed
    here: the data stream says so when it opens it.
    """
    with open(path, "rb") as handle:
        head = handle.read(len(PARQUET_MAGIC))
        if head == PARQUET_MAGIC:
            return None
        head += handle.read(4096)
    if not head:
        return f"'{path}' is empty (0 bytes): remove it or write it again."
    kind, file_format = _guess_format(path, head)
    named = " and ".join(f"'{column}'" for column in columns)
    problem = (f"'{path}' is not a parquet file: it looks like {kind}. lowmem reads parquet files with the text "
               f"columns {named} (--prompt_column and --response_column, or --text_column, name others). ")
    point = f"and point {option} at the parquet file (or its folder)."
    if file_format is not None:
        command, note = _convert_command(path, head, file_format, tuple(columns))
        return f"{problem}Convert it once:\n    {command}\n{point}{note}"
    # Neither text nor a compressed text file: `lowmem convert` does not read it, but pandas may.
    stem, suffix = os.path.splitext(path)
    target = f"{stem}.converted.parquet" if suffix == ".parquet" else f"{stem}.parquet"
    return (f"{problem}Write its rows as a table, for example with pandas:\n"
            f"    python -c \"import pandas as pd; pd.DataFrame({{'prompt': [...], 'response': [...]}})"
            f".to_parquet({target!r})\"\n{point}")


def _convert_command(path: str, head: bytes, file_format: str, columns: tuple[str, ...]) -> tuple[str, str]:
    """The `lowmem convert` command that turns `path` (in `file_format`) into parquet, with the flags its first
    record calls for, and a sentence to add about the result (or "")."""
    from lowmem.conversion.fields import suggest_flags
    from lowmem.conversion.formats import SUFFIX_FORMATS, first_record, split_name

    stem, suffix, compression = split_name(path)
    target = f"{stem}.converted.parquet" if suffix == ".parquet" else f"{stem}.parquet"
    flags, note = suggest_flags(None if compression else first_record(head, file_format), columns)
    named = SUFFIX_FORMATS.get(suffix)
    if named != file_format and not (named == "json" and file_format == "jsonl"):
        flags.insert(0, f"--input_format={file_format}")  # its name does not say what it holds
    line = " ".join([f"convert {shlex.quote(path)} --output={shlex.quote(target)}", *flags])
    return command_line(line), note


# The first bytes of the compressed files `lowmem convert` reads: gzip's, zstd's.
_COMPRESSED_MAGIC = (b"\x1f\x8b", b"\x28\xb5\x2f\xfd")


def _guess_format(path: str, head: bytes) -> tuple[str, str | None]:
    """What a file that is not parquet looks like, from its suffix and first bytes, and the format `lowmem convert`
    reads it as (None: one it does not read)."""
    from lowmem.conversion.formats import SUFFIX_FORMATS, split_name

    _, format_suffix, compression = split_name(path)
    suffix = os.path.splitext(path)[1].lower()
    first = head.lstrip()[:1]
    if compression and format_suffix in SUFFIX_FORMATS and head.startswith(_COMPRESSED_MAGIC):
        return f"{compression}-compressed {format_suffix} data", SUFFIX_FORMATS[format_suffix]
    if first == b"[":
        return "JSON (an array of records)", "json"
    if suffix in (".jsonl", ".json", ".ndjson") or first == b"{":
        return "JSON Lines (one JSON record per line)", "jsonl"
    if b"\0" in head or not _decodes(head):
        return f"binary data, neither parquet nor text (it starts with the bytes {head[:4]!r})", None
    first_line = next((line for line in head.splitlines() if line.strip()), b"")
    if suffix == ".tsv" or b"\t" in first_line:
        return "TSV (tab-separated values)", "tsv"
    if suffix == ".csv" or b"," in first_line:
        return "CSV (comma-separated values)", "csv"
    return "plain text (one row per line)", "txt"


def _decodes(head: bytes) -> bool:
    """Whether these first bytes are UTF-8 text (a character cut at the end of the sample still counts)."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start >= len(head) - 3
    return True


def check_columns(path: str, metadata: pq.FileMetaData, columns: Sequence[str]) -> None:
    schema = metadata.schema.to_arrow_schema()
    for column in columns:
        index = schema.get_field_index(column)
        if index < 0:
            raise DataError(f"The data file '{path}' has no column '{column}'; its columns are: "
                            f"{', '.join(schema.names)}. {_missing_column_advice(column)}")
        field_type = schema.field(index).type
        if pa.types.is_list(field_type) or pa.types.is_large_list(field_type):
            # A conversation (a list of turns), as the published chat and preference sets ship their answers.
            out = f"{os.path.splitext(path)[0]}_converted.parquet"
            raise DataError(
                f"Column '{column}' in '{path}' is a list ({field_type}): turns of a conversation, which training "
                "reads as text of a prompt and its answers. "
                f"`{command_line(f'convert {shlex.quote(path)}')}` writes them as such into {out} (the turns both "
                "answers share become the prompt, the last assistant turns the answers); train on that file.")
        if not _is_text_type(field_type):
            raise DataError(
                f"Column '{column}' in '{path}' has type {field_type}, expected strings (text). "
                "Convert it to strings when writing the file (for example df[col].astype(str) in pandas)."
            )


@dataclass(frozen=True)
class RowGroupIndex:
    """Every row group of every file, as flat numpy arrays (cheap to copy into DataLoader workers).

    Row group `i` is group `group_in_file[i]` of file `file_id[i]`, with `rows[i]` rows.
    """

    files: tuple[DataFile, ...]
    metadata: tuple[pq.FileMetaData, ...]
    columns: tuple[str, ...]
    file_id: np.ndarray  # (G,) int32
    group_in_file: np.ndarray  # (G,) int32
    rows: np.ndarray  # (G,) int64
    uncompressed_bytes: np.ndarray  # (G,) int64, of the selected columns only

    @property
    def paths(self) -> tuple[str, ...]:
        """Each file's name: its local path or its URI."""
        return tuple(file.name for file in self.files)

    @property
    def num_rows(self) -> int:
        return int(self.rows.sum())

    @property
    def num_row_groups(self) -> int:
        return int(self.rows.shape[0])

    @functools.cached_property
    def fingerprint(self) -> str:
        """A short hash of the file list and row-group layout: a saved position is only valid for the same data.

        Cached: every saved position carries it, and the training loop takes one each step. Only base
        names count, so a position saved on local files resumes on the same files copied to object storage.
        """
        digest = hashlib.sha256()
        for path in self.paths:
            digest.update(os.path.basename(path).encode())
        digest.update(self.rows.tobytes())
        return digest.hexdigest()[:16]

    def largest_group_per_file(self) -> dict[str, tuple[int, int, int]]:
        """For each file: (row group, its uncompressed bytes, its rows) of its largest row group."""
        result = {}
        for file_id, path in enumerate(self.paths):
            groups = np.flatnonzero(self.file_id == file_id)
            biggest = groups[np.argmax(self.uncompressed_bytes[groups])]
            result[path] = (
                int(self.group_in_file[biggest]),
                int(self.uncompressed_bytes[biggest]),
                int(self.rows[biggest]),
            )
        return result


def _missing_column_advice(column: str) -> str:
    """What to do about a column the data lacks: a precomputed reference's are written by `lowmem dpo_reference`."""
    if column.startswith("reference_"):
        return ("The reference's log-probabilities of --dpo_reference=precomputed are written beside the rows by "
                "`lowmem dpo_reference --init_from=MODEL --train_file=... --validation_file=...`: train on the "
                "folders it writes (<data>.reference).")
    return ("Rename the column in the file, or pass columns=... (on the command line: --prompt_column and "
            "--response_column, --chosen_column and --rejected_column with --objective=dpo, or --text_column for one "
            "column of text) with the names your files use.")


def build_row_group_index(files: FileSpec, columns: Sequence[str]) -> RowGroupIndex:
    """Resolve `files`, read every footer, check the columns, and index the row groups."""
    data_files = resolve_data_files(files)
    metadata_list = []
    file_ids, groups, rows, sizes = [], [], [], []
    for file_id, (file, metadata) in enumerate(zip(data_files, _read_footers(data_files))):
        path = file.name
        check_columns(path, metadata, columns)
        if metadata.num_rows == 0:
            raise DataError(
                f"The data file '{path}' has no rows. Remove it from the data files or write it again."
            )
        column_positions = _column_positions(metadata, columns)
        for group in range(metadata.num_row_groups):
            row_group = metadata.row_group(group)
            if row_group.num_rows == 0:
                continue  # an empty row group holds nothing to plan for
            file_ids.append(file_id)
            groups.append(group)
            rows.append(row_group.num_rows)
            sizes.append(sum(row_group.column(i).total_uncompressed_size for i in column_positions))
        metadata_list.append(metadata)
    return RowGroupIndex(
        files=tuple(data_files),
        metadata=tuple(metadata_list),
        columns=tuple(columns),
        file_id=np.asarray(file_ids, dtype=np.int32),
        group_in_file=np.asarray(groups, dtype=np.int32),
        rows=np.asarray(rows, dtype=np.int64),
        uncompressed_bytes=np.asarray(sizes, dtype=np.int64),
    )


def _read_footers(files: Sequence[DataFile]) -> Iterator[pq.FileMetaData]:
    """Every file's footer, in order: local ones one after the other, remote ones a few at a time."""
    if not any(file.is_remote for file in files):
        return (open_parquet_metadata(file.path) for file in files)
    with ThreadPoolExecutor(max_workers=min(_FOOTER_FETCH_THREADS, len(files))) as pool:
        return iter(list(pool.map(_read_footer, files)))


def _read_footer(file: DataFile) -> pq.FileMetaData:
    return read_remote_metadata(file) if file.is_remote else open_parquet_metadata(file.path)


def _column_positions(metadata: pq.FileMetaData, columns: Sequence[str]) -> list[int]:
    """Leaf-column positions of `columns` in the parquet schema (for per-column chunk sizes)."""
    wanted = set(columns)
    return [i for i in range(metadata.num_columns) if metadata.schema.column(i).path.split(".")[0] in wanted]


def _rows_that_fit(limit_bytes: int, group_bytes: int, group_rows: int) -> int:
    """Rows per row group that keep a group of rows this size under `limit_bytes` (in thousands, at least 1,000)."""
    fitting = int(limit_bytes / max(group_bytes / max(group_rows, 1), 1))
    return max(1000, min(REPACK_ROW_GROUP_ROWS, fitting // 1000 * 1000))


def warn_large_row_groups(index: RowGroupIndex, limit_bytes: int, groups_at_once: int = 1) -> list[str]:
    """Log one warning per file whose largest row group is over `limit_bytes`; return those files.

    Such files work, but every read holds a whole row group in memory (and a shuffled stream holds
    `groups_at_once` of them), so the bound on host memory is only as good as the row groups are small.
    The warning carries the command that repacks the file.
    """
    flagged = []
    for path, (group, size, rows) in index.largest_group_per_file().items():
        if size <= limit_bytes:
            continue
        flagged.append(path)
        # repack reads and writes local files: a remote file is copied here first, and uploaded after.
        source = os.path.basename(path) if is_uri(path) else path
        stem, _ = os.path.splitext(source)
        logger.warning(
            "Row group %d of '%s' holds %d rows, %.0f MB uncompressed, over the %.0f MB limit for one "
            "read: every read of it holds that much in memory%s. Rewrite the file with small row groups%s:\n"
            "    %s",
            group, path, rows, size / MB, limit_bytes / MB,
            f", and {groups_at_once} row groups are read at once" if groups_at_once > 1 else "",
            " (copy it here first, and upload the result in its place)" if is_uri(path) else "",
            command_line(f"repack {source} {stem}.repacked.parquet "
                         f"--row_group_rows={_rows_that_fit(limit_bytes, size, rows)}"),
        )
    return flagged
