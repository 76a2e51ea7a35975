"""lowmem.distributed.accelerator on the CPU: the bf16 decision (on a stand-in CUDA machine) and the threads
DeepSpeed's CPU Adam gets. The process group's timeout is tested with 3 processes in test_distributed_gloo.py,
the FSDP2 mixed-precision policy from fsdp.yaml in test_accelerate_configs.py."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from accelerate.utils import DistributedType

from lowmem.distributed import accelerator as lowmem_accelerator


# ----- bf16 ---------------------------------------------------------------------------------------------------
def fake_cuda(monkeypatch, majors: list[int], emulates: bool = True) -> list[int]:
    """A CUDA machine whose GPU i has compute capability majors[i] (torch's emulation check says `emulates`);
    returns the GPUs whose properties were read, in order."""
    current, asked = [0], []

    @contextlib.contextmanager
    def device(which):  # torch.cuda.device: switch the current GPU for the block
        previous, current[0] = current[0], torch.device(which).index
        try:
            yield
        finally:
            current[0] = previous

    def properties(index):
        asked.append(index)
        return types.SimpleNamespace(major=majors[index])

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda index: emulates)
    return asked


def test_no_bf16_on_the_cpu():
    assert not lowmem_accelerator.bf16_supported(torch.device("cpu"))


def test_emulated_bf16_does_not_count(monkeypatch):
    """A V100 or T4 (compute capability 7): torch's default answer is True (emulation), ours is False."""
    fake_cuda(monkeypatch, majors=[7])
    assert torch.cuda.is_bf16_supported(), "the stand-in emulates bf16 as a V100 does"
    assert not lowmem_accelerator.bf16_supported(torch.device("cuda", 0))


def test_bf16_is_decided_on_the_process_own_gpu(monkeypatch):
    """Rank 1 on a machine whose GPU 0 is an A100 and GPU 1 a V100: asked of GPU 1, not of GPU 0."""
    asked = fake_cuda(monkeypatch, majors=[8, 7])
    assert not lowmem_accelerator.bf16_supported(torch.device("cuda", 1))
    assert asked == [1]
    assert lowmem_accelerator.bf16_supported(torch.device("cuda", 0))
    assert asked == [1, 0]


# ----- threads for DeepSpeed's CPU Adam -------------------------------------------------------------------------
def stub_accelerator(kind: DistributedType, offload: str = "cpu") -> types.SimpleNamespace:
    plugin = types.SimpleNamespace(offload_optimizer_device=offload)
    return types.SimpleNamespace(distributed_type=kind, num_processes=3,
                                 state=types.SimpleNamespace(deepspeed_plugin=plugin))


@pytest.fixture
def sixteen_cores(monkeypatch) -> list[int]:
    """16 CPUs for this process and 4 processes on the machine; returns the thread counts torch was given."""
    given: list[int] = []
    monkeypatch.setattr(lowmem_accelerator.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(torch, "set_num_threads", given.append)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    return given


def test_offloaded_optimizer_gets_this_process_share_of_the_cores(monkeypatch, sixteen_cores):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # accelerate launch's default
    lowmem_accelerator.offload_optimizer_threads(stub_accelerator(DistributedType.DEEPSPEED))
    assert sixteen_cores == [4]
    assert lowmem_accelerator.os.environ["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize("accelerator, omp", [
    (stub_accelerator(DistributedType.DEEPSPEED), "6"),  # the user's own choice
    (stub_accelerator(DistributedType.DEEPSPEED, offload="none"), "1"),  # the optimizer steps on the GPU
    (stub_accelerator(DistributedType.MULTI_GPU), "1"),
], ids=["users-choice", "no-offload", "ddp"])
def test_threads_are_left_alone_otherwise(monkeypatch, sixteen_cores, accelerator, omp):
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    lowmem_accelerator.offload_optimizer_threads(accelerator)
    assert sixteen_cores == [] and lowmem_accelerator.os.environ["OMP_NUM_THREADS"] == omp
