"""DDP's gradient all-reduce as `--ddp_bucket_cap_mb` and `--ddp_bf16_gradients` set it (`DdpSettings`, the handler
Accelerate builds DDP from, and lowmem's bf16 hook): with 3 processes on gloo, gradients all-reduced in bf16 equal
those all-reduced in float32 to bf16's rounding, and differ from them (the hook runs); in float32, bucket sizes change
nothing."""

from __future__ import annotations


import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks

WORLD = 3


def _gradients(settings, bf16_run: bool, rank: int) -> dict[str, torch.Tensor]:
    """The all-reduced gradients of a small GPT on this rank's own batch, DDP built from the settings' handler as
    Accelerate builds it, and the hook registered where the run would (`prepare_model_and_optimizer`)."""
    from types import SimpleNamespace

    from torch.nn.parallel import DistributedDataParallel

    from lowmem.distributed.gradient_hooks import use_bf16_gradients
    from lowmem.model import GPT, GPTConfig

    torch.manual_seed(0)  # the same weights on every rank
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=32, n_layer=2, n_head=2, n_embd=64, architecture="llama"))
    ddp = DistributedDataParallel(model, **settings.handler().to_kwargs())
    if settings.compresses(SimpleNamespace(mixed_precision="bf16" if bf16_run else "no")):
        use_bf16_gradients(ddp)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank's own rows
    ids = torch.randint(0, 128, (4, 32), generator=generator)
    _, loss = ddp(ids, ids)
    loss.backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def _rank_main(rank: int, port: int, results) -> None:
    from lowmem.distributed.accelerator import DdpSettings

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        exact = _gradients(DdpSettings(), bf16_run=True, rank=rank)
        small_buckets = _gradients(DdpSettings(bucket_cap_mb=1), bf16_run=True, rank=rank)
        compressed = _gradients(DdpSettings(bf16_gradients=True), bf16_run=True, rank=rank)
        not_bf16_run = _gradients(DdpSettings(bf16_gradients=True), bf16_run=False, rank=rank)
        results[rank] = {
            "buckets_equal": all(torch.equal(small_buckets[name], exact[name]) for name in exact),
            "not_bf16_equal": all(torch.equal(not_bf16_run[name], exact[name]) for name in exact),
            "compressed_differs": any(not torch.equal(compressed[name], exact[name]) for name in exact),
            # Rounding each rank's gradient and the sum to bf16 (8 bits of mantissa): a few parts in 256.
            "largest_relative": max(float((compressed[name] - exact[name]).abs().max()
                                          / exact[name].abs().max().clamp_min(1e-12)) for name in exact),
        }
    finally:
        dist.destroy_process_group()


def test_bf16_gradients_equal_float32_ones_to_bf16_rounding_and_buckets_change_nothing():
    results = run_on_ranks(_rank_main, WORLD)
    for rank in range(WORLD):
        figures = results[rank]
        assert figures["buckets_equal"] and figures["not_bf16_equal"], figures
        assert figures["compressed_differs"], figures
        assert figures["largest_relative"] < 2 ** -6, figures
