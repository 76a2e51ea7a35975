"""Speed settings that change how fast a step runs, not what it computes: TF32 matmuls and torch.compile."""

from __future__ import annotations

import logging

import torch

from lowmem.config import OptimConfig

logger = logging.getLogger(__name__)


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


def maybe_compile(model: torch.nn.Module, config: OptimConfig) -> torch.nn.Module:
    """`torch.compile(model)` when `config.compile` is set, else the model unchanged.

    The compiled wrapper prefixes its state-dict keys with `_orig_mod.`; checkpoints are written from the
    unwrapped model, so they load with and without compilation. The first steps are slow while the graphs
    compile, and again for each new batch shape until dynamic shapes kick in.
    """
    if not getattr(config, "compile", False):
        return model
    logger.info("Compiling the model with torch.compile, backend %s (the first steps take longer).",
                config.compile_backend)
    return torch.compile(model, backend=config.compile_backend)
