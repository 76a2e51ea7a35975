"""Speed settings that change how fast a step runs, not what it computes: TF32 matmuls, torch.compile
(with its compile workers bounded on a low memory budget), and bf16 autocast for evaluation and generation."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, ContextManager

import torch

from lowmem.config import OptimConfig
from lowmem.distributed.accelerator import bf16_supported
from lowmem.memory.data_settings import MemorySettings

logger = logging.getLogger(__name__)
# torch.compile's inductor compiles kernels in a pool of worker processes, min(32, CPU cores) of them per
# rank by default, each a fresh interpreter with torch imported: on a low budget (three ranks on a 12 GB
# host) that alone can exhaust the host. One thread means no pool: kernels compile in the rank itself,
# more slowly, and only while the first steps compile.
LOW_MEMORY_COMPILE_THREADS = 1


def enable_tf32(on_gpu: bool) -> bool:
    """Let float32 matmuls and convolutions use TF32 on GPUs that have it (Ampere and later).

    Only float32 work is affected (under bf16 autocast most matmuls are bf16 already); TF32 keeps float32's
    range with a 10-bit mantissa, which training tolerates. Returns whether TF32 is on.
    """
    if not on_gpu or torch.cuda.get_device_capability()[0] < 8:
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def maybe_compile(model: torch.nn.Module, config: OptimConfig,
                  settings: MemorySettings | None = None) -> torch.nn.Module:
    """`torch.compile(model)` when `config.compile` is set, else the model unchanged.

    The compiled wrapper prefixes its state-dict keys with `_orig_mod.`; checkpoints are written from the
    unwrapped model, so they load with and without compilation. The first steps are slow while the graphs
    compile, and again for each new batch shape until dynamic shapes kick in.

    Args:
        model: the (prepared) model.
        config: `compile` and `compile_backend` are read.
        settings: the memory settings rank 0 decided; on a low budget the compile-worker pool is bounded
            (see `bound_compile_workers`). None leaves torch's default.
    """
    if not getattr(config, "compile", False):
        return model
    if settings is not None:
        bound_compile_workers(settings)
    logger.info("Compiling the model with torch.compile, backend %s (the first steps take longer).",
                config.compile_backend)
    # torch types compile's result as a plain callable; given a Module it returns an OptimizedModule (a Module).
    return torch.compile(model, backend=config.compile_backend)  # type: ignore[return-value]


def bound_compile_workers(settings: MemorySettings) -> int | None:
    """On a low memory budget, compile in the rank itself instead of in a pool of worker processes.

    Must run before the first compilation (the pool starts with it). A choice made through
    TORCHINDUCTOR_COMPILE_THREADS is kept. Returns the number of compile threads set, or None when
    torch's default (or the user's choice) stays.
    """
    if not (settings.low_budget or settings.ultra_low_mem) or "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return None
    import torch._inductor.config as inductor_config  # only when compiling: the import is not free

    inductor_config.compile_threads = LOW_MEMORY_COMPILE_THREADS
    logger.info("torch.compile: %d compile thread(s), no compile-worker processes (low memory budget; set "
                "TORCHINDUCTOR_COMPILE_THREADS to choose).", LOW_MEMORY_COMPILE_THREADS)
    return LOW_MEMORY_COMPILE_THREADS


def inference_autocast(device: torch.device, bf16: bool = True, bf16_on_cpu: bool = False) -> ContextManager[Any]:
    """bf16 autocast for evaluation and generation where training runs under it (`bf16_for`), else a no-op.

    Training gets its autocast from accelerate's wrapped forward. The evaluate and generate commands load a
    plain model, and `GPT.generate` does not go through forward at all: without this they would run in
    float32 (slower matmuls, a float32 key/value cache). The CPU stays in float32, as in training, unless
    `bf16_on_cpu`.

    Args:
        device: where the model runs.
        bf16: the config's `bf16`; False keeps float32 everywhere.
        bf16_on_cpu: the config's `bf16_on_cpu`.
    """
    # As `lowmem.distributed.accelerator.bf16_for` decides it for training.
    if not bf16 or not (bf16_on_cpu if device.type == "cpu" else bf16_supported(device)):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
