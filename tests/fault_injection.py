"""Callbacks that tests hand to the Trainer: a trace of what was trained, and injected faults.

The test runner `tests/train_with_faults.py` builds them from these environment variables (read here,
in the tests, never by lowmem itself):

    LOWMEM_TRACE_DIR               every rank writes trace-rank<r>.json there at the end of training
    LOWMEM_STOP_AFTER_STEP         stop after this optimizer step exactly as a signal arriving during it would
    LOWMEM_TEST_STEP_SECONDS       sleep this long after every optimizer step (time to send a signal mid-epoch)
    LOWMEM_TEST_SAVE_SECONDS       sleep this long inside every checkpoint write (time to kill during a save)
    LOWMEM_TEST_LEAK_MB_PER_STEP   keep this many megabytes per optimizer step (a planted leak; "M:R" on rank R only)
    LOWMEM_TEST_NAN_AT_STEP        make optimizer step N's loss NaN ("N" on every rank, "N:R" on rank R only)
    LOWMEM_MEMORY_BUDGET_GB        the host budget each rank detects: one value, or one per local rank
    LOWMEM_TEST_BASE_MB            the interpreter's memory the plan takes instead of measuring it
    LOWMEM_TEST_PLAN_GPU_GB        the memory plan lays the run out on a GPU of this many GB (the run stays on the CPU)
                                   ("8,32,32", to check that ranks seeing different memory run rank 0's settings)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from lowmem.distributed.collectives import all_reduce_sum
from lowmem.train.callbacks import Callback, StepResult

STOP_AFTER_STEP_ENV = "LOWMEM_STOP_AFTER_STEP"


def weights_checksum(model: torch.nn.Module) -> str:
    """A checksum of every parameter's bytes, in name order: equal checksums mean identical weights. A model sharded
    by FSDP2 sums this rank's shards: runs of as many processes compare rank by rank."""
    from lowmem.model.weights import local_rows

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        local, _ = local_rows(tensor)
        digest.update(name.encode())
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def row_hashes(input_ids: torch.Tensor, pad_id: int, segment_ids: torch.Tensor | None = None) -> list[str]:
    """A hash of each row's (unpadded) tokens; packed sequences are split into their rows."""
    segments = segment_ids.tolist() if segment_ids is not None else [[1] * input_ids.size(1)] * input_ids.size(0)
    hashes = []
    for tokens_of_sequence, segments_of_sequence in zip(input_ids.tolist(), segments):
        rows: dict[int, list[int]] = {}
        for token, segment in zip(tokens_of_sequence, segments_of_sequence):
            if segment and token != pad_id:
                rows.setdefault(segment, []).append(token)
        hashes.extend(hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:16] for tokens in rows.values())
    return hashes


class TrainingTrace(Callback):
    """Writes `trace-rank<r>.json` into `trace_dir` at the end of training: a hash of each row trained on, each
    step's loss (the mean over every token of the step, all ranks) at full precision, and a checksum of the
    final weights. Every checkpoint writes it too (without the weights), so that a stopped run leaves the rows
    and losses up to its last save."""

    def __init__(self, trace_dir: str | Path) -> None:
        self.trace_dir = Path(trace_dir)
        self.rows: list[str] = []
        self.losses: dict[int, float] = {}
        self.lrs: dict[int, float] = {}

    def on_step_end(self, trainer: Any, result: StepResult) -> None:
        for batch in result.micro_batches:
            self.rows.extend(row_hashes(batch["input_ids"], trainer.tokenizer.pad_id, batch.get("segment_ids")))
        step_loss, step_tokens = all_reduce_sum(trainer.accelerator, [float(result.loss_sum), result.target_tokens])
        self.losses[trainer.state.step] = step_loss / max(step_tokens, 1.0)
        self.lrs[trainer.state.step] = result.lr

    def _write(self, trainer: Any, **extra: Any) -> None:
        rank = trainer.accelerator.process_index
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        (self.trace_dir / f"trace-rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "steps": trainer.state.step, "rows": self.rows, "losses": self.losses,
             "lrs": self.lrs, **extra}))

    def on_checkpoint_write(self, trainer: Any, folder: Path) -> None:
        self._write(trainer)

    def on_train_end(self, trainer: Any, model: torch.nn.Module) -> None:
        self._write(trainer, weights=weights_checksum(model))


class StopAfterStep(Callback):
    """Asks for a stop once `step` optimizer steps are done, as a signal during that step would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def _check(self, trainer: Any) -> None:
        if trainer.state.step >= self.step:
            trainer.request_stop(f"{STOP_AFTER_STEP_ENV}={self.step}")

    def on_train_start(self, trainer: Any) -> None:
        self._check(trainer)

    def on_step_end(self, trainer: Any, result: StepResult) -> None:
        self._check(trainer)


class SlowSteps(Callback):
    """Sleeps after every optimizer step: time for a test to send a signal mid-epoch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, trainer: Any, result: StepResult) -> None:
        time.sleep(self.seconds)


