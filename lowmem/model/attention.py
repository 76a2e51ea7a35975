"""Causal self-attention of the GPT (`lowmem.model.gpt`): the projections, grouped key/value heads, rotary
positions, the SDPA kernels allowed with a mask, FlexAttention for packed rows, and the key/value cache; and the
per-segment positions and mask of packed rows.

Shapes in comments use B = batch size, T = sequence length, C = n_embd, nh = n_head, hs = C // nh.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lowmem.model.config import GPTConfig
from lowmem.model.flex import flex_attend, is_block_mask
from lowmem.model.kv_cache import LayerKVCache
from lowmem.model.rotary import apply_rotary

# The rotary cosines and sines of the positions a forward pass runs, each (B or 1, 1, T, hs); None for gpt2.
Rotary = Optional[tuple[torch.Tensor, torch.Tensor]]


# SDPA kernels allowed for attention with an explicit mask (packed rows, padded prompts) on a GPU. Flash
# attention takes no mask, so SDPA would pass it over anyway; cuDNN attention is left out on purpose: with
# a mask and T % 128 == 64 its backward returns NaN query gradients on Hopper (pytorch/pytorch#196678),
# and SDPA would otherwise prefer it there. The memory-efficient kernel takes a boolean mask and never
# materialises the (T, T) matrix (SDPA tries it first); the math kernel takes anything.
MASKED_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device, masked: bool) -> list[SDPBackend] | None:
    """The SDPA kernels attention on `device` may use, or None to leave SDPA's own choice.

    Only masked attention on CUDA is restricted (see MASKED_SDPA_BACKENDS). Plain causal attention keeps
    every kernel (flash first), and the CPU keeps its own choice: its kernels have no such bug.
    """
    return MASKED_SDPA_BACKENDS if masked and device.type == "cuda" else None


def sdpa_context(device: torch.device, masked: bool) -> ContextManager[Any]:
    """`sdpa_kernel` with the backends `sdpa_backends` chooses, or a no-op where it chooses none.

    torch.compile traces `sdpa_kernel` inside a forward: the backends are constants, baked into the graph.
    """
    backends = sdpa_backends(device, masked)
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position attends only to itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads  # fewer than n_head: grouped-query attention
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        # One matmul produces queries, keys and values for all heads at once: rows [q; k; v], the queries
        # n_head x hs wide, keys and values n_kv_head x hs each.
        self.qkv = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim,
                             bias=config.bias or config.qkv_bias)
        # Projects the concatenated heads back into the residual stream (scaled at init, see GPT._init_weights).
        self.out_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def _split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, T, heads x hs) -> (B, heads, T, hs): heads become a batch dimension for the attention kernel."""
        B, T, _ = x.shape
        return x.view(B, T, heads, self.head_dim).transpose(1, 2)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, nh, T, hs), keys and values (B, n_kv_head, T, hs) for `x` (B, T, C).

        Kept separate from the attention itself so that a key/value cache can store the k, v of earlier
        positions and append only the new ones during generation (under grouped-query attention the cache
        holds the n_kv_head heads only).
        """
        kv_width = self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([self.n_head * self.head_dim, kv_width, kv_width], dim=2)
        return (self._split_heads(q, self.n_head), self._split_heads(k, self.n_kv_head),
                self._split_heads(v, self.n_kv_head))

    def _shared_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """Keys or values (B, n_kv_head, Tk, hs) -> (B, nh, Tk, hs): key/value head j serves the n_head // n_kv_head
        consecutive query heads from j x (n_head // n_kv_head) on (transformers' layout)."""
        if self.n_kv_head == self.n_head:
            return kv
        return kv.repeat_interleave(self.n_head // self.n_kv_head, dim=1)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = True,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scaled dot-product attention of q (B, nh, Tq, hs) over k, v (B, nh, Tk, hs) -> (B, Tq, C).

        With a key/value cache, a single new query attends to every cached key, so the caller passes
        `is_causal=False` there; without a cache Tq == Tk and the causal mask applies. `attn_mask`
        (boolean, broadcastable to (B, nh, Tq, Tk), True where a query may attend to a key) replaces the
        causal mask when padding must be hidden too; pass `is_causal=False` with it.
        """
        # SDPA picks a fused (flash / memory-efficient) kernel when it can, so the (T, T) attention matrix
        # is never materialised on GPU; dropout on the attention weights only while training. With a mask,
        # the kernels it may pick on a GPU are restricted (see MASKED_SDPA_BACKENDS).
        with sdpa_context(q.device, masked=attn_mask is not None):
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal
            )  # (B, nh, Tq, hs)
        B, _, Tq, _ = y.shape
        return y.transpose(1, 2).contiguous().view(B, Tq, self.n_head * self.head_dim)  # (B, Tq, C)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        cache: LayerKVCache | None = None,
        rotary: Rotary = None,
    ) -> torch.Tensor:
        """Attention over `x` (B, T, C) -> (B, T, C).

        Args:
            x: the input of T positions.
            attn_mask: boolean (B or 1, 1, T, Tk), True where a query may attend to a key, with Tk the
                positions in the cache after appending x's; or a FlexAttention block mask of packed rows
                (`lowmem.model.flex`). None means plain causal attention with x's positions the last T of
                the Tk; then T must be Tk (no cache) or 1 (one cached step).
            cache: keys and values of the earlier positions; x's are appended.
            rotary: cosines and sines of x's positions (llama): queries and keys are rotated by them. The
                cache stores rotated keys, so a cached key keeps the angle of its own position.
        """
        q, k, v = self.project_qkv(x)  # (B, nh, T, hs); k, v (B, n_kv_head, T, hs)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cache is not None:
            k, v = cache.append(k, v)  # each (B, n_kv_head, Tk, hs): the earlier positions, then x's
        k, v = self._shared_kv(k), self._shared_kv(v)  # each (B, nh, Tk, hs)
        if is_block_mask(attn_mask):  # packed rows on FlexAttention (no cache, no dropout there)
            B, _, T, _ = q.shape
            y = flex_attend(q, k, v, attn_mask).transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        elif attn_mask is None:
            # A single query that is the newest position may see every key: no mask at all is cheapest. Without a
            # cache queries and keys align, causal at any length: the size is not compared, since under dynamic
            # shapes the comparison is symbolic, which SDPA refuses (a graph break in every compiled forward).
            causal = cache is None or q.size(2) > 1
            y = self.attend(q, k, v, is_causal=causal)  # (B, T, C)
        else:
            y = self.attend(q, k, v, is_causal=False, attn_mask=attn_mask)  # (B, T, C)
        return self.resid_dropout(self.out_proj(y))


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions (B, T) counted from the start of each segment (contiguous runs of one id)."""
    B, T = segment_ids.shape
    index = torch.arange(T, device=segment_ids.device).expand(B, T)  # (B, T)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)  # (B, T): True where a segment begins
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # (B, T)
    return index - first


def segment_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """The mask (B, 1, T, T) of causal attention within a segment. Padding (id 0) attends to padding only, and
    always to itself, so no softmax row is fully masked."""
    T = segment_ids.size(1)
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()  # (T, T)
    return (same & causal).unsqueeze(1)
