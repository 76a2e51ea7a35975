"""The language-model loss without the whole (tokens, vocabulary) logits tensor.

For a small model the logits are the largest tensor of a step by far: 32 rows of 192 tokens over a
32,000-token vocabulary are 786 MB in float32, and the plain loss path holds about three such tensors at
once (the logits, their float32 copy, the softmax gradient). `chunked_token_loss_sum` runs the language-model
head and the cross-entropy over a few thousand tokens at a time instead, and when gradients are wanted it
computes them in the same pass, chunk by chunk: the hidden states' gradient (tokens, C) and the head
weight's gradient (V, C) are kept for the backward pass, and no logits at all. The step's peak then holds
one chunk's logits, and nothing is computed twice (recomputing each chunk's logits in the backward pass
would cost a third more of the head's matmuls, the bulk of a small model's work).

The result equals the plain path's to float rounding: the same float32 log-softmax, the same weights.

torch.compile traces it with the rest of the model: the loop over chunks unrolls (the number of chunks is fixed
by the batch's shape), the autograd.Function becomes part of the graph, and inductor fuses each chunk's
log-softmax and gradient arithmetic into a few kernels instead of a pass over the (chunk, V) logits per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The label value that cross-entropy skips; collate functions use it for padding and prompt tokens.
IGNORE_INDEX = -100


def plain_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy (N,) in float32 of logits (N, V) against targets (N,); 0 where IGNORE_INDEX.

    Float32 for the softmax even when the model runs in bf16: the loss is a sum of many small terms and
    low-precision log-probabilities drift.
    """
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


def chunk_spans(size: int, chunk: int) -> list[slice]:
    """Spans of at most `chunk` positions that cover `size` positions in order: a power of two of them, of equal
    length to within one position.

    Counted in powers of two rather than stepped through the size: under torch.compile with dynamic shapes `size` is
    symbolic, and a `range` over it fixes it to the value it had (a recompilation for every new batch shape), while a
    count that doubles is settled by comparisons (the guard holds for every size that needs the same power of two):
    one graph serves each doubling of the positions, and five every size up to 16 chunks.
    """
    needed = (size + chunk - 1) // chunk
    count = 1
    while count < needed:
        count *= 2
    bounds = [(index * size) // count for index in range(count + 1)]
    return [slice(bounds[index], bounds[index + 1]) for index in range(count)]


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's where it is on (as `F.linear` would), else the input's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _chunk_loss_and_logit_grad(logits: torch.Tensor, targets: torch.Tensor,
                               weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ weights · CE over one chunk, and its gradient with respect to the chunk's logits (float32, in place).

    d(w · CE)/d logits = w · (softmax − one_hot(target)); an ignored token has w = 0 and gets no gradient.
    """
    logits = logits.float()  # (n, V): the chunk's one float32 copy, turned into its own gradient below
    safe_targets = targets.clamp_min(0)  # IGNORE_INDEX rows carry weight 0; any valid index will do
    log_norm = torch.logsumexp(logits, dim=-1)  # (n,)
    target_logit = logits.gather(1, safe_targets.unsqueeze(1)).squeeze(1)  # (n,)
    loss_sum = ((log_norm - target_logit) * weights).sum()
    grad = logits.sub_(log_norm.unsqueeze(1)).exp_().mul_(weights.unsqueeze(1))  # w · softmax, in place
    grad.scatter_add_(1, safe_targets.unsqueeze(1), -weights.unsqueeze(1))  # − w at each target
    return loss_sum, grad


def head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits hidden (..., C) · weight (V, C)ᵀ, with the head in the dtype the matmul runs in (`compute_dtype`), as the
    chunked loss takes it: without autocast the operands may differ (FSDP2's bf16 policy runs the head's unit with a
    bf16 weight while the final norm hands on float32 hidden states), and a matmul of the two fails."""
    return F.linear(hidden, weight.to(compute_dtype(hidden)))


def _head_in(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The head (V, C) in the compute dtype: the weight itself where no cast is needed, else a cast copy, as F.linear
    would make under autocast, stored transposed (a (V, C) view of (C, V) memory).

    Stored transposed because a CPU without bf16 instructions emulates the bf16 matmuls, and their speed there depends
    on the operands' layout: on an AVX2 CPU, 256 tokens against 8,000 rows of 64, the gradient of the hidden states
    (logits' gradient @ head) took 31 ms with this layout against 135 ms with the weight's, and a chunk's three matmuls
    138 ms against 222. The copy is the same size either way; GPUs take both layouts at the same speed.
    """
    if weight.dtype == dtype:
        return weight
    return torch.empty((weight.shape[1], weight.shape[0]), dtype=dtype, device=weight.device).copy_(weight.t()).t()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Σ_i w_i · CE(hidden_i · weightᵀ, target_i), with both gradients computed in the forward pass."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                weights: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        dtype = compute_dtype(hidden)
        # Every matmul below is given operands of `dtype`, so autocast, when on, casts nothing; the float32 parts are
        # elementwise, which it leaves alone. (A context turning it off would also keep a compiled graph out of AOT
        # autograd's cache.)
        head = _head_in(weight, dtype)
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)  # (N, C)
        # A frozen head (adapters train, the output layer does not) needs no gradient: neither its buffer
        # nor the third of the head's matmuls that would fill it.
        weight_grad_wanted = ctx.needs_input_grad[1]
        grad_weight = torch.zeros(weight.shape if weight_grad_wanted else (0,), dtype=torch.float32,
                                  device=weight.device)  # (V, C)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for span in chunk_spans(hidden.size(0), chunk_tokens):
            chunk = hidden[span].to(dtype)  # (n, C)
            chunk_loss, grad_logits = _chunk_loss_and_logit_grad(chunk @ head.t(), targets[span], weights[span])
            loss_sum += chunk_loss
            grad_logits = grad_logits.to(dtype)  # (n, V), a no-op in float32
            grad_hidden[span] = grad_logits @ head  # (n, C)
            if weight_grad_wanted:  # in the compute dtype, as the plain path's matmul; summed in float32
                grad_weight.add_(grad_logits.t() @ chunk)  # (V, C) += (V, n) @ (n, C)
            del grad_logits, chunk
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.hidden_dtype = hidden.dtype
        return loss_sum

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        # The loss is a scalar: the chain rule only scales the gradients computed in the forward pass. Scaled in
        # place (the backward pass runs once): a (V, C) gradient is not held twice.
        weight_grad = grad_weight.mul_(grad_output).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden.mul_(grad_output).to(ctx.hidden_dtype), weight_grad, None, None, None


def chunked_token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           weights: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Σ_i weights_i · CE(hidden_i · weightᵀ, targets_i), float32, never holding more than one chunk's logits.

    Args:
        hidden: final hidden states (N, C), one row per token.
        weight: the language-model head (V, C).
        targets: (N,) token ids; IGNORE_INDEX where `weights` must be 0.
        weights: (N,) float32 per-token weights (0 leaves a token out).
        chunk_tokens: tokens per chunk, at least 1; a chunk's logits are (chunk_tokens, V) float32.

    Returns:
        The weighted sum, a float32 scalar. Its gradients reach `hidden` and `weight` when either needs one.
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, weights, chunk_tokens)
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for span in chunk_spans(hidden.size(0), chunk_tokens):
        chunk_logits = F.linear(hidden[span], weight)  # (n, V)
        loss_sum += (plain_token_losses(chunk_logits, targets[span]) * weights[span]).sum()
    return loss_sum
