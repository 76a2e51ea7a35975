"""The RMS norm of the llama architecture, in its input's dtype when its weight is held in another.

Under FSDP2's bf16 policy the final norm's weight is gathered in bf16 while its input, the residual stream the blocks
hand on, stays float32 (`lowmem.distributed.fsdp_units`). torch's `rms_norm` then warns on every rank ("Mismatch dtype
between input and weight") and falls back from its fused kernel to the composite one, which promotes the weight to
float32 anyway. Casting the weight first computes the same float32 norm through the fused kernel, without the
warning; where the dtypes agree (every other run), nothing changes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` whose weight is cast to its input's dtype where the two differ."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor | None = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)  # differentiable: the gradient comes back in the weight's dtype
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)
