"""FSDP on the CPU, in-process: where a GPU is visible, a CPU launch with fsdp.yaml is refused with a message,
and a launch without FSDP is left as Accelerate made it (FSDP2 on 3 CPU processes:
tests/integration/test_fsdp_cpu_processes.py)."""

from __future__ import annotations

import types

import pytest
import torch


def test_fsdp_on_the_cpu_of_a_machine_with_a_gpu_is_refused(monkeypatch):
    """ACCELERATE_USE_CPU=1 (or use_cpu: true) with fsdp.yaml where a GPU is visible: a message, not a run that
    would shard onto the GPU over gloo. A launch without FSDP is left as Accelerate made it."""
    from accelerate.utils import DistributedType

    from lowmem.distributed.accelerator import fsdp_on_cpu
    from lowmem.errors import ConfigError

    accelerator = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, state=types.SimpleNamespace())
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES="):
        fsdp_on_cpu(accelerator, types.SimpleNamespace(fsdp_version=2))
    fsdp_on_cpu(accelerator, None)
    assert vars(accelerator.state) == {}, "DDP on the CPU stays DDP"
