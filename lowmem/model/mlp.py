"""The position-wise feed-forward networks of a block: GPT-2's GELU MLP and Llama's SwiGLU.

Shapes in comments use B = batch size, T = sequence length, C = n_embd and H = the hidden width.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowmem.model.config import GPTConfig


class MLP(nn.Module):
    """Position-wise feed-forward network: widen 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.act = nn.GELU()
        # Writes into the residual stream (scaled at init, see GPT._init_weights).
        self.out_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = self.act(self.fc(x))  # (B, T, 4C)
        return self.dropout(self.out_proj(x))  # (B, T, C)


class SwiGLU(nn.Module):
    """The Llama-style feed-forward network: SiLU(gate(x)) * up(x), projected back.

    The gate lets each hidden unit scale its own value; at the same parameter count (see
    `GPTConfig.mlp_hidden`) it trains to a lower loss than a GELU MLP in the PaLM and Llama reports.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.up = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        # Writes into the residual stream (scaled at init, see GPT._init_weights).
        self.out_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) -> (B, T, C)."""
        x = F.silu(self.gate(x)) * self.up(x)  # (B, T, H)
        return self.dropout(self.out_proj(x))  # (B, T, C)
