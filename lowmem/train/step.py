"""One optimizer step over a few micro-batches: the loss scaled so that accumulation is exact, and a step
whose gradients are not finite skipped on every rank.

Nothing in a step waits for the device: the batches go to it from page-locked memory, the loss and the gradient
norm stay there as tensors, and a non-finite step is skipped by the optimizer's own kernel. The host can queue the
next step while the GPU computes this one; the training log reads the figures when it writes a line.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from accelerate import Accelerator

from lowmem.data.collate import FixedShapes
from lowmem.distributed.device_copies import to_device
from lowmem.distributed.strategy import DEEPSPEED, PLAIN, plain_tensor, strategy
from lowmem.model import IGNORE_INDEX
from lowmem.preference.loss import PreferenceLoss

Batch = dict[str, torch.Tensor]
logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """One optimizer step, as this rank saw it, with the totals over every rank."""

    micro_batches: list[dict[str, torch.Tensor]]
    # The next three are tensors on the device in training: float() or bool() of one waits for the GPU.
    loss_sum: torch.Tensor  # this rank's summed token loss
    grad_norm: torch.Tensor | float  # before clipping, over every rank
    applied: torch.Tensor | bool  # False: the gradient norm was not finite and the update was skipped, on every rank
    lr: float
    target_tokens: int  # this rank's tokens the loss counted
    input_tokens: int  # this rank's real (non-padding) input tokens
    global_target_tokens: float  # over every rank
    global_input_tokens: float
    attention_pairs: int = 0  # this rank's (query, key) pairs of attention over the rows' real lengths (MFU)
    # Preference training: this rank's `DPOTerms.sums` over the step (a tensor on the device), and the pairs its
    # batches left out because both answers were the same.
    preference_sums: torch.Tensor | None = None
    skipped_pairs: int = 0

    @property
    def cut_rows(self) -> int:
        """This rank's rows of the step cut at --max_seq_len (their end not trained), as the collate counted them."""
        return sum(int(batch["cut_rows"]) for batch in self.micro_batches if "cut_rows" in batch)


@dataclass
class StepAgreement:
    """What every rank learned in the one small collective at the start of a step."""

    target_tokens: int  # this rank's tokens the loss counts
    input_tokens: int  # this rank's real input tokens
    global_target_tokens: float  # over every rank
    global_input_tokens: float
    ranks_out: bool  # some rank ran out of rows: the epoch ends here for all
    stop: bool  # some rank was asked to stop
    global_rows: int  # rows of this step's micro-batches on every rank: not trained when the epoch ends here


def take(batches: Iterator[Batch], count: int) -> list[Batch]:
    """Up to `count` next batches (fewer at the end of the epoch)."""
    taken = []
    for batch in batches:
        taken.append(batch)
        if len(taken) == count:
            break
    return taken


def count_tokens(micro_batches: list[Batch], pad_id: int) -> tuple[int, int]:
    """(what the loss counts, real input tokens) in `micro_batches`: the target tokens, or in preference training
    the pairs (the DPO loss is a mean over pairs)."""
    targets = sum(int(batch["pair_weights"].sum()) if "pair_weights" in batch
                  else int((batch["targets"] != IGNORE_INDEX).sum()) for batch in micro_batches)
    inputs = sum(int((batch["input_ids"] != pad_id).sum()) for batch in micro_batches)
    return targets, inputs


def attention_pairs(micro_batches: list[Batch], pad_id: int) -> int:
    """The (query, key) pairs of attention the model really computes for `micro_batches`: the sum over their rows
    of L^2, each row's own length L (packed rows, by their segment ids; a padded row, by its real tokens). Counted
    on the host, where the batches are."""
    pairs = 0
    for batch in micro_batches:
        if "segment_ids" in batch:
            segments = batch["segment_ids"]  # (B, T): 1, 2, ... per packed row, 0 for padding
            B, width = segments.shape[0], int(segments.max()) + 1
            offsets = torch.arange(B).unsqueeze(1) * width  # (B, 1): each sequence's own range of counts
            lengths = torch.bincount((segments + offsets).flatten(), minlength=B * width).view(B, width)[:, 1:]
        else:
            lengths = (batch["input_ids"] != pad_id).sum(dim=1)  # (B,)
        pairs += int((lengths.long() ** 2).sum())
    return pairs


