"""Creating the Accelerator, and the checks that keep every rank in step."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator

from lowmem.errors import ConfigError


def bf16_supported(on_cpu: bool) -> bool:
    """True when bf16 autocast pays: a CUDA GPU with bf16.

    On the CPU it stays off: even on a Xeon with AVX-512 BF16 and AMX, the demo model's steps under CPU
    autocast took about twice as long as in float32, with a higher and growing RSS.
    """
    return not on_cpu and torch.cuda.is_bf16_supported()


def create_accelerator(gradient_accumulation_steps: int, bf16: bool) -> Accelerator:
    """An Accelerator on the GPUs if there are any, else on the CPU (gloo between processes).

    Fails loudly when the launcher started more processes than Accelerate sees: on a machine without GPUs,
    `accelerate launch --num_processes 3` starts one process unless given `--multi_gpu`, and every rank
    would silently train on all the data.
    """
    on_cpu = not torch.cuda.is_available()
    mixed_precision = "bf16" if bf16 and bf16_supported(on_cpu) else "no"
    accelerator = Accelerator(cpu=on_cpu, gradient_accumulation_steps=gradient_accumulation_steps,
                              mixed_precision=mixed_precision)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"The launcher set WORLD_SIZE={launched}, but Accelerate runs {accelerator.num_processes} process(es). "
            "On a machine without GPUs use `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N "
            "train_low_mem.py train`; on GPUs check that N GPUs are visible (CUDA_VISIBLE_DEVICES)."
        )
    return accelerator


def all_reduce_sum(accelerator: Accelerator, values: list[float]) -> list[float]:
    """Sum a few numbers over all ranks (one small collective)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        tensor = accelerator.reduce(tensor, reduction="sum")
    return tensor.tolist()


def all_reduce_max(accelerator: Accelerator, values: list[float]) -> list[float]:
    """The maximum of a few numbers over all ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        gathered = accelerator.gather(tensor.unsqueeze(0))  # (world, n)
        tensor = gathered.max(dim=0).values
    return tensor.tolist()
