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


# ----- accelerate launch's note on --mixed_precision -------------------------------------------------------------
LAUNCHER_NOTE = ("accelerate launch's note that --mixed_precision was set to 'no' is its own default: lowmem sets "
                 "the precision itself")


def note_for(device: str, bf16: bool, bf16_on_cpu: bool = False) -> str | None:
    """The note of a run on `device` with these flags, its precision decided as create_accelerator decides it."""
    on = torch.device(device)
    mixed_precision = "bf16" if lowmem_accelerator.bf16_for(on, bf16, bf16_on_cpu) else "no"
    return lowmem_accelerator.launcher_precision_note(mixed_precision, on, bf16, bf16_on_cpu)


def test_the_launcher_s_no_is_explained_when_the_run_trains_in_bf16(monkeypatch):
    """`accelerate launch` without a config sets ACCELERATE_MIXED_PRECISION=no and prints that it did."""
    fake_cuda(monkeypatch, majors=[9])  # an H100
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert note_for("cuda:0", bf16=True) == (f"Mixed precision: bf16 (from --bf16=True). {LAUNCHER_NOTE}; "
                                             "--bf16=False trains in float32.")
    assert note_for("cpu", bf16=True, bf16_on_cpu=True).startswith(
        "Mixed precision: bf16 (from --bf16=True and --bf16_on_cpu=True). " + LAUNCHER_NOTE)
    # float32, as the launcher said: nothing to explain, on a GPU or on the CPU without --bf16_on_cpu.
    assert note_for("cuda:0", bf16=False) is None
    assert note_for("cpu", bf16=True) is None
    fake_cuda(monkeypatch, majors=[7])  # a V100: float32 whatever --bf16 says
    assert note_for("cuda:0", bf16=True) is None


def test_no_note_without_the_launcher_or_when_it_said_the_run_s_precision(monkeypatch):
    fake_cuda(monkeypatch, majors=[9])
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)  # python, torchrun: the launcher said nothing
    assert note_for("cuda:0", bf16=True) is None and note_for("cuda:0", bf16=False) is None
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # --mixed_precision bf16, or a config file's
    assert note_for("cuda:0", bf16=True) is None


def test_a_launcher_precision_the_run_does_not_use_is_named(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert note_for("cpu", bf16=True) == (
        "Mixed precision: float32 (--bf16=True is for GPUs: the CPU runs float32 unless --bf16_on_cpu=True). "
        "accelerate launch's --mixed_precision=bf16 is not used: lowmem sets the precision itself; --bf16=True "
        "trains in bf16 on GPUs that compute it natively (on the CPU with --bf16_on_cpu=True).")
    assert note_for("cpu", bf16=False).startswith("Mixed precision: float32 (from --bf16=False). ")


def test_the_note_is_logged_for_the_run_s_accelerator(monkeypatch, caplog):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    in_bf16 = types.SimpleNamespace(mixed_precision="bf16", device=torch.device("cpu"))
    in_float32 = types.SimpleNamespace(mixed_precision="no", device=torch.device("cpu"))
    with caplog.at_level("INFO", logger=lowmem_accelerator.logger.name):
        lowmem_accelerator.log_launcher_precision_note(in_bf16, bf16=True, bf16_on_cpu=True)  # type: ignore[arg-type]
        lowmem_accelerator.log_launcher_precision_note(in_float32, bf16=True)  # type: ignore[arg-type]
    assert [record.getMessage() for record in caplog.records] == [
        f"Mixed precision: bf16 (from --bf16=True and --bf16_on_cpu=True). {LAUNCHER_NOTE}; --bf16=False trains in "
        "float32."]
