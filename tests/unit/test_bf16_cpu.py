"""The GPU's precision on the CPU, in-process: `--bf16_on_cpu=True` trains under bf16 autocast there, so the bf16
paths run without a GPU. Here the precision switch and the chunked loss under autocast; the training runs
(validation, checkpoints and resume under bf16) are in tests/integration/test_bf16_cpu_training.py.

bf16 keeps 8 bits of mantissa: each rounding is good to about 0.4% (2**-8). The chunked and whole losses
multiply the same bf16 operands, in matmuls of other shapes (and so other summation orders), then both take
the softmax in float32: their losses and gradients agree to 1% (rtol=1e-2), where float32 agrees to 1e-6.
A resume on the same machine replays the same operations in the same order: the same losses to 1e-6.
"""

from __future__ import annotations

import torch
from tolerances import BF16_RTOL  # 1e-2: see the module's docstring

from lowmem.distributed.accelerator import bf16_for
from lowmem.model import GPT, IGNORE_INDEX, GPTConfig
from lowmem.distributed.performance import inference_autocast


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
