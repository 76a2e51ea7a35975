"""DDP's gradients all-reduced in bf16 (`--ddp_bf16_gradients`): half the bytes between the GPUs.

DDP all-reduces each bucket of float32 gradients after the backward pass. With this hook each bucket is rounded to
bf16, divided by the number of processes (so that the sum is the mean, as DDP's own reduction gives it), summed in
bf16 across the processes and written back into the float32 bucket: the optimizer still adds float32 gradients to
float32 weights, each rounded once to bf16's 8 bits of mantissa on the way.

torch ships such a hook, but DDP accepts it only over NCCL 2.10 or later; this one runs over any backend (gloo
too, where the tests check it against the float32 all-reduce).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects (a GradBucket in, a
# Future of a Tensor out) when it is registered.
from typing import Any

import torch
import torch.distributed as dist


def bf16_all_reduce_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over the processes, all-reduced in bf16, back in the bucket's dtype."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()  # the bucket's gradients, flat, float32
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def written_back(done: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(done.value()[0])  # float32 again, where DDP reads the gradients from
        return buffer

    return future.then(written_back)


def use_bf16_gradients(model: torch.nn.Module) -> None:
    """Register `bf16_all_reduce_hook` on a DDP-wrapped model (before its first backward pass)."""
    model.register_comm_hook(state=None, hook=bf16_all_reduce_hook)  # type: ignore[operator]
