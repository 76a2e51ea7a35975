"""A content fingerprint of the data files, so that a resume notices a file rewritten with other rows.

`RowGroupIndex.fingerprint` covers the file names and the rows of each row group: a file written again with
the same row counts, its rows shuffled or replaced, passes it, and a saved position would then continue over
other rows. This fingerprint adds, per file, a hash of

- the raw bytes of its parquet footer, read through the same filesystem as the rows (local, s3://, ...): the
  last 8 bytes give the footer's length, one more ranged read the footer if the first did not hold it. The
  footer holds every column chunk's offsets and sizes and, as pyarrow, pandas and Spark write them, each
  chunk's min/max statistics: other text, or rows moved across row groups, change it;
- the values of the stream's columns in the first row of up to 4 row groups spread over the file (first, last
  and between) and in the last row of each one's first batch (1,024 rows): a shuffle within a row group that
  keeps the footer's sizes (dictionary pages hold the same strings) moves them. Only that first batch of a
  row group is decoded, so a group of a million rows costs no more than one of a thousand.

What it cannot notice: a change that keeps the footer byte for byte and those rows of the sampled row groups,
e.g. rows permuted in the middle of a row group, or in a row group not sampled, of a file whose
pages are uncompressed and plain-encoded (so that no size changes) or written without statistics. What it
notices although the rows are the same: the same rows written again by another writer, version or compression
(the footer records the writer and the sizes); `--allow_config_change=True` continues from the saved position
then. A byte-identical copy (e.g. the same file uploaded to object storage) has the same fingerprint.

Cost, computed once per stream: a read of each file's end (on object storage a size lookup and one or two ranged
GETs) and the decoding of the first batch of the sampled row groups' stream columns: at most `MAX_SAMPLED_GROUPS`
row groups in all, at least one per file. docs/data.md ("What the fingerprint costs") gives its time and memory
with the script that measures them.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from lowmem.data.reader import open_parquet, read_error
from lowmem.data.sources import RowGroupIndex
from lowmem.data.storage import DataFile
from lowmem.errors import DataError
from lowmem.memory import release_arrow_memory, select_arrow_memory_pool

FINGERPRINT_VERSION = 1  # stored with the hashes: a saved state of another version is not compared
SAMPLED_GROUPS_PER_FILE = 4
# Across all files: a data set of thousands of files samples fewer row groups per file (one at least).
MAX_SAMPLED_GROUPS = 256
# One read of the file's end holds the footer of files with up to several hundred row groups.
_TAIL_BYTES = 64 * 1024
_BATCH_ROWS = 1024  # rows decoded at a time while reading a sampled row group
_REMOTE_THREADS = 16  # remote files are fingerprinted this many at a time: each costs a few round trips
_MAGICS = (b"PAR1", b"PARE")  # a plain and an encrypted footer


def content_fingerprint(index: RowGroupIndex) -> dict[str, Any]:
    """The content fingerprint of every indexed file: `{"version": 1, "files": [hash, ...]}`, in index order.

    JSON-serialisable, a 16-hex-digit hash per file. Local files are read one after the other, remote ones
    a few at a time.
    """
    select_arrow_memory_pool()  # the reader's allocator: with DataLoader workers, no reader runs in this process
    per_file = max(1, min(SAMPLED_GROUPS_PER_FILE, MAX_SAMPLED_GROUPS // max(len(index.files), 1)))
    jobs = range(len(index.files))
    try:
        if any(file.is_remote for file in index.files):
            with ThreadPoolExecutor(max_workers=min(_REMOTE_THREADS, len(index.files))) as pool:
                hashes = list(pool.map(lambda file_id: _file_hash(index, file_id, per_file), jobs))
        else:
            hashes = [_file_hash(index, file_id, per_file) for file_id in jobs]
    finally:
        release_arrow_memory()
    return {"version": FINGERPRINT_VERSION, "files": hashes}


def changed_files(index: RowGroupIndex, saved: Any, current: dict[str, Any]) -> list[str] | None:
    """The names of the files whose content differs between a `saved` fingerprint and the `current` one;
    None when they cannot be compared (a fingerprint of another version, or of another number of files)."""
    if not isinstance(saved, dict) or saved.get("version") != current["version"]:
        return None
    old, new = saved.get("files"), current["files"]
    if not isinstance(old, list) or len(old) != len(new):
        return None
    return [name for name, before, now in zip(index.paths, old, new) if before != now]


def sampled_groups(num_groups: int, count: int) -> list[int]:
    """Up to `count` of `num_groups` row groups spread evenly, the first and the last included."""
    return np.unique(np.linspace(0, num_groups - 1, num=min(count, num_groups)).round().astype(int)).tolist()


def _file_hash(index: RowGroupIndex, file_id: int, groups_per_file: int) -> str:
    file = index.files[file_id]
    digest = hashlib.sha256(read_footer_bytes(file))
    groups = index.group_in_file[index.file_id == file_id]  # the file's indexed (non-empty) row groups
    picks = [int(groups[i]) for i in sampled_groups(len(groups), groups_per_file)]
    handle = None
    try:
        handle = open_parquet(file.path, index.metadata[file_id], file.filesystem)
        for group in picks:
            digest.update(group.to_bytes(4, "little"))
            for row in _first_and_last_rows(handle, group, index.columns):
                digest.update(row)
    except (pa.ArrowException, OSError) as exc:
        raise read_error(file, exc, "sampled rows") from exc
    finally:
        if handle is not None:
            handle.close()
    return digest.hexdigest()[:16]


def read_footer_bytes(file: DataFile) -> bytes:
    """The raw footer of a parquet file (without its length and magic), through the file's own filesystem."""
    filesystem = file.filesystem if file.is_remote else pafs.LocalFileSystem()
    assert filesystem is not None  # is_remote means file.filesystem is set
    try:
        with filesystem.open_input_file(file.path) as handle:
            size = handle.size()
            tail = handle.read_at(min(size, _TAIL_BYTES), max(0, size - _TAIL_BYTES))
            length = int.from_bytes(tail[-8:-4], "little") if len(tail) >= 8 else -1
            if tail[-4:] not in _MAGICS or not 0 < length <= size - 8:
                raise DataError(
                    f"'{file.name}' does not end as a parquet file does (it may be truncated, or have been "
                    "replaced while in use): write it again, or leave it out of the data files."
                )
            if length + 8 <= len(tail):
                return tail[len(tail) - 8 - length:-8]
            return handle.read_at(length, size - 8 - length)
    except (pa.ArrowException, OSError) as exc:
        raise read_error(file, exc, "the footer") from exc


def _first_and_last_rows(handle: Any, group: int, columns: Sequence[str]) -> list[bytes]:
    """The first row of row group `group` of an open file and the last of its first batch (of `_BATCH_ROWS`), each
    as bytes of its column values.

    Only the first batch is decoded: a row group of a million rows costs no more than one of a thousand, and a
    group's rows shuffled or replaced almost surely change its first rows.
    """
    for batch in handle.iter_batches(batch_size=_BATCH_ROWS, row_groups=[group], columns=list(columns),
                                     use_threads=False):
        if batch.num_rows:
            return [_row_bytes(batch, 0, columns), _row_bytes(batch, batch.num_rows - 1, columns)]
    return []


def _row_bytes(batch: pa.RecordBatch, row: int, columns: Sequence[str]) -> bytes:
    """One row's values as bytes: raw, so that text that is not UTF-8 hashes too; lengths keep them apart."""
    parts = []
    for column in columns:
        value = batch.column(column)[row]
        if isinstance(value, pa.DictionaryScalar):
            value = value.value
        if value is None or not value.is_valid:
            parts.append(b"\0")
            continue
        data = value.as_buffer().to_pybytes()
        parts.append(b"\1" + len(data).to_bytes(8, "little") + data)
    return b"".join(parts)
