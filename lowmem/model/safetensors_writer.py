"""Writing a safetensors file a tensor at a time.

The format puts every tensor's dtype, shape and byte range in a JSON header before any value, and what the header
needs is known from the tensors' shapes alone: `SafetensorsWriter` writes the header first, then each tensor's bytes
in the order the header lists them, as they come. A model exported this way is never held whole: each tensor is
gathered (or read, or merged), written and released before the next, and the file is one `safe_open` and
transformers read like any other.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Sequence

import torch

# safetensors' names of the dtypes lowmem writes.
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor of the file, as the header declares it before its bytes are written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> PlannedTensor:
        return cls(name, tensor.dtype, tuple(tensor.shape))


class SafetensorsWriter:
    """A safetensors file written tensor by tensor, in the order of `planned` (see the module's docstring).

    Use it as a context manager; `write` each planned tensor in turn. Leaving the block with a tensor unwritten (an
    error on the way) leaves a file whose size does not match its header: `safe_open` refuses it. Callers write into
    a folder they rename into place once everything is written.

    Args:
        path: the file to create.
        planned: every tensor the file will hold, in the order they will be written.
        metadata: the header's `__metadata__` (strings only, as the format requires).
    """

    def __init__(self, path: str | Path, planned: Sequence[PlannedTensor],
                 metadata: dict[str, str] | None = None) -> None:
        self.path, self.planned = Path(path), list(planned)
        names = [tensor.name for tensor in self.planned]
        if len(set(names)) != len(names):
            raise ValueError(f"A safetensors file holds each name once; {self.path} was given some twice.")
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for tensor in self.planned:
            if tensor.dtype not in DTYPE_NAMES:
                raise ValueError(f"{tensor.name}: safetensors stores no {tensor.dtype}.")
            header[tensor.name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                                   "data_offsets": [offset, offset + tensor.nbytes]}
            offset += tensor.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)  # the values start 8-byte aligned, as safetensors' own writer pads
        self._header = struct.pack("<Q", len(encoded)) + encoded
        self._file: BinaryIO | None = None
        self._next = 0  # the planned tensor being written
        self._written = 0  # its bytes written so far

    def __enter__(self) -> SafetensorsWriter:
        self._file = open(self.path, "wb")
        self._file.write(self._header)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor's values (from any device: copied to the host here), whole or a slice of its
        rows at a time (each call the rows after the last: a tensor is then never whole in host memory)."""
        if self._file is None:
            raise ValueError(f"{self.path} is not open: write inside the `with` block.")
        if self._next >= len(self.planned):
            raise ValueError(f"{self.path}: {name} was not planned (every planned tensor is written).")
        expected = self.planned[self._next]
        whole = tuple(tensor.shape) == expected.shape
        rows_of = expected.shape and tuple(tensor.shape[1:]) == expected.shape[1:]
        if name != expected.name or tensor.dtype != expected.dtype or not (whole or rows_of):
            raise ValueError(f"{self.path}: expected {expected.name} {expected.dtype} {list(expected.shape)} next, got "
                             f"{name} {tensor.dtype} {list(tensor.shape)}.")
        if self._written + tensor.nbytes > expected.nbytes:
            raise ValueError(f"{self.path}: more rows of {name} than its {list(expected.shape)}.")
        if tensor.numel():
            values = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self._file.write(values.numpy().data)  # little-endian on every platform torch runs on
        self._written += tensor.nbytes
        if self._written == expected.nbytes:
            self._next, self._written = self._next + 1, 0

    def __exit__(self, *exc_info: object) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        if exc_info[0] is None and self._next != len(self.planned):
            raise ValueError(f"{self.path}: {len(self.planned) - self._next} planned tensors were not written.")
