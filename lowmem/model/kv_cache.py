"""The key/value cache of generation: the keys and values of positions already run, kept per attention layer, so
that each new token costs one position's work instead of a pass over the whole context (`lowmem.model.generation`
runs the loop; `lowmem.model.attention` appends to it).

Shapes in comments use B = batch size, T = sequence length, nh = n_head, hs = head size.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """Keys and values of one attention layer for the positions run so far.

    The buffers are allocated once, at the first `append`, for the longest context the generation can
    reach; each step writes its new positions in place. Concatenating instead would copy the whole cache
    at every step, which adds up to a cost quadratic in the number of generated tokens.

    Args:
        max_len: positions the buffers hold.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0  # positions filled
        self.k: torch.Tensor | None = None  # (B, nh, max_len, hs) once allocated
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the keys and values k, v (B, nh, T, hs) of the next T positions.

        Returns:
            Keys and values of every position so far, each (B, nh, length, hs): views of the buffers.
        """
        B, nh, T, hs = k.shape
        if self.k is None or self.v is None:
            self.k = k.new_empty(B, nh, self.max_len, hs)
            self.v = v.new_empty(B, nh, self.max_len, hs)
        end = self.length + T
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot append {T} after {self.length}.")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, nh, end, hs)


class KVCache:
    """Keys and values of every attention layer for the positions run so far (see `LayerKVCache`).

    Args:
        n_layer: number of transformer blocks.
        max_len: longest context the cache must hold; at most `max_seq_len`.
    """

    def __init__(self, n_layer: int, max_len: int) -> None:
        self.max_len = max_len
        self.layers = [LayerKVCache(max_len) for _ in range(n_layer)]

    @property
    def length(self) -> int:
        """Positions stored (the same in every layer between forward passes)."""
        return self.layers[0].length
