"""The numerics a launch trains in, named: a pass that computes values for a later run (the precomputed DPO
reference) computes them as that run will, and the run can tell when they were computed otherwise.

    float32             mixed precision off (the CPU without --bf16_on_cpu, a GPU without bf16)
    bf16 autocast       float32 weights and residual stream, bf16 matmuls (one process, DDP)
    bf16 under FSDP2    FSDP2's bf16 policy: bf16 weights, each unit computing in bf16 and handing float32 on
    bf16 under DeepSpeed  DeepSpeed's bf16: the model cast to bf16 throughout
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator

FLOAT32, AUTOCAST, FSDP2_BF16, DEEPSPEED_BF16 = "float32", "bf16 autocast", "bf16 under FSDP2", "bf16 under DeepSpeed"


def launch_precision(accelerator: Accelerator) -> str:
    """The numerics a model prepared by `accelerator` computes in (one of the module's names)."""
    from lowmem.distributed.strategy import DEEPSPEED, is_fsdp2, strategy

    if accelerator.mixed_precision != "bf16":
        return FLOAT32
    if is_fsdp2(accelerator):
        return FSDP2_BF16
    return DEEPSPEED_BF16 if strategy(accelerator) == DEEPSPEED else AUTOCAST
