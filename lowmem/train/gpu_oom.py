"""A GPU that runs out of memory in training or validation: one paragraph that says what did not fit and the flags
that lower it, instead of CUDA's traceback; exit code 2, and the checkpoints already saved are left as they are
(nothing is written after the error)."""

from __future__ import annotations

import traceback
from types import TracebackType

import torch

from lowmem.config import TrainConfig
from lowmem.errors import LowmemError
from lowmem.memory.plan import MemoryPlan
from lowmem.program import command_line


class GpuOutOfMemoryError(LowmemError):
    """The GPU had no room for a micro-batch (torch.OutOfMemoryError), said as what to do."""


def is_out_of_memory(error: BaseException) -> bool:
    """True for the error a device allocation that does not fit raises (torch.cuda.OutOfMemoryError), also where it
    comes wrapped: torch.compile raises what fails while it compiles (inductor benchmarking kernels, the first run of
    a graph) as an error of its own, the allocation's error as its cause."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, torch.OutOfMemoryError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _in_validation(trace: TracebackType | None) -> bool:
    """True when the allocation failed inside a validation (the validator's frames are on the way down)."""
    return any(frame.f_code.co_name == "validate" for frame, _ in traceback.walk_tb(trace))


def out_of_memory_message(config: TrainConfig, plan: MemoryPlan | None, in_validation: bool,
                          resuming: bool) -> str:
    """The paragraph for a GPU out-of-memory error: the micro-batch, the plan's figure, the flags that lower it.

    Args:
        config: the run's settled config (its micro-batch and accumulation).
        plan: the memory plan the run started with, for its predicted GPU peak (None: none was made).
        in_validation: the error came from a validation's forward pass rather than a training step.
        resuming: the run continued a saved one, whose micro-batch a resume keeps unless asked.
    """
    rows, length, steps = config.batch_size_per_gpu, config.max_seq_len, config.gradient_accumulation_steps
    where = "a validation batch" if in_validation else "a training step"
    text = (f"The GPU ran out of memory in {where}: a micro-batch of {rows} rows x {length} tokens "
            f"({steps} micro-batch(es) per optimizer step) did not fit.")
    if plan is not None and plan.device_peak:
        size = f" of {plan.inputs.gpu_bytes / 2**20:,.0f} MB" if plan.inputs.gpu_bytes else ""
        text += f" The memory plan predicted a GPU peak of {plan.device_peak / 2**20:,.0f} MB{size}."
    if rows > 1:
        # The largest smaller micro-batch that divides the rows: as many rows per optimizer step in more passes.
        smaller = next(size for size in range(rows // 2, 0, -1) if rows % size == 0)
        half, double = smaller, steps * (rows // smaller)
        text += (f" Lower it with --batch_size_per_gpu={half} --gradient_accumulation_steps={double} (the same rows "
                 "per optimizer step, so the same training)")
    else:
        text += " Lower it with a shorter --max_seq_len"
    if not config.activation_checkpointing:
        text += ", or --activation_checkpointing=True (recomputes each block in the backward pass)"
    text += "."
    if resuming:
        text += " On a resume add --allow_config_change=True: a resume keeps the micro-batch it saved."
    return (text + " The checkpoints already saved are untouched: "
            f"`{command_line('train ... --is_keep_training=True')}` (your flags, and those) continues from the newest.")


def said_as_paragraph(error: BaseException, config: TrainConfig, plan: MemoryPlan | None,
                      resuming: bool) -> GpuOutOfMemoryError:
    """`error` (a GPU out-of-memory error) as the GpuOutOfMemoryError that says it in one paragraph."""
    return GpuOutOfMemoryError(out_of_memory_message(config, plan, _in_validation(error.__traceback__), resuming))