class SlowSaves(Callback):
    """Sleeps inside every checkpoint write: time for a test to kill the run during a save."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_checkpoint_write(self, trainer: Any, folder: Path) -> None:
        time.sleep(self.seconds)


class PlantedLeak(Callback):
    """Keeps `megabytes` more memory after every optimizer step, every page touched so that it counts in RSS."""

    def __init__(self, megabytes: float, rank: int | None = None) -> None:
        self.megabytes, self.rank = megabytes, rank
        self.kept: list[bytearray] = []

    def on_step_end(self, trainer: Any, result: StepResult) -> None:
        if self.rank is not None and trainer.accelerator.process_index != self.rank:
            return
        block = bytearray(int(self.megabytes * 1024 * 1024))
        block[::4096] = b"\x01" * len(block[::4096])
        self.kept.append(block)


class NonFiniteAtStep(Callback):
    """Makes the model's output NaN during optimizer step `step` (on `rank` only, or on every rank): the
    gradients of that step are then NaN on every rank once they are all-reduced."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_start(self, trainer: Any) -> None:
        from lowmem.model.weights import unwrap

        if self.rank is not None and trainer.accelerator.process_index != self.rank:
            return

        def poison(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
            if module.training and trainer.state.step + 1 == self.step:
                return output * float("nan")
            return None

        unwrap(trainer.model).ln_f.register_forward_hook(poison)


def callbacks_from_environment(environ: dict[str, str] = os.environ) -> list[Callback]:
    """The callbacks the LOWMEM_* test variables ask for (see the module's docstring)."""
    callbacks: list[Callback] = []
    if environ.get("LOWMEM_TRACE_DIR"):
        callbacks.append(TrainingTrace(environ["LOWMEM_TRACE_DIR"]))
    leak, _, leak_rank = environ.get("LOWMEM_TEST_LEAK_MB_PER_STEP", "").partition(":")
    if float(leak or 0) > 0:
        callbacks.append(PlantedLeak(float(leak), int(leak_rank) if leak_rank else None))
    if float(environ.get("LOWMEM_TEST_STEP_SECONDS", "0") or 0) > 0:
        callbacks.append(SlowSteps(float(environ["LOWMEM_TEST_STEP_SECONDS"])))
    if float(environ.get("LOWMEM_TEST_SAVE_SECONDS", "0") or 0) > 0:
        callbacks.append(SlowSaves(float(environ["LOWMEM_TEST_SAVE_SECONDS"])))
    if environ.get("LOWMEM_TEST_NAN_AT_STEP"):
        step, _, rank = environ["LOWMEM_TEST_NAN_AT_STEP"].partition(":")
        callbacks.append(NonFiniteAtStep(int(step), int(rank) if rank else None))
    if int(environ.get(STOP_AFTER_STEP_ENV, "0") or 0) > 0:
        callbacks.append(StopAfterStep(int(environ[STOP_AFTER_STEP_ENV])))
    return callbacks


def override_memory_budget(environ: dict[str, str] = os.environ) -> None:
    """Make this process detect the budget LOWMEM_MEMORY_BUDGET_GB gives its local rank."""
    text = environ.get("LOWMEM_MEMORY_BUDGET_GB", "").strip()
    if not text:
        return
    import lowmem.memory.budget as budget

    values = [float(value) for value in text.split(",")]
    rank = int(environ.get("LOCAL_RANK", environ.get("RANK", "0")))
    detected = int(values[min(rank, len(values) - 1)] * budget.GIB)
    budget.memory_budget_bytes = lambda: detected


def override_base_memory(environ: dict[str, str] = os.environ) -> None:
    """Make the memory plan take LOWMEM_TEST_BASE_MB as the interpreter's memory instead of measuring it, so that
    a test can hand the process a budget that sits between the plan with and without memory savers."""
    text = environ.get("LOWMEM_TEST_BASE_MB", "").strip()
    if not text:
        return
    import lowmem.train.memory_fit as memory_fit

    memory_fit.measure_base_bytes = lambda: int(float(text) * 2**20)


def override_plan_device(environ: dict[str, str] = os.environ) -> None:
    """Make the memory plan take the run for one on a GPU of LOWMEM_TEST_PLAN_GPU_GB (the training itself stays on the
    CPU), so that a test can see what the plan decides for a GPU: the fewest micro-batches that fit, say."""
    text = environ.get("LOWMEM_TEST_PLAN_GPU_GB", "").strip()
    if not text:
        return
    import dataclasses

    import lowmem.train.memory_fit as memory_fit

    layout_of = memory_fit.layout_of
    memory_fit.layout_of = lambda accelerator: dataclasses.replace(
        layout_of(accelerator), device="cuda", bf16=True, gpu_bytes=int(float(text) * 2**30))


def apply_test_overrides(environ: dict[str, str] = os.environ) -> None:
    """Every override the LOWMEM_* variables ask for: the budget, the interpreter's memory, the plan's device."""
    override_memory_budget(environ)
    override_base_memory(environ)
    override_plan_device(environ)
