"""gpu_check's stages for the paths of a training step that the CPU runs otherwise than a GPU, each ending in one
PASS or FAIL line:

    fused_clip      clipping inside the fused AdamW's kernel against torch's clip_grad_norm_ and AdamW, and a step
                    with a NaN gradient skipped by the kernel (weights, moments and step count unchanged)
    ddp_hook        a one-process DDP group (NCCL on a GPU) with 1 MB buckets and the bf16 all-reduce hook: the
                    gradients are the plain model's rounded to bf16
    copy_reference  the frozen DPO copy, its block matrices in bf16, gives the policy's own log-probabilities under
                    bf16 autocast
"""

from __future__ import annotations

import copy
from typing import Any

from lowmem.gpucheck.paths import device_of, dpo_batch, one_process_group, tiny_gpt
from lowmem.gpucheck.runs import StageFailed


def _loss(model: Any, device: Any, seed: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (4, 64), generator=generator).to(device)
    return model(ids, ids.roll(-1, dims=1))[1]


def fused_clip(settings: Any) -> dict[str, Any]:
    """Three steps clipped to a norm of 0.5 by the fused AdamW's kernel (`step_if_finite`) against torch's
    `clip_grad_norm_` then an unfused AdamW, float32; then a step whose gradient holds a NaN, skipped."""
    import torch

    from lowmem.train.step import step_if_finite

    device = device_of(settings)
    fused_model = tiny_gpt(device)
    plain_model = copy.deepcopy(fused_model)
    fused = torch.optim.AdamW(fused_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for seed in range(3):
        for model in (fused_model, plain_model):
            model.zero_grad(set_to_none=True)
            _loss(model, device, seed).backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in fused_model.parameters()]))
        step_if_finite(fused, norm, clip_to=0.5)
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.5)
        plain.step()
    difference = max((a - b).abs().max().item() for a, b in zip(fused_model.parameters(), plain_model.parameters()))
    before = [p.detach().clone() for p in fused_model.parameters()]
    steps = [state["step"].item() for state in fused.state.values()]
    fused_model.zero_grad(set_to_none=True)
    _loss(fused_model, device, 3).backward()
    next(iter(fused_model.parameters())).grad.view(-1)[0] = float("nan")
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in fused_model.parameters()]))
    step_if_finite(fused, norm, clip_to=0.5)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, fused_model.parameters()))
    steps_after = [state["step"].item() for state in fused.state.values()]
    figures = {"largest_weight_difference": difference, "nan_step_skipped": unchanged and steps_after == steps}
    if difference > 1e-5:
        raise StageFailed(f"the fused AdamW's clipped steps differ from torch's by {difference:.2e} (tolerance 1e-5)")
    if not figures["nan_step_skipped"]:
        raise StageFailed("a step with a NaN gradient moved the weights or the step count")
    return figures


def ddp_hook(settings: Any) -> dict[str, Any]:
    """A one-process DDP group with 1 MB buckets and `bf16_all_reduce_hook`: every gradient equals the plain model's
    rounded to bf16 (one process: the all-reduce adds nothing); the buckets DDP made are in the figures."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from lowmem.distributed.gradient_hooks import use_bf16_gradients

    device = device_of(settings)
    model = tiny_gpt(device)
    plain = copy.deepcopy(model)
    _loss(plain, device, 0).backward()
    with one_process_group(device):
        wrapped = DistributedDataParallel(model, bucket_cap_mb=1, device_ids=[device] if device.type == "cuda"
                                          else None)
        use_bf16_gradients(wrapped)
        _loss(wrapped, device, 0).backward()
        logged = wrapped._get_ddp_logging_data()
    worst = max((a.grad - b.grad.to(torch.bfloat16).float()).abs().max().item()
                for a, b in zip(model.parameters(), plain.parameters()))
    figures = {"bucket_cap_bytes": logged.get("bucket_cap_bytes"), "bucket_sizes": logged.get("bucket_sizes"),
               "largest_difference_from_bf16_rounding": worst}
    if worst > 0:
        raise StageFailed(f"the hooked gradients differ from the plain ones rounded to bf16 by {worst:.2e}")
    return figures


def copy_reference(settings: Any) -> dict[str, Any]:
    """The frozen copy of `--dpo_reference=copy`, its block matrices halved (`halve_block_matrices`), against the
    policy it was copied from, both under bf16 autocast: the same answer log-probabilities."""
    import torch

    from lowmem.preference.reference import halve_block_matrices

    device = device_of(settings)
    policy = tiny_gpt(device).eval()
    frozen = copy.deepcopy(policy)
    halve_block_matrices(frozen)
    input_ids, targets, _, _ = dpo_batch(3, 96, 0, device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        ours = policy(input_ids, targets, answer_logps=True)[0].float()
        theirs = frozen(input_ids, targets, answer_logps=True)[0].float()
    difference = (ours - theirs).abs().max().item()
    figures = {"sequences": len(ours), "largest_difference": difference}
    if difference > 1e-4:
        raise StageFailed(f"the bf16 copy's log-probabilities differ from the policy's by {difference:.2e} nats")
    return figures


STAGES = {"fused_clip": fused_clip, "ddp_hook": ddp_hook, "copy_reference": copy_reference}
