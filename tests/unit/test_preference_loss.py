"""The DPO loss: ln 2 where the policy is its reference, the two-pass loss's gradient equal to the direct one's,
and adapters trained on it with the base as the reference (no second model) learning to prefer the chosen answers."""

from __future__ import annotations

import math

import pytest
import torch

from lowmem.adapters import LoRASpec, add_adapters, adapters_off
from lowmem.model import GPT, GPTConfig, IGNORE_INDEX
from lowmem.model.preference import LN2, dpo_loss, dpo_terms

VOCAB, WIDTH = 64, 12


def model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=WIDTH, n_layer=2, n_head=2, n_embd=32,
                         architecture="llama"))


def pairs(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2P sequences (chosen rows first): a prompt of 4 random tokens, then an answer of 6. The chosen answers are one
    phrase (tokens 5 to 10); the rejected ones are random. Targets count the answer tokens only."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (count, 4), generator=generator)
    chosen = torch.arange(5, 11).repeat(count, 1)
    rejected = torch.randint(1, VOCAB, (count, 6), generator=generator)
    sequences = torch.cat([torch.cat([prompts, chosen], 1), torch.cat([prompts, rejected], 1)])  # (2P, 10)
    idx, targets = sequences[:, :-1], sequences[:, 1:].clone()
    targets[:, :3] = IGNORE_INDEX  # the prompt's next tokens are not the answer's
    return idx, targets


def answer_logps(net: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = net(idx)[0].float()
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                               ignore_index=IGNORE_INDEX, reduction="none")
    return -losses.view(targets.shape).sum(dim=1)


def test_the_loss_is_ln_2_where_the_policy_is_its_reference():
    logps = torch.tensor([-3.0, -5.5, -4.0, -2.0])
    terms = dpo_terms(logps, logps.clone(), beta=0.1)
    assert terms.loss.item() == pytest.approx(LN2, abs=1e-6) and abs(LN2 - 0.6931472) < 1e-7
    assert terms.accuracy.item() == 0.0 and terms.margin.item() == 0.0


@pytest.mark.parametrize("chunk_tokens", [7, 1000])
def test_the_two_pass_loss_has_the_direct_losss_value_and_gradient(chunk_tokens):
    idx, targets = pairs(3, seed=1)
    reference = answer_logps(model(seed=5), idx, targets).detach()
    direct_model, chunked_model = model(), model()

    direct_terms = dpo_terms(answer_logps(direct_model, idx, targets), reference, beta=0.5)
    direct_terms.loss.backward()
    surrogate, terms = dpo_loss(chunked_model.hidden_states(idx), chunked_model.lm_head.weight, targets, reference,
                                beta=0.5, chunk_tokens=chunk_tokens)
    surrogate.backward()
    assert terms.loss.item() == pytest.approx(direct_terms.loss.item(), rel=1e-5)
    assert 0.0 < terms.loss.item() and not math.isclose(terms.loss.item(), LN2, abs_tol=1e-3)
    for (name, expected), got in zip(direct_model.named_parameters(), chunked_model.parameters()):
        assert torch.allclose(got.grad, expected.grad, atol=1e-6, rtol=1e-4), name


def test_adapters_learn_the_preferences_with_the_base_as_their_reference():
    net = model()
    add_adapters(net, LoRASpec(rank=4, alpha=8.0))
    parameters = sum(p.numel() for p in net.parameters())
    optimizer = net.configure_optimizer(weight_decay=0.0, learning_rate=1e-2)
    held_idx, held_targets = pairs(32, seed=99)
    net.train()
    for step in range(60):
        idx, targets = pairs(16, seed=step)
        with torch.no_grad(), adapters_off(net):  # the reference: the same weights, adapters off
            reference = answer_logps(net, idx, targets)
        surrogate, terms = dpo_loss(net.hidden_states(idx), net.lm_head.weight, targets, reference, beta=0.5,
                                    chunk_tokens=64)
        if step == 0:
            assert terms.loss.item() == pytest.approx(LN2, abs=1e-4)  # the adapters start at zero
        surrogate.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    net.eval()
    with torch.no_grad():
        with adapters_off(net):
            reference = answer_logps(net, held_idx, held_targets)
        held = dpo_terms(answer_logps(net, held_idx, held_targets), reference, beta=0.5)
    assert held.accuracy.item() > 0.9 and held.margin.item() > 0
    assert sum(p.numel() for p in net.parameters()) == parameters  # no second model was made for the reference


@pytest.mark.parametrize("chunk_tokens", [0, 5, 12, 40, 1000])
def test_each_rows_sum_is_taken_within_its_own_span(chunk_tokens):
    # Tiles of whole rows (12 positions a row), of a span of one row (5), and everything at once: the sums are the
    # direct per-row sums, and the same bits again on a second call (no scatter whose order may vary).
    from lowmem.model.preference import row_token_loss_sums

    generator = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(6, 12, 8, generator=generator), torch.randn(50, 8, generator=generator)
    targets = torch.randint(0, 50, (6, 12), generator=generator)
    targets[:, :4] = IGNORE_INDEX  # the prompts' positions are not counted
    targets[2] = IGNORE_INDEX  # a row of padding sums to 0
    direct = torch.nn.functional.cross_entropy(hidden.reshape(-1, 8) @ head.T, targets.reshape(-1),
                                               ignore_index=IGNORE_INDEX, reduction="none").view(6, 12).sum(1)
    sums = row_token_loss_sums(hidden, head, targets, chunk_tokens)
    assert torch.allclose(sums, direct, atol=1e-5) and sums[2] == 0
    assert torch.equal(sums, row_token_loss_sums(hidden, head, targets, chunk_tokens))


@pytest.mark.parametrize("device, mixed_precision, halved", [("cuda", "bf16", True), ("cuda", "no", False),
                                                             ("cpu", "bf16", True), ("cpu", "no", False)])
def test_the_frozen_copy_is_halved_where_the_accelerator_runs_bf16(device, mixed_precision, halved):
    # `--bf16` on a GPU without bf16 (a T4, a V100) leaves mixed precision off: a halved copy would meet float32
    # activations there. What decides is what the accelerator runs, not the flag.
    from types import SimpleNamespace

    from lowmem.preference.reference import copy_in_bf16

    accelerator = SimpleNamespace(device=torch.device(device), mixed_precision=mixed_precision)
    assert copy_in_bf16(accelerator) is halved
