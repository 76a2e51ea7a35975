"""The model's two ends: the token embedding and the language-model head, each reached through its own call.

Both can hand their weight to a function (`through`) inside their own call instead of computing their usual
output: the chunked losses take the head's weight, and a head tied to the embedding is computed through the
embedding module. A wrapper that keeps the weight in shards (an FSDP2 unit) gathers it around each call of its module
only, so the weight is whole exactly while it is used.

Shapes in comments use B = batch size, T = sequence length, C = n_embd and V = the padded vocabulary size.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class TokenEmbedding(nn.Embedding):
    """The token embedding: vectors of token ids (B, T) -> (B, T, C), or, with `through`, a function of its weight.

    A head tied to this embedding is computed through it (`GPT.head_in_embedding`) where the weight lives in an FSDP2
    unit: a parameter belongs to one unit, and the unit gathers it around each of this module's calls only.
    """

    def forward(self, idx: torch.Tensor | None, through: Callable[[torch.Tensor], Any] | None = None) -> Any:
        """The vectors of `idx`, or with `through` what it returns when given the weight (V, C).

        A weight held in bf16 (a frozen base in a bf16 run) gives float32 vectors under autocast, as a float32 weight
        does: the residual stream stays float32 where autocast keeps it so."""
        if through is not None:
            return through(self.weight)
        assert idx is not None
        vectors = super().forward(idx)
        if vectors.dtype != torch.float32 and torch.is_autocast_enabled(vectors.device.type):
            return vectors.float()
        return vectors


class OutputHead(nn.Linear):
    """The language-model head: logits of hidden states (B, T, C) -> (B, T, V), or a function of its weight.

    The chunked losses use the weight directly rather than the logits. They are given it inside this module's own
    call (`through`), not read from the attribute: a wrapper that holds the weight in shards (an FSDP2 unit of its
    own) gathers it around the module's call, and only there is it whole.
    """

    def forward(self, x: torch.Tensor | None, through: Callable[[torch.Tensor], Any] | None = None) -> Any:
        """Logits of `x`, or with `through` what it returns when given the weight (V, C) (`x` is then unused)."""
        if through is not None:
            return through(self.weight)
        assert x is not None
        return F.linear(x, self.weight)
