"""Tensors stored in shards: each process writes the rows it holds, and a JSON index says where every tensor's rows are.

    <folder>/index.json               every tensor's dtype and shape, and its pieces: which file holds which rows
    <folder>/rank00000.safetensors    the rows process 0 held of each tensor (a tensor not split: whole, once)
    <folder>/rank00001.safetensors    ...

Everything is data: safetensors files and JSON, read through their headers and a memory map, never a pickle (torch's
distributed checkpoint keeps its metadata pickled). A process reads back only the rows it needs, in slices, from
whichever files hold them (`ShardedTensors.fill`), so the shards load into any other number of processes, or whole
into one (`ShardedTensors.whole`), one tensor at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from lowmem.errors import CheckpointError
from lowmem.model.safetensors_files import SafetensorsFiles, TensorEntry, read_header, row_slices
from lowmem.model.safetensors_writer import DTYPE_NAMES, PlannedTensor, SafetensorsWriter

INDEX_FILE = "index.json"
FORMAT = "lowmem-shards/1"
# The most bytes of a file read at once when shards are loaded.
READ_CHUNK_BYTES = 64 * 2**20
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def shard_file(rank: int) -> str:
    """The name of process `rank`'s file."""
    return f"rank{rank:05d}.safetensors"


@dataclass(frozen=True)
class LocalPart:
    """What one process holds of a tensor: rows [first_row, first_row + rows) of a tensor of `shape`. A scalar (shape
    ()) is held whole."""

    name: str
    values: torch.Tensor
    first_row: int
    shape: tuple[int, ...]


def write_shard(folder: Path, rank: int, parts: Iterable[LocalPart],
                metadata: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Write this process's parts into `<folder>/<shard_file(rank)>`, a tensor at a time (each copied to the host as it
    is written); returns the index's entries for them: name → dtype, shape and this file's rows."""
    parts = list(parts)
    folder.mkdir(parents=True, exist_ok=True)
    with SafetensorsWriter(folder / shard_file(rank), [PlannedTensor.of(part.name, part.values) for part in parts],
                           metadata) as writer:
        for part in parts:
            writer.write(part.name, part.values)
    entries = {}
    for part in parts:
        rows = part.values.shape[0] if part.shape else 1
        entries[part.name] = {"dtype": DTYPE_NAMES[part.values.dtype], "shape": list(part.shape),
                              "rows": [part.first_row, part.first_row + rows], "file": shard_file(rank)}
    return entries


def write_index(folder: Path, ranks: list[dict[str, dict[str, Any]]], extra: dict[str, Any] | None = None) -> None:
    """`<folder>/index.json` from every process's `write_shard` entries (in rank order), and `extra` JSON beside."""
    tensors: dict[str, dict[str, Any]] = {}
    for entries in ranks:
        for name, entry in entries.items():
            tensor = tensors.setdefault(name, {"dtype": entry["dtype"], "shape": entry["shape"], "pieces": []})
            if entry["rows"][1] > entry["rows"][0] and not any(piece["rows"] == entry["rows"]
                                                              for piece in tensor["pieces"]):
                tensor["pieces"].append({"file": entry["file"], "rows": entry["rows"]})
    for tensor in tensors.values():
        tensor["pieces"].sort(key=lambda piece: piece["rows"][0])
    index = {"format": FORMAT, "files": sorted({entry["file"] for entries in ranks for entry in entries.values()}),
             "tensors": dict(sorted(tensors.items())), **(extra or {})}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")


def is_sharded_folder(folder: Path) -> bool:
    return (folder / INDEX_FILE).is_file()


class ShardedTensors:
    """The tensors of a folder `write_shard` and `write_index` wrote, checked from the index and the files' headers:
    every tensor's pieces cover its rows once, in files that hold them with its dtype. Use it as a context manager
    (the files' maps are closed after).

    Raises:
        CheckpointError: naming the file or tensor that does not fit.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        path = folder / INDEX_FILE
        try:
            self.index = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{path} cannot be read as JSON ({error}): the shards in {folder} cannot be "
                                  "loaded.") from error
        if not isinstance(self.index, dict) or self.index.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not an index of lowmem's shards ({FORMAT}).")
        self.tensors: dict[str, dict[str, Any]] = self.index["tensors"]
        headers: dict[str, dict[str, TensorEntry]] = {}
        for name in self.index["files"]:
            file = folder / name
            if not file.is_file():
                raise CheckpointError(f"{file} is missing: the shards in {folder} are incomplete.")
            headers[name] = read_header(file)
        self.entries: dict[str, TensorEntry] = {}
        self._pieces: dict[str, tuple[str, ...]] = {}
        for name, tensor in self.tensors.items():
            self._pieces[name] = self._check(name, tensor, headers)
        self._files = SafetensorsFiles(self.entries)

    def _check(self, name: str, tensor: dict[str, Any], headers: dict[str, dict[str, TensorEntry]]) -> tuple[str, ...]:
        shape = tuple(tensor["shape"])
        rows = shape[0] if shape else 1
        keys, covered = [], 0
        for piece in tensor["pieces"]:
            first, last = piece["rows"]
            entry = headers.get(piece["file"], {}).get(name)
            if first != covered or entry is None or entry.dtype != _DTYPES.get(tensor["dtype"]) or \
                    (shape and entry.shape != (last - first, *shape[1:])):
                raise CheckpointError(f"The shards of {name} in {self.folder} do not fit their index (rows {first} to "
                                      f"{last} in {piece['file']}): the checkpoint is damaged.")
            key = f"{name}@{piece['file']}"
            self.entries[key] = entry
            keys.append(key)
            covered = last
        if covered != rows:
            raise CheckpointError(f"The shards of {name} in {self.folder} hold {covered} of its {rows} rows: the "
                                  "checkpoint is damaged.")
        return tuple(keys)

    def __enter__(self) -> ShardedTensors:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._files.close()

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.tensors[name]["dtype"]]

    def fill(self, name: str, local: torch.Tensor, first_row: int) -> None:
        """Copy rows [first_row, first_row + len(local)) of tensor `name` into `local` (cast to its dtype on the
        way), a slice at a time; a scalar whole."""
        shape = self.shape(name)
        if tuple(local.shape[1:]) != shape[1:] or (not shape and local.dim()):
            raise CheckpointError(f"{name} in {self.folder} has shape {list(shape)}, which does not fit the model's "
                                  f"{list(local.shape)}: resume with the model it was saved from.")
        if not shape:
            local.copy_(self._files.read_rows(self._pieces[name][0], 0, 0))
            return
        with torch.no_grad():
            for start, stop, part in row_slices(self._files, self._pieces[name], first_row, local.shape[0],
                                                READ_CHUNK_BYTES):
                local[start:stop].copy_(part)
                del part

    def slices(self, name: str, chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[torch.Tensor]:
        """Tensor `name`'s rows in order, a slice of at most `chunk_bytes` at a time: views of the files' pages, handed
        back after each (copy or write a slice before taking the next); a scalar whole."""
        if not self.shape(name):
            yield self._files.read_rows(self._pieces[name][0], 0, 0)
            return
        for _start, _stop, part in row_slices(self._files, self._pieces[name], 0, self.shape(name)[0], chunk_bytes):
            yield part

    def whole(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `name` whole, in host memory (in `dtype`, else its own)."""
        values = torch.empty(self.shape(name), dtype=dtype or self.dtype(name))
        self.fill(name, values, 0)
        return values
