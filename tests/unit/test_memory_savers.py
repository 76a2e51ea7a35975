"""The model's memory savers change what a step holds, never what it computes: the chunked cross-entropy and
activation checkpointing give the plain path's loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowmem.errors import ConfigError
from lowmem.model import GPT, IGNORE_INDEX, GPTConfig
from lowmem.model.loss import chunked_token_loss_sum, plain_token_losses

# A vocabulary of 1,000 (padded to 1,024) and 3 x 50 = 150 tokens: no chunk size below divides either.
VOCAB, ROWS, SEQ = 1000, 3, 50


def random_case(seed: int = 0, width: int = 24) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states (N, C), a head (V, C), targets (N,) with IGNORE_INDEX runs, and 0/1/fractional weights."""
    generator = torch.Generator().manual_seed(seed)
    tokens = ROWS * SEQ
    hidden = torch.randn(tokens, width, generator=generator)
    head = torch.randn(VOCAB, width, generator=generator) * 0.5
    targets = torch.randint(0, VOCAB, (tokens,), generator=generator)
    targets[:17] = IGNORE_INDEX  # a prompt left out of the loss
    targets[-5:] = IGNORE_INDEX  # padding at the end
    weights = (targets != IGNORE_INDEX).float()
    weights[40:60] *= 0.25  # a loss mask that is not only 0 and 1
    return hidden, head, targets, weights


def plain_sum(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (plain_token_losses(F.linear(hidden, head), targets) * weights).sum()


def loss_and_grads(loss_fn, hidden, head, targets, weights):
    hidden = hidden.clone().requires_grad_(True)
    head = head.clone().requires_grad_(True)
    loss = loss_fn(hidden, head, targets, weights)
    (loss * 0.37).backward()  # a scale, as the training step applies one: the chain rule must carry it
    return loss.detach(), hidden.grad, head.grad


@pytest.mark.parametrize("chunk", [1, 7, 64, 149, 150, 4096])
def test_chunked_and_plain_cross_entropy_give_the_same_loss_and_gradients(chunk):
    case = random_case()
    plain = loss_and_grads(plain_sum, *case)
    chunked = loss_and_grads(lambda h, w, t, m: chunked_token_loss_sum(h, w, t, m, chunk), *case)
    for expected, got in zip(plain, chunked):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert plain[2][:, 0].count_nonzero() > 0, "the test must exercise the head's gradient"


def test_chunked_loss_without_gradients_equals_the_plain_loss():
    case = random_case(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(chunked_token_loss_sum(*case, 33), plain_sum(*case), rtol=1e-6, atol=1e-6)


def test_chunked_loss_keeps_no_tensor_the_size_of_the_logits_for_the_backward_pass():
    hidden, head, targets, weights = random_case()
    hidden.requires_grad_(True)
    head.requires_grad_(True)
    saved: list[int] = []

    def keep_size(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep_size, lambda tensor: tensor):
        plain_sum(hidden, head, targets, weights)
    assert max(saved) >= hidden.shape[0] * VOCAB, "the plain path keeps the (tokens, vocabulary) softmax"
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(keep_size, lambda tensor: tensor):
        chunked_token_loss_sum(hidden, head, targets, weights, 16)
    assert max(saved) <= head.numel(), f"the chunked loss kept {max(saved)} elements for the backward pass"


def test_chunked_loss_under_bf16_autocast_stays_close_to_the_plain_one():
    case = random_case(seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = loss_and_grads(plain_sum, *case)
        chunked = loss_and_grads(lambda h, w, t, m: chunked_token_loss_sum(h, w, t, m, 40), *case)
    for expected, got in zip(plain, chunked):
        assert got.dtype == expected.dtype  # float32 gradients for float32 inputs, as autocast gives them
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)


# ----- through the model -------------------------------------------------------------------------------------
def small_gpt(dropout: float = 0.0, architecture: str = "gpt2") -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=64, n_layer=3, n_head=2, n_embd=32, dropout=dropout,
                         architecture=architecture))


def packed_batch() -> dict[str, torch.Tensor]:
    """Three sequences of packed rows (segment ids), padding at the end, prompt tokens left out."""
    generator = torch.Generator().manual_seed(7)
    idx = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    segments = torch.zeros(ROWS, SEQ, dtype=torch.long)
    segments[:, :20], segments[:, 20:41] = 1, 2  # two rows, then padding (segment 0)
    targets[:, 41:] = IGNORE_INDEX
    targets[:, 20:26] = IGNORE_INDEX  # the second row's prompt
    return {"idx": idx, "targets": targets, "segment_ids": segments}


def model_loss_and_grads(model: GPT, batch: dict[str, torch.Tensor], seed: int = 11):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for both paths
    _, loss = model(batch["idx"], batch["targets"], segment_ids=batch["segment_ids"])
    loss.backward()
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


def assert_same(reference, other) -> None:
    torch.testing.assert_close(other[0], reference[0], rtol=1e-6, atol=1e-6)
    assert reference[1].keys() == other[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(other[1][name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_a_model_with_a_chunked_loss_trains_as_with_the_whole_logits():
    model, batch = small_gpt(), packed_batch()
    reference = model_loss_and_grads(model, batch)
    model.use_memory_savers(loss_chunk_tokens=37)
    assert_same(reference, model_loss_and_grads(model, batch))
    logits, _ = model(batch["idx"], batch["targets"], return_logits=True)  # asked for: the whole logits, as before
    assert logits is not None and logits.shape == (ROWS, SEQ, model.config.padded_vocab_size)


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(dropout, architecture):
    model, batch = small_gpt(dropout, architecture), packed_batch()
    reference = model_loss_and_grads(model, batch)
    model.use_memory_savers(checkpoint_activations=True)
    assert model.memory_savers == {"loss_chunk_tokens": 0, "checkpoint_activations": True}
    assert_same(reference, model_loss_and_grads(model, batch))
    model.use_memory_savers(loss_chunk_tokens=16, checkpoint_activations=True)  # both at once
    assert_same(reference, model_loss_and_grads(model, batch))


def test_activation_checkpointing_keeps_fewer_tensors_for_the_backward_pass():
    model, batch = small_gpt(), packed_batch()

    def saved_bytes() -> int:
        total = 0

        def count(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
            model(batch["idx"], batch["targets"], segment_ids=batch["segment_ids"])
        return total

    model.use_memory_savers(loss_chunk_tokens=16)
    without = saved_bytes()
    model.use_memory_savers(loss_chunk_tokens=16, checkpoint_activations=True)
    with_checkpoints = saved_bytes()
    assert with_checkpoints < without / 2, (with_checkpoints, without)


def test_checkpointing_is_off_in_evaluation_and_generation():
    model = small_gpt().use_memory_savers(loss_chunk_tokens=8, checkpoint_activations=True).eval()
    prompt = torch.randint(0, VOCAB, (2, 5))
    cached = model.generate(prompt, max_new_tokens=6, greedy=True)
    uncached = model.generate(prompt, max_new_tokens=6, greedy=True, use_cache=False)
    assert torch.equal(cached, uncached)


def test_memory_savers_reject_a_negative_chunk():
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        small_gpt().use_memory_savers(loss_chunk_tokens=-1)
