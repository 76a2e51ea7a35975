"""torch.compile of the model in-process: attention over packed rows traces into one graph, with the backend
choice of the CPU and of a GPU (simulated), and computes what the eager model does (checkpoints of compiled
runs: tests/integration/test_compile_training.py)."""

from __future__ import annotations

import pytest
import torch

from lowmem.model import GPT, GPTConfig
from lowmem.model import attention as attention_module


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
@pytest.mark.parametrize("cuda_backends", [False, True], ids=["cpu-path", "cuda-backend-list"])
def test_masked_attention_compiles_in_one_graph(monkeypatch, cuda_backends, architecture):
    """Packed rows under torch.compile: the backend choice (a no-op on the CPU, `sdpa_kernel` on a GPU,
    simulated here) traces into the graph without a break and computes what the eager model does."""
    if cuda_backends:
        monkeypatch.setattr(attention_module, "sdpa_backends",
                            lambda device, masked: attention_module.MASKED_SDPA_BACKENDS if masked else None)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, max_seq_len=16, n_layer=2, n_head=2, n_embd=16, architecture=architecture))
    idx = torch.randint(0, 50, (2, 16))
    segments = torch.tensor([[1] * 6 + [2] * 7 + [0] * 3, [1] * 16])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # fullgraph: a graph break raises
    _, loss = compiled(idx, idx, segment_ids=segments)
    _, expected = model(idx, idx, segment_ids=segments)
    torch.testing.assert_close(loss, expected)
    loss.backward()
