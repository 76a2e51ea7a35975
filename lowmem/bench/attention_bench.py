"""The attention benchmark: packed rows against one causal sequence of the same length, forward and backward.

Packing puts several rows side by side in one sequence; attention must then stay within each row. The cases,
each a forward and backward pass of one attention layer's kernel over (B, heads, T, head_dim) in bf16 on a GPU
(float32 on the CPU):

    causal         plain causal SDPA over the whole sequence: the floor (flash attention on a GPU)
    packed, sdpa   the rows kept apart by a boolean (B, 1, T, T) mask: SDPA cannot use flash attention
    packed, flex   the rows kept apart by FlexAttention's block mask, built once per batch (a GPU only: torch has
                   no FlexAttention backward on the CPU)

Causal attention within rows does less work than over the whole sequence, so the packed cases may beat the
floor. Training builds a micro-batch's mask once and every layer uses it, so the passes are timed with the mask
built beforehand, and the construction has rows of its own.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from lowmem.model.flex import document_block_mask, flex_attend
from lowmem.model.attention import sdpa_context, segment_mask


def packed_segments(batch: int, seq_len: int, rows_per_sequence: int) -> torch.Tensor:
    """Segment ids (B, T) of `rows_per_sequence` rows of equal length per sequence (the last one takes the rest)."""
    length = max(1, seq_len // rows_per_sequence)
    ids = torch.arange(seq_len) // length + 1
    return ids.clamp_max(rows_per_sequence).expand(batch, seq_len).contiguous()


def _time(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Milliseconds per call of `run`, after two untimed calls (compilation, autotuning)."""
    for _ in range(2):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats * 1e3


def bench_attention(seq_len: int = 4096, batch: int = 4, heads: int = 12, head_dim: int = 64,
                    rows_per_sequence: int = 8, repeats: int = 20, device: str = "") -> str:
    """Time each case's forward and backward pass and return the table, with each case against the causal floor.

    Args:
        seq_len: tokens per sequence.
        batch: sequences.
        heads, head_dim: the attention's shape (the large preset: 12 heads of 64).
        rows_per_sequence: rows packed in each sequence.
        repeats: timed passes per case.
        device: cuda or cpu (default: cuda when a GPU is visible).
    """
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device=where, dtype=dtype, requires_grad=True)
               for _ in range(3))
    segments = packed_segments(batch, seq_len, rows_per_sequence).to(where)

    boolean_mask = segment_mask(segments)  # (B, 1, T, T)

    def causal() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def packed_sdpa() -> None:
        with sdpa_context(where, masked=True):
            F.scaled_dot_product_attention(q, k, v, attn_mask=boolean_mask).sum().backward()

    cases: dict[str, Callable[[], object]] = {
        "causal (the floor)": causal, "packed rows, sdpa with a mask": packed_sdpa,
        "the boolean mask, built (once per micro-batch)": lambda: segment_mask(segments)}
    if where.type == "cuda":
        block_mask = document_block_mask(segments)

        def packed_flex() -> None:
            flex_attend(q, k, v, block_mask).sum().backward()

        cases["packed rows, flex"] = packed_flex
        cases["the block mask, built (once per micro-batch)"] = lambda: document_block_mask(segments)
    times = {name: _time(run, where, repeats) for name, run in cases.items()}
    floor = times["causal (the floor)"]
    lines = [f"bench_attention: {batch} x {seq_len} tokens, {heads} heads of {head_dim}, {rows_per_sequence} rows "
             f"per sequence, {dtype} on {where.type}"
             + (f" ({torch.cuda.get_device_name(where)})" if where.type == "cuda" else "")
             + "; one layer's forward and backward, the mask built beforehand (every layer shares it)",
             "| case | ms | vs causal |", "|---|---:|---:|"]
    lines += [f"| {name} | {ms:.3f} | {ms / floor:.2f} |" for name, ms in times.items()]
    if where.type != "cuda":
        lines.append("(packed rows, flex: a GPU only; torch has no FlexAttention backward on the CPU)")
    return "\n".join(lines)
