"""Rotary position embeddings (RoPE), the position scheme of the Llama-style architecture.

Instead of adding a learned position vector to each token, the queries and keys of every head are rotated
by an angle proportional to their position: the dot product of a query at position m and a key at
position n then depends on m - n only. Nothing is learned, so the model has no position table.

The layout is the one transformers' Llama uses ("rotate half"): channel i of a head pairs with channel
i + hs/2, not with its neighbour. An exported model's query and key weights therefore need no permutation.
"""

from __future__ import annotations

import torch


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines for `positions` (T,) or (B, T): each (1 or B, 1, T, head_dim), float32.

    The angles are computed in float32 whatever the model's precision: at position 1000 a bfloat16 angle
    would be off by several radians.

    Args:
        positions: the position of each token (its index in its own row).
        head_dim: channels per attention head; must be even.
        theta: the base of the frequencies; 10000 as in Llama 1 and 2.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim  # (hs/2,)
    inv_freq = 1.0 / (theta ** exponents)  # (hs/2,)
    angles = positions.float().unsqueeze(-1) * inv_freq  # (..., T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., T, hs): both halves of a pair turn by one angle
    if angles.dim() == 2:
        angles = angles.unsqueeze(0)  # (1, T, hs)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # (B or 1, 1, T, hs), broadcast over heads


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's two halves."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys x (B, nh, T, hs) by the angles of `rotary_angles`; the result has x's dtype."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)
