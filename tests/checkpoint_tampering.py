"""A checkpoint's files rewritten as anyone with write access could: a pickle planted to run a command when it is
loaded, and a file replaced together with its completeness marker's size and CRC-32."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lowmem.checkpoint.folders import file_crc32


class Planted:
    """Runs `touch PATH` when unpickled: what a hostile checkpoint file would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def rewrite_as_saved(path: Path, obj: object) -> None:
    """Replace a checkpoint's file with `torch.save(obj)`, and its marker's size and CRC-32 with the new file's."""
    with open(path, "wb") as file:
        torch.save(obj, file)
    marker_file = next(parent for parent in path.parents if (parent / "COMPLETE.json").is_file()) / "COMPLETE.json"
    marker = json.loads(marker_file.read_text())
    size, crc = file_crc32(path)
    marker["files"][path.relative_to(marker_file.parent).as_posix()].update(size=size, crc32=crc)
    marker_file.write_text(json.dumps(marker))


def replace_as_saved(path: Path, content: bytes) -> None:
    """Put `content` in a checkpoint's file (a new one, or in place of one), and the marker's size and CRC-32 of it, as
    anyone with write access could."""
    path.write_bytes(content)
    marker_file = next(parent for parent in path.parents if (parent / "COMPLETE.json").is_file()) / "COMPLETE.json"
    marker = json.loads(marker_file.read_text())
    size, crc = file_crc32(path)
    marker["files"][path.relative_to(marker_file.parent).as_posix()] = {"size": size, "crc32": crc}
    marker_file.write_text(json.dumps(marker))
