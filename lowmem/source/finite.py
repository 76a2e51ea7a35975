"""A source whose weights hold NaN or infinity is refused before the run starts: it would train to NaN, save
checkpoints of it and end in a traceback wherever a value is sampled. The same read fingerprints the weights'
bytes (`content_fingerprint`): what a run and precomputed reference values record of the model they start from,
so that another checkpoint of the same shapes is told apart."""

from __future__ import annotations

import hashlib
import time

import torch

from lowmem.errors import ConfigError
from lowmem.model.safetensors_files import SafetensorsFiles, row_chunks
from lowmem.source.locate import ModelSource

SCAN_CHUNK_BYTES = 64 * 2**20  # of a file at a time, as the load reads it; the pages handed back after each


def scan_weights(source: ModelSource, chunk_bytes: int = SCAN_CHUNK_BYTES) -> tuple[list[str], str]:
    """(the names of the source's floating-point tensors that hold a NaN or an infinity, the sha256 of every
    tensor's name and bytes in file order), read a slice at a time through a memory map (the pages are handed back
    after each slice, so the process's memory stays flat)."""
    found = []
    digest = hashlib.sha256()
    with SafetensorsFiles(source.tensors) as files:
        # In file order: the reads go through each file once, front to back.
        for name, entry in sorted(source.tensors.items(), key=lambda item: (str(item[1].file), item[1].start)):
            digest.update(name.encode())
            rows = entry.shape[0] if entry.shape else 1
            flagged = not entry.dtype.is_floating_point  # nothing to look for in integers
            for start, stop in row_chunks(rows, entry.row_bytes if entry.shape else entry.end - entry.start,
                                          chunk_bytes):
                values = files.read_rows(name, start, stop)
                digest.update(values.contiguous().reshape(-1).view(torch.uint8).numpy().data)
                if not flagged and not bool(torch.isfinite(values).all()):
                    found.append(name)
                    flagged = True
                del values
                files.release(name, start, stop)
    fingerprint = digest.hexdigest()
    object.__setattr__(source, "content_sha256", fingerprint)  # read once: what records of the source reuse
    return found, fingerprint


def non_finite_tensors(source: ModelSource, chunk_bytes: int = SCAN_CHUNK_BYTES) -> list[str]:
    """The names of the source's floating-point tensors that hold a NaN or an infinity (`scan_weights`)."""
    return scan_weights(source, chunk_bytes)[0]


def content_fingerprint(source: ModelSource) -> str:
    """The sha256 of the source's weights' bytes: from the scan that checked them (`check_finite`), else read now."""
    return source.content_sha256 or scan_weights(source)[1]


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
