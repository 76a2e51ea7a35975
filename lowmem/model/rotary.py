"""Rotary position embeddings (RoPE), the position scheme of the Llama-style architecture.

Instead of adding a learned position vector to each token, the queries and keys of every head are rotated
by an angle proportional to their position: the dot product of a query at position m and a key at
position n then depends on m - n only. Nothing is learned, so the model has no position table.

The layout is the one transformers' Llama uses ("rotate half"): channel i of a head pairs with channel
i + hs/2, not with its neighbour. An exported model's query and key weights therefore need no permutation.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                        device: torch.device | None = None) -> torch.Tensor:
    """The angle per position of each channel pair, (head_dim / 2,) float32: theta^(-2i / head_dim), scaled.

    Scalings, as the models that carry them define them (a model started from one keeps its own):
    - "linear": every frequency divided by `factor` (positions stretched by it);
    - "llama3" (Llama 3.1 and later): pairs that turn slower than once per `original_max_position_embeddings /
      low_freq_factor` positions are divided by `factor`, those faster than once per `... / high_freq_factor` are
      kept, and those between blend the two smoothly.
    """
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim  # (hs/2,)
    inv_freq = 1.0 / (theta ** exponents)  # (hs/2,)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    old_context = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelength = 2 * math.pi / inv_freq  # positions per turn
    slow = wavelength > old_context / low
    fast = wavelength < old_context / high
    blend = (old_context / wavelength - low) / (high - low)  # 0 at the slow edge, 1 at the fast one
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    return torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, blended))


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float,
                  scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines for `positions` (T,) or (B, T): each (1 or B, 1, T, head_dim), float32.

    The angles are computed in float32 whatever the model's precision: at position 1000 a bfloat16 angle
    would be off by several radians.

    Args:
        positions: the position of each token (its index in its own row).
        head_dim: channels per attention head; must be even.
        theta: the base of the frequencies; 10000 as in Llama 1 and 2.
        scaling: the model's rotary scaling, if any (`inverse_frequencies`).
    """
    inv_freq = inverse_frequencies(head_dim, theta, scaling, positions.device)  # (hs/2,)
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
