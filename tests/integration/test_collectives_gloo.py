"""The small host-side collectives: with processes on GPUs they go through a gloo group of their own, so that
reading the result back never waits for the GPU. Run here with 3 processes on gloo, the device faked."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks

WORLD = 3


def _rank_main(rank: int, port: int, results) -> None:
    from lowmem.distributed import collectives

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        # As the trainer's Accelerator looks on a GPU machine; torch.device("cuda") needs no GPU to exist.
        on_gpu = SimpleNamespace(num_processes=WORLD, device=torch.device("cuda"), process_index=rank)
        group = collectives.host_group(on_gpu)
        assert group is not None and group is collectives.host_group(on_gpu), "one group, created once"
        assert dist.get_backend(group) == "gloo" and dist.get_world_size(group) == WORLD
        summed = collectives.all_reduce_sum(on_gpu, [1.0, float(rank), 0.5])
        largest = collectives.all_reduce_max(on_gpu, [float(rank), -float(rank)])
        on_cpu = SimpleNamespace(num_processes=WORLD, device=torch.device("cpu"), process_index=rank)
        results[rank] = (summed, largest, collectives.host_group(on_cpu) is None,
                         collectives.all_reduce_sum(on_cpu, [2.0]))
    finally:
        dist.destroy_process_group()


def test_host_collectives_sum_and_max_over_every_rank_through_gloo():
    results = run_on_ranks(_rank_main, WORLD)
    for rank in range(WORLD):
        summed, largest, cpu_uses_default, cpu_sum = results[rank]
        assert summed == [3.0, 3.0, 1.5]
        assert largest == [2.0, 0.0]
        assert cpu_uses_default and cpu_sum == [6.0]
