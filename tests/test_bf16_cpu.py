"""The GPU's precision on the CPU: `--bf16_on_cpu=True` trains under bf16 autocast there, so the bf16 paths
(the model under autocast, the chunked loss, validation, checkpoints and resume) run without a GPU.

bf16 keeps 8 bits of mantissa: each rounding is good to about 0.4% (2**-8). The chunked and whole losses
multiply the same bf16 operands, in matmuls of other shapes (and so other summation orders), then both take
the softmax in float32: their losses and gradients agree to 1% (rtol=1e-2), where float32 agrees to 1e-6.
A resume on the same machine replays the same operations in the same order: the same losses to 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from training_helpers import (assert_losses_match, kill_all, resume_chat_data, resumed_from, start_run,
                              traced_losses, traced_run, wait_for_step)

from lowmem.distributed.accelerator import bf16_for
from lowmem.model import GPT, IGNORE_INDEX, GPTConfig
from lowmem.train.performance import inference_autocast

SHORT = ("--epochs=1", "--max_steps=30", "--save_steps=10")  # 30 steps, a save every 10
BF16 = ("--bf16_on_cpu=True", *SHORT)
BF16_RTOL = 1e-2  # see the module's docstring


def small_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=1000, max_seq_len=64, n_layer=2, n_head=2, n_embd=64, architecture="llama"))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 1000, (4, 48), generator=generator)
    targets = torch.randint(0, 1000, (4, 48), generator=generator)
    targets[:, :10] = IGNORE_INDEX  # a prompt left out of the loss
    return idx, targets


def loss_and_grads(model: GPT, chunk: int, bf16: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    model.use_memory_savers(loss_chunk_tokens=chunk)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, loss = model(*batch())
    loss.backward()
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


def test_the_precision_switch_is_off_on_the_cpu_unless_asked_for():
    cpu = torch.device("cpu")
    assert not bf16_for(cpu, bf16=True) and bf16_for(cpu, bf16=True, bf16_on_cpu=True)
    assert not bf16_for(cpu, bf16=False, bf16_on_cpu=True)  # --bf16=False keeps float32 everywhere
    with inference_autocast(cpu, True, bf16_on_cpu=True):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    with inference_autocast(cpu, True):
        assert not torch.is_autocast_enabled("cpu")


def test_chunked_and_whole_losses_agree_under_bf16_autocast_on_the_cpu():
    model = small_model()
    whole, whole_grads = loss_and_grads(model, 0, bf16=True)
    chunked, chunked_grads = loss_and_grads(model, 40, bf16=True)
    float32, _ = loss_and_grads(model, 0, bf16=False)
    assert whole.dtype == torch.float32  # the loss is taken in float32 under autocast
    torch.testing.assert_close(chunked, whole, rtol=BF16_RTOL, atol=0)
    for name, grad in whole_grads.items():
        assert chunked_grads[name].dtype == torch.float32
        torch.testing.assert_close(chunked_grads[name], grad, rtol=BF16_RTOL, atol=1e-3, msg=name)
    assert abs(float(whole) - float(float32)) > 1e-6, "bf16 must have changed the arithmetic"


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return resume_chat_data(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory, chat_data):
    done, trace = traced_run(tmp_path_factory.mktemp("bf16-reference"), chat_data, extra=BF16)
    return done, traced_losses(trace)


def test_a_bf16_run_on_the_cpu_trains_validates_and_saves(tmp_path, chat_data, bf16_reference):
    done, losses = bf16_reference
    assert "mixed precision: bf16" in done.stderr
    assert "Validation at step" in done.stderr and "Sample" in done.stderr
    float32_done, float32_trace = traced_run(tmp_path, chat_data, extra=SHORT)
    assert "mixed precision: no" in float32_done.stderr
    float32_losses = traced_losses(float32_trace)
    assert losses.keys() == float32_losses.keys()
    assert losses != float32_losses, "bf16 autocast must have changed the losses"
    assert losses[1] == pytest.approx(float32_losses[1], rel=BF16_RTOL)  # the same model, the same first batch


def test_a_bf16_run_killed_after_a_save_resumes_with_the_same_losses(tmp_path, chat_data, bf16_reference):
    _, reference_losses = bf16_reference
    process = start_run(tmp_path, chat_data, env={"LOWMEM_TEST_STEP_SECONDS": "0.03"}, extra=BF16)
    wait_for_step(process, 15)
    kill_all(process)
    resumed, trace = traced_run(tmp_path, chat_data, extra=[*BF16, "--is_keep_training=True"])
    assert "mixed precision: bf16" in resumed.stderr
    start = resumed_from(resumed.stderr)
    assert start in (10, 20)  # the save before the kill (20 if the kill landed after it)
    assert_losses_match(traced_losses(trace), reference_losses, start)
