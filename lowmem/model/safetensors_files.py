"""Reading safetensors files a few rows at a time, through a memory map whose pages are handed back as they are read.

A safetensors file is an 8-byte header length, a JSON header (each tensor's dtype, shape and byte range) and the raw
little-endian bytes of the tensors. Loading a model from one here never holds the whole file, nor a whole tensor
in the file's dtype: `SafetensorsFiles.read_rows` returns a slice of rows as a tensor over the mapped pages, the
caller casts it into the model's parameter, and `release` tells the kernel that those pages are no longer needed
by this process (`madvise(MADV_DONTNEED)`). The pages stay in the page cache, shared by every process that reads
the same file: three ranks loading one model read it from disk once and none of them keeps it in its RSS.

The header is read as JSON data and checked against the file's size before anything else: a truncated or
damaged file is refused with a message naming it, never half-read. No pickle is involved at any point.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from lowmem.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"  # transformers' map of tensor names to the files of a sharded model
# The dtypes a weight may be stored in (safetensors' names).
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# The most bytes one header may take: safetensors itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its file, dtype, shape and byte range within the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # the first byte, from the start of the file
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one index of the first dimension)."""
        return 0 if not self.shape or self.shape[0] == 0 else (self.end - self.start) // self.shape[0]


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, from its header, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise _damaged(path, "it is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise _damaged(path, f"its header claims {length:,} bytes")
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, ValueError) as error:
            raise _damaged(path, f"its header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a table of tensors")
    base = 8 + length
    entries = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, spec, base, size)
    return entries


def _entry(path: Path, name: str, spec: object, base: int, size: int) -> TensorEntry:
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise _damaged(path, f"the header's entry for {name!r} is not a tensor")
    dtype = DTYPES.get(spec["dtype"])
    if dtype is None:
        raise ConfigError(f"'{path}' stores {name!r} as {spec['dtype']}: lowmem loads weights stored as "
                          f"{', '.join(DTYPES)} (quantized or integer weights are not supported).")
    shape = tuple(int(n) for n in spec["shape"])
    start, end = (int(offset) + base for offset in spec["data_offsets"])
    expected = math.prod(shape) * dtype.itemsize
    if not base <= start <= end <= size or end - start != expected:
        raise _damaged(path, f"{name!r} ({spec['dtype']} {list(shape)}) does not fit its byte range")
    return TensorEntry(path, dtype, shape, start, end)


def _damaged(path: Path, why: str) -> ConfigError:
    return ConfigError(f"'{path}' is not a readable safetensors file: {why}. The file is damaged or was not fully "
                       "downloaded or copied; get it again (compare its size with the source's).")


def index_entries(folder: Path, weight_files: list[Path]) -> dict[str, TensorEntry]:
    """Every tensor of a model stored in `weight_files` (one file, or the shards an index names): name → entry.
    A name in two files is refused."""
    entries: dict[str, TensorEntry] = {}
    for path in weight_files:
        for name, entry in read_header(path).items():
            if name in entries:
                raise ConfigError(f"{name!r} is stored twice, in '{entries[name].file}' and '{path}': the model in "
                                  f"'{folder}' is ambiguous. Remove the extra file.")
            entries[name] = entry
    return entries


class SafetensorsFiles:
    """Rows of the tensors in a set of safetensors files, read through memory maps (see the module docstring).

    Args:
        entries: the tensors, as `index_entries` or `read_header` gives them.
    """

    def __init__(self, entries: dict[str, TensorEntry]) -> None:
        self.entries = entries
        self._maps: dict[Path, mmap.mmap] = {}

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            with open(path, "rb") as file:
                # A private (copy-on-write) mapping: writable, as torch.frombuffer wants, and never written to.
                self._maps[path] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[path]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` in its stored dtype: a tensor over the mapped pages (no copy). Copy or
        cast it before `release`."""
        entry = self.entries[name]
        if not entry.shape:  # a scalar has no rows
            first, last = entry.start, entry.end
        else:
            first, last = entry.start + start * entry.row_bytes, entry.start + stop * entry.row_bytes
        shape = (stop - start, *entry.shape[1:]) if entry.shape else ()
        if last == first:
            return torch.empty(shape, dtype=entry.dtype)
        buffer = memoryview(self._map(entry.file))[first:last]
        return torch.frombuffer(buffer, dtype=entry.dtype).view(shape)

    def release(self, name: str, start: int, stop: int) -> None:
        """Hand the pages of rows [start, stop) of `name` back to the kernel: they leave this process's RSS (and stay
        in the page cache for the other processes)."""
        entry = self.entries[name]
        if not hasattr(mmap, "MADV_DONTNEED") or entry.file not in self._maps:
            return
        first = entry.start + start * entry.row_bytes if entry.shape else entry.start
        last = entry.start + stop * entry.row_bytes if entry.shape else entry.end
        page = mmap.PAGESIZE
        first = first // page * page
        if last > first:
            self._maps[entry.file].madvise(mmap.MADV_DONTNEED, first, last - first)

    def close(self) -> None:
        """Unmap the files. A tensor still viewing a map keeps that map alive until it is freed."""
        maps, self._maps = self._maps, {}
        for mapped in maps.values():
            try:
                mapped.close()
            except BufferError:  # a view is still alive: the map closes when it is freed
                pass


def row_chunks(rows: int, row_bytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of at most `chunk_bytes` (at least one row each) covering `rows` rows."""
    step = max(1, chunk_bytes // max(row_bytes, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def row_slices(files: SafetensorsFiles, names: tuple[str, ...], first_row: int, rows: int, chunk_bytes: int,
               transpose: bool = False) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, stop, values) covering rows [first_row, first_row + rows) of one tensor stored as `names` stacked
    by rows (a tensor in pieces: a fused projection's parts, or a sharded tensor's shards), in rows counted from
    `first_row`; each slice at most `chunk_bytes` of the files, a view of their pages: copy or cast it, then the
    generator hands the pages back (`release`) before the next. With `transpose`, the one tensor `names` holds is
    stored transposed (GPT-2's Conv1D, (in, out) on file: small models only, read whole and transposed)."""
    if transpose:
        (name,) = names
        whole_rows = files.entries[name].shape[0]
        yield 0, rows, files.read_rows(name, 0, whole_rows).t()[first_row:first_row + rows]
        files.release(name, 0, whole_rows)
        return
    offset = 0  # the first row of the current piece, in the tensor's rows
    for name in names:
        entry = files.entries[name]
        low, high = max(first_row, offset), min(first_row + rows, offset + entry.shape[0])
        for start, stop in row_chunks(max(0, high - low), entry.row_bytes, chunk_bytes):
            begin = low - offset + start
            yield low - first_row + start, low - first_row + stop, files.read_rows(name, begin, begin + stop - start)
            files.release(name, begin, begin + stop - start)
        offset += entry.shape[0]
