"""Distributed behaviour that shows on the CPU: 3 processes on gloo, forked from a preloaded server (gloo_ranks.py).

- FSDP2's gradient norm: `clip_grad_norm_` on a `fully_shard`-ed GPT returns a DTensor, and
  `lowmem.distributed.strategy.plain_tensor` of it is a plain tensor equal to the norm DDP measures on the
  same step.
- The process group's timeout: `create_accelerator` gives the group the timeout it is asked for.
- The memory savers under DDP + torch.compile and under FSDP2: the chunked loss and activation checkpointing
  give the gradients of the plain DDP step.

Each rank writes what it measured to a JSON file that the test reads once all of them have finished.
"""

from __future__ import annotations

import copy
import json
import math
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import free_port, start_ranks

WORLD = 3


def launcher_environment(rank: int, port: int) -> None:
    """What `accelerate launch` / torchrun give each process, for 3 processes on this machine."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)  # 3 processes on a small machine


def run_ranks(worker, folder: Path, *args) -> list[dict]:
    """Run `worker(rank, port, folder, *args)` in 3 processes; return what each rank wrote, by rank."""
    start_ranks(worker, (free_port(), folder, *args), WORLD)
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


# ----- FSDP2's gradient norm ----------------------------------------------------------------------------------
def tiny_gpt():
    from lowmem.model import GPT, GPTConfig

    torch.manual_seed(0)  # the same weights on every rank, as after DDP's broadcast
    return GPT(GPTConfig(vocab_size=96, max_seq_len=16, n_layer=2, n_head=2, n_embd=32))


def grad_norm_worker(rank: int, port: int, folder: Path) -> None:
    """One step on this rank's own batch, under DDP and under FSDP2: the norm of the averaged gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial
    from torch.nn.parallel import DistributedDataParallel

    from lowmem.distributed.strategy import plain_tensor

    launcher_environment(rank, port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        reference = tiny_gpt()
        sharded = copy.deepcopy(reference)
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own rows
        tokens = torch.randint(0, 96, (4, 16), generator=generator)  # (B, T)

        ddp = DistributedDataParallel(reference)
        _, loss = ddp(tokens, tokens)
        loss.backward()
        ddp_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), math.inf)

        for block in sharded.blocks:  # one FSDP unit per block, and the rest in the root's, as fsdp.yaml has it
            fully_shard(block)
        fully_shard(sharded)
        _, loss = sharded(tokens, tokens)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), math.inf)
        full = plain_tensor(norm)

        # A DTensor whose reduction is still pending (Partial: the global value is the sum of the ranks'):
        # what a norm is before it is replicated. Its local part is this rank's share only.
        partial = DTensor.from_local(torch.tensor(float(rank + 1)), init_device_mesh("cpu", (WORLD,)), [Partial()])
        partial_full = plain_tensor(partial)
        result = {"is_dtensor": isinstance(norm, DTensor), "placements": str(getattr(norm, "placements", "")),
                  "full_is_plain": not isinstance(full, DTensor), "full": float(full), "ddp": float(ddp_norm),
                  "float": float(norm), "partial_local": float(partial.to_local()),
                  "partial_full_is_plain": not isinstance(partial_full, DTensor), "partial_full": float(partial_full)}
        (folder / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore")
def test_fsdp2_grad_norm_in_full_equals_the_ddp_norm(tmp_path):
    """On every rank the norm the training step logs (plain_tensor of clip_grad_norm_) is DDP's global norm.

    torch 2.13 returns the norm already replicated (so float() of the DTensor reads the global value too);
    plain_tensor does not rely on it: a DTensor whose reduction is pending comes back reduced, as a plain
    tensor, where its local part is only this rank's share."""
    results = run_ranks(grad_norm_worker, tmp_path)
    for rank, result in enumerate(results):
        assert result["is_dtensor"], f"rank {rank}: FSDP2's clip_grad_norm_ returned a plain tensor"
        assert result["full_is_plain"] and result["full"] == pytest.approx(result["ddp"], rel=1e-5), (rank, result)
        assert result["partial_local"] == rank + 1, "the local part of a Partial DTensor: this rank's share"
        assert result["partial_full_is_plain"] and result["partial_full"] == 1 + 2 + 3, (rank, result)


# ----- the process group's timeout ------------------------------------------------------------------------------
def timeout_worker(rank: int, port: int, folder: Path, minutes: float) -> None:
    """Create the run's Accelerator as the trainer does and read the timeout its process group got."""
    launcher_environment(rank, port)
    from lowmem.distributed.accelerator import create_accelerator

    accelerator = create_accelerator(1, bf16=True, process_group_timeout_minutes=minutes)
    group = dist.distributed_c10d._get_default_group()
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    result = {"backend": dist.get_backend(), "processes": accelerator.num_processes,
              "timeout_s": timeout.total_seconds(), "mixed_precision": accelerator.mixed_precision}
    (folder / f"rank{rank}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore")
def test_the_process_group_gets_the_configured_timeout(tmp_path):
    """10 minutes is NCCL's default, which accelerate's InitProcessGroupKwargs.to_kwargs() would drop (gloo
    would then keep its own 30): it must arrive all the same."""
    results = run_ranks(timeout_worker, tmp_path, 10.0)
    for result in results:
        assert result["backend"] == "gloo" and result["processes"] == WORLD
        assert result["timeout_s"] == timedelta(minutes=10).total_seconds()
        assert result["mixed_precision"] == "no", "no bf16 on the CPU"


# ----- the memory savers under DDP + torch.compile and under FSDP2 -----------------------------------------------
def full_grads(model: torch.nn.Module) -> dict[str, list[float]]:
    """Every parameter's whole gradient (an FSDP2 shard gathered), under the plain model's names."""
    from lowmem.distributed.strategy import plain_tensor
    from lowmem.model.weights import strip_prefixes

    return {strip_prefixes(name): plain_tensor(param.grad).flatten().tolist()
            for name, param in model.named_parameters()}


def memory_savers_worker(rank: int, port: int, folder: Path) -> None:
    """Two steps' gradients (no optimizer: the same weights) under plain DDP, under DDP compiled with
    checkpointing and the chunked loss, and under FSDP2 with both."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    launcher_environment(rank, port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        generator = torch.Generator().manual_seed(100 + rank)
        tokens = torch.randint(0, 96, (4, 16), generator=generator)  # (B, T)

        def grads_of(model: torch.nn.Module) -> dict[str, list[float]]:
            for _ in range(2):  # the second backward is where a hook that fires twice would fail
                _, loss = model(tokens, tokens)
                loss.backward()
            return full_grads(model)

        plain = grads_of(DistributedDataParallel(tiny_gpt()))
        # aot_eager runs AOTAutograd, where the recomputation is traced, without inductor's C++ build.
        compiled = torch.compile(DistributedDataParallel(tiny_gpt().use_memory_savers(24, True)), backend="aot_eager")
        sharded = tiny_gpt().use_memory_savers(24, True)
        for block in sharded.blocks:
            fully_shard(block)
        fully_shard(sharded)
        result = {"plain": plain, "compiled_ddp": grads_of(compiled), "fsdp2": grads_of(sharded)}
        (folder / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore")
def test_memory_savers_give_ddps_gradients_under_compile_and_under_fsdp2(tmp_path):
    """DDP + torch.compile + activation checkpointing is a known crash in older torch ("marked as ready
    twice"); here it runs, and with the chunked loss it gives plain DDP's gradients, as FSDP2 does."""
    for rank, result in enumerate(run_ranks(memory_savers_worker, tmp_path)):
        for variant in ("compiled_ddp", "fsdp2"):
            assert result[variant].keys() == result["plain"].keys(), (rank, variant)
            for name, expected in result["plain"].items():
                assert result[variant][name] == pytest.approx(expected, rel=1e-5, abs=1e-6), (rank, variant, name)


# ----- a log line's figures over the ranks ----------------------------------------------------------------------
def step_log_worker(rank: int, port: int, folder: Path) -> None:
    """Two steps with this rank's own loss and token counts, then one log line; what its figures say."""
    import types

    from lowmem.train.callbacks import StepResult
    from lowmem.train.log import StepLog

    launcher_environment(rank, port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        ballast = bytearray((rank + 1) * 64 * 2**20)  # the ranks' RSS differ by 64 MB each
        ballast[::4096] = b"\1" * len(ballast[::4096])  # touched: counted in RSS
        step_log = StepLog(types.SimpleNamespace(num_processes=WORLD, device=torch.device("cpu")), 2, every=2)
        tokens = 100 * (rank + 1)
        for _ in range(2):
            step_log.add(StepResult([], torch.tensor(float(rank + 1) * tokens), 1.0, True, 1e-3, tokens, tokens,
                                    0.0, 0.0))
        figures = step_log.write(2, 0, 1e-3)
        (folder / f"rank{rank}.json").write_text(json.dumps(vars(figures)))
        del ballast
    finally:
        dist.destroy_process_group()


def test_a_log_lines_loss_and_memory_figures_are_over_every_rank(tmp_path):
    results = run_ranks(step_log_worker, tmp_path)
    # Token-weighted: (1·100 + 2·200 + 3·300) / (100 + 200 + 300).
    assert all(result["loss"] == pytest.approx(1400 / 600) for result in results), results
    own = [result["rss_mb"] for result in results]
    assert own[2] - own[0] > 100, own  # the ballast shows
    for result in results:
        assert result["rss_max_mb"] == pytest.approx(max(own)), (own, result)
        assert result["rss_sum_mb"] == pytest.approx(sum(own)), (own, result)
