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


@pytest.mark.parametrize("tied", [True, False], ids=["tied head", "own head"])
def test_whole_logits_compute_under_fsdp2_bf16_numerics_as_the_chunked_loss(tied):
    """FSDP2's bf16 policy runs no autocast: the head's unit holds a bf16 weight while the final norm hands on float32
    hidden states. The loss over whole logits (the GPU's choice where they fit) must compute there as the chunked
    loss does (it stopped the first FSDP2 step on a GPU with "expected m1 and m2 to have the same dtype"), and so must
    the logits and generation's last-position logits. `compute_as_fsdp2_bf16` gives one process those numerics."""
    from lowmem.distributed.fsdp_units import compute_as_fsdp2_bf16
    from lowmem.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = compute_as_fsdp2_bf16(GPT(GPTConfig(vocab_size=96, max_seq_len=16, n_layer=2, n_head=2, n_embd=32,
                                                architecture="llama", tie_embeddings=tied)))
    idx = torch.randint(0, 96, (2, 16))
    targets = idx.roll(-1, dims=1)
    head = model.tok_emb.weight if tied else model.lm_head.weight
    assert head.dtype == torch.bfloat16
    losses, head_grads = {}, {}
    for chunk_tokens in (0, 8):
        model.use_memory_savers(loss_chunk_tokens=chunk_tokens)
        model.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        losses[chunk_tokens], head_grads[chunk_tokens] = loss.item(), head.grad.float().clone()
    assert losses[0] == pytest.approx(losses[8], rel=1e-5), losses
    torch.testing.assert_close(head_grads[0], head_grads[8], rtol=2e-2, atol=1e-4)
    logits, _ = model(idx)
    last, _ = model(idx, last_logits=True)
    assert logits.shape[:2] == (2, 16)
    torch.testing.assert_close(last.float(), logits[:, -1].float())
