"""An optional record of what each rank trained on, for checking distributed behaviour.

Set LOWMEM_TRACE_DIR to a folder and every rank writes `trace-rank<r>.json` there at the end of training:
a hash of each row's tokens it trained on, the optimizer steps, and a checksum of its final weights.
Off by default; when off it costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

TRACE_DIR_ENV = "LOWMEM_TRACE_DIR"


def weights_checksum(model: torch.nn.Module) -> str:
    """A checksum of every parameter's bytes, in name order: equal checksums mean identical weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class TrainingTrace:
    """Collects row hashes per step when LOWMEM_TRACE_DIR is set; a no-op otherwise."""

    def __init__(self, rank: int, trace_dir: str | None = None):
        directory = trace_dir if trace_dir is not None else os.environ.get(TRACE_DIR_ENV)
        self.path = Path(directory) / f"trace-rank{rank}.json" if directory else None
        self.rank = rank
        self.rows: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def record_batch(self, input_ids: torch.Tensor, pad_id: int) -> None:
        """Remember a hash of each row's (unpadded) tokens."""
        if not self.enabled:
            return
        for row in input_ids.tolist():
            tokens = [token for token in row if token != pad_id]
            self.rows.append(hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:16])

    def finish(self, model: torch.nn.Module, steps: int) -> None:
        """Write the trace file."""
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"rank": self.rank, "steps": steps, "rows": self.rows,
                                         "weights": weights_checksum(model)}))


LEAK_ENV = "LOWMEM_TEST_LEAK_MB_PER_STEP"


class PlantedLeak:
    """Keeps LOWMEM_TEST_LEAK_MB_PER_STEP megabytes per optimizer step, to test that leaks are seen. Off by default."""

    def __init__(self) -> None:
        self.megabytes = float(os.environ.get(LEAK_ENV, "0") or 0)
        self.kept: list[bytearray] = []

    def step(self) -> None:
        if self.megabytes > 0:
            block = bytearray(int(self.megabytes * 1024 * 1024))
            block[::4096] = b"\x01" * len(block[::4096])  # touch every page so it counts in RSS
            self.kept.append(block)