def count_rows(micro_batches: list[Batch], pad_id: int) -> int:
    """Rows in `micro_batches`: one per segment of a sequence where rows are packed, else one per sequence that
    is not padding (a row starts with its [bos]; fixed shapes add sequences of padding only)."""
    rows = 0
    for batch in micro_batches:
        if "pair_weights" in batch:  # preference rows: two sequences each, or none when left out
            rows += int(batch["pair_weights"].sum()) + int(batch["skipped_pairs"])
            continue
        segment_ids = batch.get("segment_ids")  # (B, T): 1, 2, ... for the rows of a sequence, 0 for padding
        if segment_ids is not None:
            rows += int(segment_ids.amax(dim=1).sum())
        else:
            rows += int((batch["input_ids"][:, 0] != pad_id).sum())
    return rows


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, accelerator: Accelerator,
               micro_batches: list[Batch], global_target_tokens: float,
               grad_clip: float, preference: PreferenceLoss | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `micro_batches`.

    Returns this rank's summed token loss and the gradient norm before clipping, both tensors on the device:
    reading either waits for the GPU, so the training log reads them only when it writes a line. A step whose
    gradient norm is not finite (a NaN or inf anywhere, e.g. from a bf16 overflow; there is no GradScaler to
    catch it) is skipped (`step_if_finite`): its gradients dropped and the weights and optimizer state
    left as they were. Gradients are all-reduced before the norm is taken, so every rank sees the same norm
    and skips the same step.

    Each micro-batch's loss is its token sum divided by the number of target tokens in the whole step on
    all ranks, so the update is the mean over every token of the step however the tokens fall into
    micro-batches and ranks. `accelerator.accumulate` skips the gradient all-reduce on all but the last
    micro-batch and divides by the number of micro-batches; DDP averages over ranks: the factor
    `micro-batches × ranks` undoes both.

    With `preference` (DPO) the unit is the pair instead of the token: `global_target_tokens` counts the step's
    pairs, each micro-batch's loss is its DPO loss summed over its pairs, and `preference.sums` collects the terms
    the log shows.
    """
    device = accelerator.device
    scale = len(micro_batches) * accelerator.num_processes / max(global_target_tokens, 1.0)
    loss_sum = torch.zeros((), device=device)
    grad_norm = torch.zeros((), device=device)
    for batch in micro_batches:
        with accelerator.accumulate(model):
            input_ids = to_device(batch["input_ids"], device)  # (B, T)
            targets = to_device(batch["targets"], device)  # (B, T)
            if preference is not None:
                batch_loss_sum, surrogate = preference.micro_batch(model, batch, input_ids, targets)
                accelerator.backward(surrogate * scale)
                loss_sum += batch_loss_sum
            else:
                segment_ids = batch.get("segment_ids")  # (B, T) when rows are packed
                if segment_ids is not None:
                    segment_ids = to_device(segment_ids, device)
                _, mean_loss = model(input_ids, targets, segment_ids=segment_ids)
                batch_loss_sum = mean_loss * (targets != IGNORE_INDEX).sum()
                accelerator.backward(batch_loss_sum * scale)
                loss_sum += batch_loss_sum.detach()
            if accelerator.sync_gradients:  # the last micro-batch: gradients are complete
                # A preference step whose batches held no pair on any rank has a gradient of exactly zero: it is
                # skipped as a non-finite one is, so that weight decay and the moments do not move on nothing.
                nothing = preference is not None
                if clips_in_the_optimizer(optimizer, accelerator):
                    grad_norm = gradient_norm(model)
                    step_if_finite(optimizer, grad_norm, clip_to=grad_clip, skip_zero=nothing)
                else:
                    grad_norm = clip_and_measure(model, accelerator, grad_clip)
                    step_if_finite(optimizer, grad_norm, skip_zero=nothing)
                optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def step_if_finite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, clip_to: float = 0.0,
                   skip_zero: bool = False) -> None:
    """`optimizer.step()`, skipped when `grad_norm` is not finite (or, with `skip_zero`, exactly zero): weights,
    moments and step count unchanged.

    A fused torch optimizer (the model's AdamW is fused wherever torch has the kernel) decides on the device,
    through the flag GradScaler uses for the same purpose (`found_inf`): the host never reads the norm. Any other
    optimizer (DeepSpeed's, say) has no such flag, and the norm is read on the host first. The groups decide, not
    the optimizer's defaults: a checkpoint's optimizer state brings its own groups' settings back (a run saved
    with an unfused AdamW resumes unfused).

    `clip_to` > 0 (a fused optimizer only, `clips_in_the_optimizer`): the gradients are clipped to that norm by the
    optimizer's kernel, which divides each gradient by GradScaler's `grad_scale` as it reads it, instead of by a
    pass of their own over every gradient before the step. The factor is torch's clipping factor's inverse.
    """
    inner = _fused_torch_optimizer(optimizer)
    if inner is not None:
        skip = ~torch.isfinite(grad_norm)
        if skip_zero:
            skip = skip | (grad_norm == 0)
        inner.found_inf = skip.to(torch.float32)  # type: ignore[attr-defined]
        if clip_to > 0:
            inner.grad_scale = ((grad_norm + CLIP_EPSILON) / clip_to).clamp(min=1.0)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del inner.found_inf  # type: ignore[attr-defined]
            if clip_to > 0:
                del inner.grad_scale  # type: ignore[attr-defined]
    elif math.isfinite(float(grad_norm)) and not (skip_zero and float(grad_norm) == 0):
        optimizer.step()


# torch's `clip_grad_norm_` divides the limit by the norm plus this, so that a zero norm divides by nothing.
CLIP_EPSILON = 1e-6


def _fused_torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The torch optimizer inside accelerate's wrapper when every group of it runs the fused kernel, else None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, torch.optim.Optimizer) and all(group.get("fused") for group in inner.param_groups):
        return inner
    return None


def clips_in_the_optimizer(optimizer: torch.optim.Optimizer, accelerator: Accelerator) -> bool:
    """Whether the fused optimizer's kernel clips the gradients (`step_if_finite`): on a GPU, one process or DDP,
    where the gradients are plain tensors whose norm torch takes in one pass. FSDP's sharded gradients and
    DeepSpeed's engine clip as before, and the CPU keeps torch's own clipping."""
    return (accelerator.device.type == "cuda" and strategy(accelerator) == PLAIN
            and _fused_torch_optimizer(optimizer) is not None)


def clip_and_measure(model: torch.nn.Module, accelerator: Accelerator, grad_clip: float) -> torch.Tensor:
    """Clip the gradients to `grad_clip` (0: no clipping) and return their global norm before clipping, a
    0-dimensional float32 tensor on the device (nothing waits for it)."""
    norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    # DeepSpeed clips inside its engine and returns None here; its engine knows the norm.
    if norm is None:
        norm = _engine_grad_norm(model)
    # FSDP2 returns a DTensor: its local value would be this rank's shard only.
    return plain_tensor(norm).to(device=accelerator.device, dtype=torch.float32)


def gradient_norm(model: torch.nn.Module) -> torch.Tensor:
    """The global norm of plain (unsharded, already all-reduced) gradients, a float32 tensor on their device; the
    gradients are left as they are (torch's clipping with no limit would still multiply each by 1)."""
    gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
    return torch.nn.utils.get_total_norm(gradients).to(torch.float32)


def _engine_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The gradient norm a DeepSpeed engine measured at its last step (0 when it has none)."""
    get_norm = getattr(model, "get_global_grad_norm", None)
    norm = get_norm() if callable(get_norm) else None
    return torch.as_tensor(0.0 if norm is None else float(norm))


def compile_each_shape(model: torch.nn.Module, optimizer: torch.optim.Optimizer, accelerator: Accelerator,
                       shapes: FixedShapes, pad_id: int, packed: bool) -> None:
    """Run a forward and backward pass of a micro-batch of padding in each fixed shape, before the first step.

    A compiled model then compiles both graphs now, and nothing later: without this the larger shape would be
    compiled at the first micro-batch that needs it, perhaps hours in, and the device's peak memory (the larger
    shape's) would also be met only then. Nothing is learned: no target counts (the loss and every gradient
    are 0), the gradients are dropped, the optimizer does not step, and the random state is restored. DeepSpeed
    counts every backward pass towards its accumulation steps, so there the shapes compile as they come.
    """
    kind = strategy(accelerator)
    if kind == DEEPSPEED:
        return
    started = time.perf_counter()
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # dropout draws nothing that training would have drawn
        for input_ids, targets in shapes.padding_batches(pad_id):  # nothing counts: the loss and gradients are 0
            segment_ids = torch.zeros_like(input_ids) if packed else None  # padding only: attends to padding
            # One process or DDP: nothing to all-reduce. FSDP2 reduces as usual: without it, it would keep the
            # gradients whole until the first step.
            skip_sync = accelerator.no_sync(model) if kind == PLAIN else contextlib.nullcontext()
            with skip_sync:
                _, loss = model(to_device(input_ids, accelerator.device), to_device(targets, accelerator.device),
                                segment_ids=None if segment_ids is None else to_device(segment_ids,
                                                                                      accelerator.device))
                accelerator.backward(loss)
            # Dropped after each shape: under CUDA graphs a gradient must not outlive the graph that made it.
            optimizer.zero_grad(set_to_none=True)
    if accelerator.device.type == "cuda":
        torch.cuda.synchronize()
    logger.info("Compiled the step for the batch shapes %s in %.0f s.", shapes.describe(),
                time.perf_counter() - started)
