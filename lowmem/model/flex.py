"""Attention within packed rows on FlexAttention: a block mask built once per micro-batch, shared by every layer.

SDPA takes packed rows as a boolean (B, 1, T, T) mask, which rules out its flash kernel: at 4,096 tokens that
costs 2.8x plain causal attention. FlexAttention compiles the rule "same row, not a later position" into a
kernel that skips the blocks of (query, key) pairs the rule rules out, so packed rows cost about what one causal
sequence of the same length does. The block mask is that rule evaluated per block of 128 x 128 positions, built
from the micro-batch's segment ids before the first layer (compiled, on a GPU).

FlexAttention runs as a compiled kernel: inside a compiled model it is part of the graph; in an eager model
it goes through its own `torch.compile` (`_compiled_flex_attention`), as FlexAttention's unfused fallback would
materialise every score. torch has no backward for it on the CPU: there it serves evaluation only, and training
on the CPU uses SDPA (`lowmem.distributed.performance.speed_settings`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


def document_block_mask(segment_ids: torch.Tensor) -> Any:
    """The block mask of causal attention within each packed row, for `segment_ids` (B, T) (contiguous runs of
    one id per row, 0 for padding: padding attends to padding only, and always to itself, so no query is left
    with nothing to attend to)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = segment_ids.shape

    def same_row_not_later(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor,
                           key: torch.Tensor) -> torch.Tensor:
        return (segment_ids[batch, query] == segment_ids[batch, key]) & (query >= key)

    # One mask for every head (H=None): the rule does not depend on the head. In an eager model on a GPU the
    # construction is compiled too, or it would evaluate every (query, key) pair of the batch at once (a (B, T, T)
    # tensor, 134 MB at 8 x 4,096); inside a compiled model it is traced with the model.
    if segment_ids.is_cuda and not torch.compiler.is_compiling():
        return _compiled_create_block_mask()(same_row_not_later, B, None, T, T, device=segment_ids.device)
    return create_block_mask(same_row_not_later, B, None, T, T, device=segment_ids.device)


@functools.cache
def _compiled_create_block_mask() -> Callable[..., Any]:
    """`create_block_mask` compiled once per process (torch's `_compile=True` made a new compiled wrapper at every
    call, and is deprecated); each micro-batch's rule is a new closure of the same code, which needs no new
    compilation."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """FlexAttention compiled once per process (for each new shape, once); inside a compiled model the call is
    traced into the model's graph instead."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """Attention of q (B, nh, T, hs) over k, v (B, nh, T, hs) where `block_mask` allows it -> (B, nh, T, hs)."""
    if torch.compiler.is_compiling() or q.device.type == "cpu":
        from torch.nn.attention.flex_attention import flex_attention

        # Inside a compiled model the call becomes part of its graph. On the CPU (evaluation's few calls; training
        # there does not come here) no compiled kernel is needed.
        return flex_attention(q, k, v, block_mask=block_mask)
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask)


def is_block_mask(mask: Any) -> bool:
    """Whether `mask` is a FlexAttention block mask (rather than a boolean tensor, or None)."""
    return mask is not None and not isinstance(mask, torch.Tensor)
