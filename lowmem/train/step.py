"""One optimizer step over a few micro-batches, with the loss scaled so that accumulation is exact."""

from __future__ import annotations

import math
from typing import Iterator

import torch
from accelerate import Accelerator

from lowmem.model import IGNORE_INDEX

Batch = dict[str, torch.Tensor]


def take(batches: Iterator[Batch], count: int) -> list[Batch]:
    """Up to `count` next batches (fewer at the end of the epoch)."""
    taken = []
    for batch in batches:
        taken.append(batch)
        if len(taken) == count:
            break
    return taken


def count_tokens(micro_batches: list[Batch], pad_id: int) -> tuple[int, int]:
    """(tokens the loss counts, real input tokens) in `micro_batches`."""
    targets = sum(int((batch["targets"] != IGNORE_INDEX).sum()) for batch in micro_batches)
    inputs = sum(int((batch["input_ids"] != pad_id).sum()) for batch in micro_batches)
    return targets, inputs


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, accelerator: Accelerator,
               micro_batches: list[Batch], global_target_tokens: float, grad_clip: float) -> tuple[float, float]:
    """One optimizer step over `micro_batches`; returns (this rank's summed token loss, gradient norm).

    Each micro-batch's loss is its token sum divided by the number of target tokens in the whole step on
    all ranks, so the update is the mean over every token of the step however the tokens fall into
    micro-batches and ranks. `accelerator.accumulate` skips the gradient all-reduce on all but the last
    micro-batch and divides by the number of micro-batches; DDP averages over ranks: the factor
    `micro-batches × ranks` undoes both.
    """
    scale = len(micro_batches) * accelerator.num_processes / max(global_target_tokens, 1.0)
    loss_sum = torch.zeros((), device=accelerator.device)
    grad_norm = torch.zeros(())
    for batch in micro_batches:
        with accelerator.accumulate(model):
            input_ids = batch["input_ids"].to(accelerator.device, non_blocking=True)  # (B, T)
            targets = batch["targets"].to(accelerator.device, non_blocking=True)  # (B, T)
            segment_ids = batch.get("segment_ids")  # (B, T) when rows are packed
            if segment_ids is not None:
                segment_ids = segment_ids.to(accelerator.device, non_blocking=True)
            _, mean_loss = model(input_ids, targets, segment_ids=segment_ids)
            batch_loss_sum = mean_loss * (targets != IGNORE_INDEX).sum()
            accelerator.backward(batch_loss_sum * scale)
            loss_sum += batch_loss_sum.detach()
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
                # DeepSpeed clips inside its engine and returns None here; its engine knows the norm.
                grad_norm = norm if norm is not None else _engine_grad_norm(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return float(loss_sum), float(grad_norm)


def _engine_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The gradient norm a DeepSpeed engine measured at its last step (0 when it has none)."""
    get_norm = getattr(model, "get_global_grad_norm", None)
    norm = get_norm() if callable(get_norm) else None
    return torch.as_tensor(0.0 if norm is None else float(norm))
