"""One micro-batch of preference training: the reference's log-probabilities, then the policy's DPO loss."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from lowmem.config import TrainConfig
from lowmem.distributed.device_copies import to_device
from lowmem.preference.reference import Reference, make_reference
from lowmem.source.settle import StartingPoint


class PreferenceLoss:
    """The DPO loss of each micro-batch of a step, with `beta`, against `reference`; `sums` adds up the step's
    `DPOTerms.sums` on the device (read by the log when it writes a line)."""

    def __init__(self, reference: Reference, beta: float) -> None:
        self.reference, self.beta = reference, beta
        self.sums: torch.Tensor | None = None

    def step_figures(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor | None, int]:
        """(the step's `DPOTerms.sums`, the pairs its batches left out): what its `StepResult` carries to the log.
        The sums start again at the next step."""
        sums, self.sums = self.sums, None
        return sums, sum(int(batch["skipped_pairs"]) for batch in micro_batches)

    def micro_batch(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], input_ids: torch.Tensor,
                    targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's DPO loss summed over its pairs, detached; the surrogate to scale and call backward on).

        input_ids, targets: the batch's (2P, T) tensors, already on the device."""
        reference_logps = self.reference.log_probs(batch, input_ids, targets)  # (2P,)
        weights = to_device(batch["pair_weights"], input_ids.device)  # (P,)
        # As float32 bits: a wrapper that casts floating-point inputs to bf16 (FSDP2) leaves integers alone.
        bits = reference_logps.float().contiguous().view(torch.int32)
        sums, surrogate = model(input_ids, targets, reference_logps=bits, dpo_beta=self.beta, pair_weights=weights)
        sums = sums.detach().float()
        self.sums = sums if self.sums is None else self.sums + sums
        return sums[0], surrogate


def preference_loss(config: TrainConfig, model: torch.nn.Module, accelerator: Accelerator,
                    start: StartingPoint | None) -> PreferenceLoss | None:
    """The DPO loss of a preference run, with its reference (`make_reference`); None for any other run."""
    reference = make_reference(config, model, accelerator, start)
    return None if reference is None else PreferenceLoss(reference, config.dpo_beta)
