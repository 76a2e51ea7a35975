"""Reading parquet files in bounded memory: one row group at a time (normal or ultra-low-mem mode), or a
whole file one batch at a time."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from lowmem.data.sources import RowGroupIndex
from lowmem.data.storage import DataFile, fresh_filesystem, storage_error
from lowmem.errors import DataError
from lowmem.memory import release_arrow_memory, select_arrow_memory_pool

# Read column chunks through a buffered stream, page by page, instead of loading each chunk whole.
_READ_BUFFER_BYTES = 1 << 20


def open_parquet(path: str, metadata: pq.FileMetaData, filesystem: pafs.FileSystem | None = None) -> pq.ParquetFile:
    """Open a parquet file whose footer is already parsed (`metadata`), for reading in bounded memory.

    `pre_buffer=False`: with pre-buffering pyarrow keeps the compressed bytes of every row group it has read
    until the file is closed, and RSS grows to the file's size. `memory_map=False`: mapped pages count
    towards RSS and inflate it. Passing the footer means opening costs no second read (or fetch) of it.
    """
    return pq.ParquetFile(path, metadata=metadata, pre_buffer=False, memory_map=False,
                          buffer_size=_READ_BUFFER_BYTES, filesystem=filesystem)


def read_error(file: DataFile, exc: Exception, part: str = "") -> DataError:
    """The error for a failed read of `file` (or of `part` of it, e.g. "row group 3"), saying what to do."""
    action = f"read {part} of" if part else "read"
    if file.is_remote and not isinstance(exc, pa.ArrowInvalid):
        return storage_error(action, file.name, exc)  # credentials, network, bucket: say which
    return DataError(
        f"Could not {action} '{file.name}': {exc}. The file may be damaged or changed since training "
        "started; write it again or leave it out of the data files."
    )


def iter_file_batches(index: RowGroupIndex, file_id: int, batch_size: int) -> Iterator[pa.RecordBatch]:
    """The indexed columns of every row of one file, `batch_size` rows at a time, one batch in memory.

    For a single pass over whole files (tokenizer training): the file is opened once, closed at the end,
    and the Arrow pool's free memory is handed back to the OS after it.
    """
    file = index.files[file_id]
    handle = None
    try:
        handle = open_parquet(file.path, index.metadata[file_id], file.filesystem)
        yield from handle.iter_batches(batch_size=batch_size, columns=list(index.columns))
    except (pa.ArrowException, OSError) as exc:
        raise read_error(file, exc) from exc
    finally:
        if handle is not None:
            handle.close()
        release_arrow_memory()


class RowGroupReader:
    """Reads row groups of an indexed data set as Arrow tables of string columns.

    Normal mode keeps one open handle per file (at most `max_open_files`, least recently used closed
    first). Ultra-low-mem mode opens the file afresh for every row group, reusing the footer already
    parsed at indexing time, and hands the Arrow pool's free memory back to the OS after each read.
    Both modes open files with `open_parquet` (no pre-buffering, no memory map: see there why).

    Files on object storage are opened through their pyarrow filesystem with the cached footer too, so
    opening one costs a size lookup, never a second fetch of its footer; row groups then arrive as one
    ranged read per column chunk.
    """

    def __init__(self, index: RowGroupIndex, ultra_low_mem: bool, max_open_files: int = 64):
        self.index = index
        self.ultra_low_mem = ultra_low_mem
        self.max_open_files = max_open_files
        self.rows_decoded = 0  # how many rows this reader has decoded: resume cost is measured with it
        self._handles: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self._filesystems: dict[int, pafs.FileSystem] = {}  # this process's clients, by id() of the index's
        select_arrow_memory_pool()  # here, because readers are created in each worker process too

    def _open(self, file_id: int) -> pq.ParquetFile:
        file = self.index.files[file_id]
        filesystem = self._filesystem(file.filesystem) if file.is_remote else None
        return open_parquet(file.path, self.index.metadata[file_id], filesystem)

    def _filesystem(self, shared: pafs.FileSystem) -> pafs.FileSystem:
        """This reader's own client for a filesystem of the index (see `fresh_filesystem`)."""
        key = id(shared)
        if key not in self._filesystems:
            self._filesystems[key] = fresh_filesystem(shared)
        return self._filesystems[key]

    def _handle(self, file_id: int) -> pq.ParquetFile:
        handle = self._handles.pop(file_id, None)
        if handle is None:
            handle = self._open(file_id)
            while len(self._handles) >= self.max_open_files:
                _, oldest = self._handles.popitem(last=False)
                oldest.close()
        self._handles[file_id] = handle
        return handle

    def read(self, group: int) -> pa.Table:
        """Row group `group` of the index (a global row-group number), with its columns as `string`."""
        file_id = int(self.index.file_id[group])
        group_in_file = int(self.index.group_in_file[group])
        path = self.index.paths[file_id]
        columns = list(self.index.columns)
        try:
            handle = self._open(file_id) if self.ultra_low_mem else self._handle(file_id)
            try:
                # One batch for the whole group: a table of one chunk, which `take` indexes directly
                # (on many chunks it concatenates them on every call), and the lowest peak measured.
                batches = list(handle.iter_batches(
                    batch_size=int(self.index.rows[group]), row_groups=[group_in_file], columns=columns,
                    use_threads=False,
                ))
            finally:
                if self.ultra_low_mem:
                    handle.close()
        except (pa.ArrowException, OSError) as exc:
            raise read_error(self.index.files[file_id], exc, f"row group {group_in_file}") from exc
        table = pa.Table.from_batches(batches, schema=batches[0].schema) if batches else None
        if table is None or table.num_rows != int(self.index.rows[group]):
            raise DataError(
                f"Row group {group_in_file} of '{path}' gave {0 if table is None else table.num_rows} rows, "
                f"but its footer says {int(self.index.rows[group])}. The file changed while in use, or is damaged."
            )
        self.rows_decoded += table.num_rows
        table = _as_plain_strings(table)
        if self.ultra_low_mem:
            release_arrow_memory()
        return table

    def close(self) -> None:
        """Close every open file handle."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def _as_plain_strings(table: pa.Table) -> pa.Table:
    """Cast large_string / string_view / dictionary-of-string columns to plain `string`.

    Row groups from different files are concatenated into one window, which needs identical types.
    """
    target = pa.schema([pa.field(name, pa.string()) for name in table.column_names])
    return table if table.schema.equals(target) else table.cast(target)
