"""Creating the Accelerator: GPUs when there are any, else the CPU with gloo, and as many processes as launched."""

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


def requested_processes() -> int:
    """How many processes the launcher was asked for, over all machines.

    torchrun and multi-process `accelerate launch` set WORLD_SIZE (the total over all machines; on several
    machines `accelerate launch --num_processes` is that total too, and each machine starts its share). A
    single-process `accelerate launch` sets nothing, even when given `--num_processes 3` (on a machine
    without GPUs and without `--multi_gpu`), so the launcher's own command line (our parent process) is
    read as well.
    """
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    try:
        import psutil

        arguments = psutil.Process().parent().cmdline()
    except Exception:  # noqa: BLE001 - no parent information: nothing more to check
        return 1
    if not any(arg.endswith("accelerate") for arg in arguments[:2]) or "launch" not in arguments:
        return 1
    for index, arg in enumerate(arguments):
        if arg == "--num_processes" and index + 1 < len(arguments):
            return int(arguments[index + 1])
        if arg.startswith("--num_processes="):
            return int(arg.split("=", 1)[1])
    return 1


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
    launched = requested_processes()
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"The launcher was asked for {launched} processes, but Accelerate runs {accelerator.num_processes}. "
            "On a machine without GPUs use `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N "
            "train_low_mem.py train`; on GPUs check that N GPUs are visible (CUDA_VISIBLE_DEVICES). On several "
            "machines N is the total over all of them, and every machine needs --multi_gpu (or a config file "
            "from configs/accelerate/)."
        )
    return accelerator
