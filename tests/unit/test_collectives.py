"""The small host-side collectives with one process: no gloo group is made, and the values come back as they
are (3 processes on gloo: tests/integration/test_collectives_gloo.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def test_one_process_needs_no_group():
    from lowmem.distributed import collectives

    alone = SimpleNamespace(num_processes=1, device=torch.device("cuda"), process_index=0)
    assert collectives.host_group(alone) is None
    assert collectives.all_reduce_sum(alone, [1.5, 2.0]) == [1.5, 2.0]
