"""Speed settings on the GPU paths, checked on the CPU: the torch.compile worker pool on a low memory budget,
and bf16 autocast for evaluation and generation (float32 on the CPU)."""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest
import torch

from lowmem.memory.data_settings import MemorySettings, decide_memory_settings
from lowmem.model import GPT, GPTConfig
from lowmem.distributed import performance
from lowmem.distributed.performance import bound_compile_workers, inference_autocast, maybe_compile

GIB = 1024**3


def settings(low_budget: bool, ultra_low_mem: bool | None = None) -> MemorySettings:
    ultra = low_budget if ultra_low_mem is None else ultra_low_mem
    return MemorySettings(12 * GIB if low_budget else 64 * GIB, 3, ultra, 0, False, "test", low_budget=low_budget)


@pytest.fixture
def inductor_config(monkeypatch):
    """torch._inductor.config with compile_threads restored after the test, and no user choice in the environment."""
    import torch._inductor.config as config

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    with config.patch(compile_threads=7):  # a config module: its own patch restores what the test sets
        yield config


def test_memory_settings_say_when_the_budget_is_low_whatever_was_set():
    assert decide_memory_settings(None, -1, 15.0, local_processes=3, on_gpu=True, budget_gb=12).low_budget
    forced_off = decide_memory_settings(False, 2, 15.0, local_processes=3, on_gpu=True, budget_gb=12)
    assert forced_off.low_budget and not forced_off.ultra_low_mem
    assert not decide_memory_settings(None, -1, 15.0, local_processes=3, on_gpu=True, budget_gb=64).low_budget


def test_compile_workers_are_bounded_on_a_low_budget_only(inductor_config, monkeypatch):
    assert bound_compile_workers(settings(low_budget=False)) is None
    assert inductor_config.compile_threads == 7  # torch's default stays on a large host
    assert bound_compile_workers(settings(low_budget=False, ultra_low_mem=True)) == 1  # ultra-low-mem asked for
    inductor_config.compile_threads = 7
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    assert bound_compile_workers(settings(low_budget=True)) is None  # the user's choice is kept
    assert inductor_config.compile_threads == 7
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS")
    assert bound_compile_workers(settings(low_budget=True)) == 1
    assert inductor_config.compile_threads == 1  # no pool: kernels compile in the rank itself


def test_maybe_compile_bounds_the_pool_before_compiling(inductor_config):
    model = torch.nn.Linear(2, 2)
    off = types.SimpleNamespace(compile=False, compile_backend="eager")
    assert maybe_compile(model, off, settings(low_budget=True)) is model
    assert inductor_config.compile_threads == 7  # nothing compiled, nothing changed
    on = types.SimpleNamespace(compile=True, compile_backend="eager")
    assert maybe_compile(model, on) is not model  # the call without settings still works, torch's default kept
    assert inductor_config.compile_threads == 7
    compiled = maybe_compile(model, on, settings(low_budget=True))
    assert inductor_config.compile_threads == 1
    torch.testing.assert_close(compiled(torch.ones(1, 2)), model(torch.ones(1, 2)))


def test_inference_runs_in_float32_on_the_cpu():
    for bf16 in (True, False):
        assert isinstance(inference_autocast(torch.device("cpu"), bf16), contextlib.nullcontext)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, max_seq_len=16, n_layer=1, n_head=2, n_embd=16)).eval()
    prompt = torch.randint(0, 50, (1, 4))
    with inference_autocast(torch.device("cpu"), True):
        assert not torch.is_autocast_enabled("cpu")
        logits = model.next_token_logits(prompt)
        generated = model.generate(prompt, max_new_tokens=4, greedy=True)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, model.next_token_logits(prompt), rtol=0, atol=0)
    assert torch.equal(generated, model.generate(prompt, max_new_tokens=4, greedy=True))


def test_inference_uses_bf16_autocast_on_a_gpu_with_native_bf16(monkeypatch):
    monkeypatch.setattr(performance, "bf16_supported", lambda device: device.type == "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constructing a CUDA autocast without CUDA warns; it is not entered
        context = inference_autocast(torch.device("cuda", 0), bf16=True)
    assert isinstance(context, torch.autocast)
    assert context.device == "cuda" and context.fast_dtype == torch.bfloat16
    assert isinstance(inference_autocast(torch.device("cuda", 0), bf16=False), contextlib.nullcontext)
    monkeypatch.setattr(performance, "bf16_supported", lambda device: False)  # a T4 or V100: emulated bf16
    assert isinstance(inference_autocast(torch.device("cuda", 0), bf16=True), contextlib.nullcontext)


def test_the_cuda_mirror_decides_on_the_cpu_as_cuda_does_but_for_flex_attention():
    from lowmem.cli.common import resolve_config
    from lowmem.config import TrainConfig

    long_rows = dict(max_seq_len=2048, pack_rows=True, dropout=0.0)
    on_cuda = performance.speed_settings(TrainConfig(**long_rows), "cuda")
    mirrored = performance.speed_settings(TrainConfig(mirror_cuda=True, **long_rows), "cpu")
    plain = performance.speed_settings(TrainConfig(**long_rows), "cpu")
    assert (on_cuda.compile, on_cuda.static_shapes, on_cuda.attention) == (True, True, "flex")
    assert (mirrored.compile, mirrored.static_shapes, mirrored.attention) == (True, True, "sdpa")  # no CPU backward
    assert (plain.compile, plain.static_shapes) == (False, False)
    # Under FSDP, as on CUDA, compile waits for --compile=True.
    assert performance.speed_settings(TrainConfig(mirror_cuda=True), "cpu", sharded=True).compile is False
    config, _ = resolve_config(False, {"mirror_cuda": True}, demo_data=False)
    assert config.bf16_on_cpu is True  # the GPU's precision
    config, _ = resolve_config(False, {"mirror_cuda": True, "bf16_on_cpu": False}, demo_data=False)
    assert config.bf16_on_cpu is False  # a value given is kept
