"""One optimizer step over a few micro-batches: the loss scaled so that accumulation is exact, and a step
whose gradients are not finite skipped on every rank."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
from accelerate import Accelerator

from lowmem.distributed.strategy import plain_tensor
from lowmem.model import IGNORE_INDEX

Batch = dict[str, torch.Tensor]


@dataclass
class StepResult:
    """One optimizer step, as this rank saw it, with the totals over every rank."""

    micro_batches: list[dict[str, torch.Tensor]]
    loss_sum: torch.Tensor  # this rank's summed token loss, on the device (float() of it waits for the GPU)
    grad_norm: float  # before clipping, over every rank
    applied: bool  # False: the gradient norm was not finite and the update was skipped, on every rank
    lr: float
    target_tokens: int  # this rank's tokens the loss counted
    input_tokens: int  # this rank's real (non-padding) input tokens
    global_target_tokens: float  # over every rank
    global_input_tokens: float


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


def count_rows(micro_batches: list[Batch]) -> int:
    """Rows in `micro_batches`: one per sequence, or, where rows are packed, one per segment of a sequence."""
    rows = 0
    for batch in micro_batches:
        segment_ids = batch.get("segment_ids")  # (B, T): 1, 2, ... for the rows of a sequence, 0 for padding
        rows += int(segment_ids.amax(dim=1).sum()) if segment_ids is not None else int(batch["input_ids"].size(0))
    return rows


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, accelerator: Accelerator,
               micro_batches: list[Batch], global_target_tokens: float,
               grad_clip: float) -> tuple[torch.Tensor, float, bool]:
    """One optimizer step over `micro_batches`.

    Returns this rank's summed token loss (a tensor on the device: reading it would wait for the GPU, so the
    training log reads it only when it writes a line), the gradient norm, and whether the update was
    applied: a step whose gradient norm is not finite (a NaN or inf anywhere, e.g. from a bf16 overflow;
    there is no GradScaler to catch it) is skipped, its gradients dropped and the weights and optimizer
    state left as they were. Gradients are all-reduced before the norm is taken, so every rank sees the
    same norm and skips the same step. Reading the norm is the step's one wait for the device.

    Each micro-batch's loss is its token sum divided by the number of target tokens in the whole step on
    all ranks, so the update is the mean over every token of the step however the tokens fall into
    micro-batches and ranks. `accelerator.accumulate` skips the gradient all-reduce on all but the last
    micro-batch and divides by the number of micro-batches; DDP averages over ranks: the factor
    `micro-batches × ranks` undoes both.
    """
    scale = len(micro_batches) * accelerator.num_processes / max(global_target_tokens, 1.0)
    loss_sum = torch.zeros((), device=accelerator.device)
    grad_norm, applied = 0.0, True
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
            if accelerator.sync_gradients:  # the last micro-batch: gradients are complete
                grad_norm = clip_and_measure(model, accelerator, grad_clip)
                applied = math.isfinite(grad_norm)
                if applied:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, applied


def clip_and_measure(model: torch.nn.Module, accelerator: Accelerator, grad_clip: float) -> float:
    """Clip the gradients to `grad_clip` (0: no clipping) and return their global norm before clipping."""
    norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    # DeepSpeed clips inside its engine and returns None here; its engine knows the norm.
    if norm is None:
        norm = _engine_grad_norm(model)
    # FSDP2 returns a DTensor: float() of it would read this rank's shard only.
    return float(plain_tensor(norm))


def _engine_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The gradient norm a DeepSpeed engine measured at its last step (0 when it has none)."""
    get_norm = getattr(model, "get_global_grad_norm", None)
    norm = get_norm() if callable(get_norm) else None
    return torch.as_tensor(0.0 if norm is None else float(norm))
