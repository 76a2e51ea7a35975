"""A source whose weights hold NaN or infinity is refused before the run starts: it would train to NaN, save
checkpoints of it and end in a traceback wherever a value is sampled."""

from __future__ import annotations

import time

import torch

from lowmem.errors import ConfigError
from lowmem.model.safetensors_files import SafetensorsFiles, row_chunks
from lowmem.source.locate import ModelSource

SCAN_CHUNK_BYTES = 64 * 2**20  # of a file at a time, as the load reads it; the pages handed back after each


def non_finite_tensors(source: ModelSource, chunk_bytes: int = SCAN_CHUNK_BYTES) -> list[str]:
    """The names of the source's floating-point tensors that hold a NaN or an infinity, read a slice at a time
    through a memory map (the pages are handed back after each slice, so the process's memory stays flat)."""
    found = []
    with SafetensorsFiles(source.tensors) as files:
        # In file order: the reads go through each file once, front to back.
        for name, entry in sorted(source.tensors.items(), key=lambda item: (str(item[1].file), item[1].start)):
            if not entry.dtype.is_floating_point:
                continue
            rows = entry.shape[0] if entry.shape else 1
            for start, stop in row_chunks(rows, entry.row_bytes if entry.shape else entry.end - entry.start,
                                          chunk_bytes):
                values = files.read_rows(name, start, stop)
                finite = bool(torch.isfinite(values).all())
                del values
                files.release(name, start, stop)
                if not finite:
                    found.append(name)
                    break
    return found


def check_finite(source: ModelSource) -> float:
    """Refuse a source with a NaN or an infinity in its weights (`ConfigError`, naming the tensors); return the
    seconds the scan took."""
    started = time.perf_counter()
    bad = non_finite_tensors(source)
    if bad:
        more = f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
        raise ConfigError(f"The model of --init_from={source.given} holds values that are not finite (NaN or "
                          f"infinity) in {bad[0]}{more}, in {source.folder}: a run from it would train to NaN and "
                          "save checkpoints of it. Start from an intact copy of the model (download or export it "
                          "again, or name an earlier checkpoint of its run); nothing was written.")
    return time.perf_counter() - started
