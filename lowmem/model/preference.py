"""Direct preference optimisation (DPO): the loss over pairs of answers, computed in the model's low memory.

For a prompt x with a chosen answer c and a rejected one r, the policy π and a frozen reference π_ref,

    z = β · [(log π(c|x) − log π_ref(c|x)) − (log π(r|x) − log π_ref(r|x))],    loss = −log σ(z) = softplus(−z)

with log π(a|x) the sum of the answer's token log-probabilities (the tokens the SFT loss counts for the same row).
What TRL's users read is computed beside it: rewards/chosen = β(log π(c) − log π_ref(c)), rewards/rejected alike,
rewards/accuracy (chosen above rejected) and rewards/margin (their difference).

The answers' log-probabilities need the language-model head over every answer token. Without the whole logits
(`lowmem.model.loss`), the loss is taken in two passes over the final hidden states: the per-row sums once without
gradients (`row_token_loss_sums`, each row summed within its own span), which give the loss and dL/d(row sum) for
each row; then the weighted token loss Σ_i dL/dS_row(i) · CE_i through `chunked_token_loss_sum`, whose gradient is
the DPO loss's exactly (the weights are the derivative at this point, constants for autograd). The transformer runs
once; the head twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowmem.model.loss import IGNORE_INDEX, chunk_spans, chunked_token_loss_sum, compute_dtype, plain_token_losses

LN2 = math.log(2.0)  # the loss where policy and reference agree: z = 0


@dataclass(frozen=True)
class DPOTerms:
    """The DPO loss of a batch of pairs and what the log shows of it, each a tensor (no host read).

    loss: Σ over pairs of weight × loss (the mean with the default weights). chosen_rewards, rejected_rewards:
    β(log π − log π_ref) per pair. row_weights: for each sequence (chosen rows first, then rejected), dL/dS where S
    is its summed token cross-entropy (−log π): the weights of the surrogate whose gradient is the loss's.
    pair_weights: each pair's weight in the loss (0 for a pair of padding).
    """

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    row_weights: torch.Tensor
    pair_weights: torch.Tensor

    @property
    def accuracy(self) -> torch.Tensor:
        """The weighted share of pairs whose chosen answer gets the higher reward."""
        correct = (self.chosen_rewards > self.rejected_rewards).float()
        return (correct * self.pair_weights).sum() / self.pair_weights.sum().clamp_min(1e-12)

    @property
    def margin(self) -> torch.Tensor:
        """The weighted mean of chosen minus rejected reward."""
        margins = self.chosen_rewards - self.rejected_rewards
        return (margins * self.pair_weights).sum() / self.pair_weights.sum().clamp_min(1e-12)

    def sums(self) -> torch.Tensor:
        """(5,) float32, each summed over the pairs with their weights: the loss, rewards/chosen, rewards/rejected,
        pairs ranked right (rewards/accuracy) and the pairs' weight. Summed over micro-batches and ranks, and
        divided by the last, they are the figures TRL's users read."""
        weights = self.pair_weights
        correct = (self.chosen_rewards > self.rejected_rewards).float()
        return torch.stack([self.loss.float(), (self.chosen_rewards * weights).sum(),
                            (self.rejected_rewards * weights).sum(), (correct * weights).sum(), weights.sum()])


# The order of `DPOTerms.sums`, for whoever reads them.
SUM_FIELDS = ("loss", "chosen", "rejected", "correct", "pairs")


def dpo_terms(policy_logps: torch.Tensor, reference_logps: torch.Tensor, beta: float,
              pair_weights: torch.Tensor | None = None) -> DPOTerms:
    """The DPO loss from per-sequence answer log-probabilities (2P,): the P chosen rows first, then the P rejected
    ones, in the same order, for the policy and the reference. `pair_weights` (P,): each pair's weight in the loss
    (default 1/P: the mean; training gives 1 for a real pair and 0 for padding, and divides by the step's pairs)."""
    pairs = policy_logps.shape[0] // 2
    ratios = (policy_logps - reference_logps).float()
    chosen, rejected = beta * ratios[:pairs], beta * ratios[pairs:]
    if pair_weights is None:
        pair_weights = torch.full_like(chosen, 1.0 / max(pairs, 1))
    weights = pair_weights.to(chosen).detach()
    z = chosen - rejected
    loss = (F.softplus(-z) * weights).sum()
    # dL/dz = −σ(−z)·w; z grows with log π(c) and falls with log π(r); S = −log π.
    coefficient = beta * torch.sigmoid(-z) * weights
    return DPOTerms(loss, chosen.detach(), rejected.detach(), torch.cat([coefficient, -coefficient]).detach(),
                    weights)


@torch.no_grad()
def row_token_loss_sums(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor,
                        chunk_tokens: int) -> torch.Tensor:
    """Σ CE of each row's counted tokens (B,), float32, one chunk of logits at a time, without gradients.

    hidden: (B, T, C) final hidden states; head: (V, C); targets: (B, T) with IGNORE_INDEX where not counted. Each
    chunk's token losses fill a (B·T,) float32 vector (4 bytes a position, beside a chunk's logits of 4·V); each row
    is then summed within its own span, in the same order every time, so the sums are the same bits on every run (no
    scatter of atomic additions, whose order a GPU does not fix: an exact resume needs the same sums). The chunks
    are counted, not stepped through the batch's size (`chunk_spans`): under torch.compile a new batch shape does
    not recompile.
    """
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    # The head in the dtype the matmul runs in, as the chunked loss takes it: under FSDP2's bf16 policy the hidden
    # states come float32 out of the blocks beside a bf16 head.
    head = head.to(compute_dtype(hidden))
    chunk = _chunk(chunk_tokens, flat_targets.numel())
    losses = torch.cat([plain_token_losses(F.linear(flat_hidden[span], head), flat_targets[span])
                        for span in chunk_spans(flat_targets.numel(), chunk)])
    return losses.view(targets.shape).sum(1)


def answer_log_probs(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor,
                     chunk_tokens: int) -> torch.Tensor:
    """(B,) each row's answer log-probability, Σ log p over its counted targets, without gradients: what the
    reference gives. hidden: (B, T, C); targets: (B, T)."""
    return -row_token_loss_sums(hidden, head, targets, chunk_tokens)


def dpo_loss(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, reference_logps: torch.Tensor,
             beta: float, chunk_tokens: int,
             pair_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, DPOTerms]:
    """(the surrogate to call backward() on, the batch's DPO terms) for unpacked sequences: 2P rows of (T,) targets,
    the P chosen answers first. The surrogate's value is the weighted token loss, not the DPO loss: its gradient
    is the DPO loss's; `DPOTerms.loss` is the loss itself.

    hidden: (2P, T, C) final hidden states with gradients; head: the language-model head (V, C); targets: (2P, T);
    reference_logps: (2P,) the reference's answer log-probabilities; pair_weights: as `dpo_terms`'s.
    """
    sums = row_token_loss_sums(hidden.detach(), head.detach(), targets, chunk_tokens)
    terms = dpo_terms(-sums, reference_logps, beta, pair_weights)
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    weights = (terms.row_weights[:, None] * (targets != IGNORE_INDEX).float()).reshape(-1)
    chunk = _chunk(chunk_tokens, len(flat_hidden))
    return chunked_token_loss_sum(flat_hidden, head, flat_targets, weights, chunk), terms


def _chunk(chunk_tokens: int, positions: int) -> int:
    """Positions per chunk of logits: `chunk_tokens`, or every position at once where it is 0 (whole logits)."""
    return chunk_tokens or positions or 1
