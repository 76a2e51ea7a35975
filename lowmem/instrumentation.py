"""Instrumentation for tests, switched on through environment variables and off (costing nothing) by default.

LOWMEM_TRACE_DIR: every rank writes `trace-rank<r>.json` there at the end of training: a hash of each row's
tokens it trained on, each step's loss at full precision, and a checksum of its final weights.
LOWMEM_TEST_*: see `TestHooks`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
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
        self.losses: dict[int, float] = {}

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def record_batch(self, input_ids: torch.Tensor, pad_id: int, segment_ids: torch.Tensor | None = None) -> None:
        """Remember a hash of each row's (unpadded) tokens; packed sequences are split into their rows."""
        if not self.enabled:
            return
        segments = segment_ids.tolist() if segment_ids is not None else [[1] * input_ids.size(1)] * input_ids.size(0)
        for tokens_of_sequence, segments_of_sequence in zip(input_ids.tolist(), segments):
            rows: dict[int, list[int]] = {}
            for token, segment in zip(tokens_of_sequence, segments_of_sequence):
                if segment and token != pad_id:
                    rows.setdefault(segment, []).append(token)
            for tokens in rows.values():
                self.rows.append(hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:16])

    def record_loss(self, step: int, loss: float) -> None:
        """Remember a step's loss (the mean over every token of the step, all ranks), at full precision."""
        if self.enabled:
            self.losses[step] = loss

    def finish(self, model: torch.nn.Module, steps: int) -> None:
        """Write the trace file."""
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"rank": self.rank, "steps": steps, "rows": self.rows,
                                         "losses": self.losses, "weights": weights_checksum(model)}))


class TestHooks:
    """Behaviour that tests switch on through environment variables; all off by default.

    LOWMEM_TEST_LEAK_MB_PER_STEP: keep this many megabytes per optimizer step (a planted leak).
    LOWMEM_TEST_STEP_SECONDS: sleep this long after every optimizer step (time to send a signal mid-epoch).
    LOWMEM_TEST_SAVE_SECONDS: sleep this long inside every checkpoint write (time to kill during a save).
    """

    def __init__(self) -> None:
        self.leak_megabytes = float(os.environ.get("LOWMEM_TEST_LEAK_MB_PER_STEP", "0") or 0)
        self.step_seconds = float(os.environ.get("LOWMEM_TEST_STEP_SECONDS", "0") or 0)
        self.save_seconds = float(os.environ.get("LOWMEM_TEST_SAVE_SECONDS", "0") or 0)
        self.kept: list[bytearray] = []

    def after_step(self) -> None:
        if self.leak_megabytes > 0:
            block = bytearray(int(self.leak_megabytes * 1024 * 1024))
            block[::4096] = b"\x01" * len(block[::4096])  # touch every page so it counts in RSS
            self.kept.append(block)
        if self.step_seconds > 0:
            time.sleep(self.step_seconds)

    def during_save(self) -> None:
        if self.save_seconds > 0:
            time.sleep(self.save_seconds)
