"""Tests for the GPT model: shapes, causality, loss, initialisation, optimizer groups and generation."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from lowmem.errors import ConfigError
from lowmem.model import GPT, IGNORE_INDEX, GPTConfig, KVCache
from lowmem.model import MODEL_PRESETS
from lowmem.model import attention as attention_module
from lowmem.model import gpt as gpt_module
from lowmem.model.norm import RMSNorm

# The behaviour both architectures must share: causality, the loss, the cache, padding and windows.
ARCHITECTURE = pytest.mark.parametrize("architecture", gpt_module.ARCHITECTURES)


def tiny_config(**overrides) -> GPTConfig:
    sizes = dict(vocab_size=50, max_seq_len=16, n_layer=2, n_head=4, n_embd=32)
    return GPTConfig(**{**sizes, **overrides})


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


def random_batch(cfg: GPTConfig, B: int = 3, T: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return idx, targets


def force_constant_logits(model: GPT, favoured_ids: list[int], strength: float = 10.0) -> None:
    """Make every position's logits the same, with `favoured_ids` far above all other ids.

    With ln_f's weight zeroed, the final hidden state is ln_f's bias u at every position, so the logits are
    W @ u for the (tied) embedding W: rows set to u score strength * |u|^2, zero rows score 0.
    """
    assert model.config.bias, "needs a LayerNorm bias"
    with torch.no_grad():
        u = torch.randn(model.config.n_embd)
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(u)
        model.tok_emb.weight.zero_()
        for i in favoured_ids:
            model.tok_emb.weight[i] = strength * u


# ------------------------------------------------------------------------------------------------------------
# Config


def test_padded_vocab_is_multiple_of_64_and_covers_vocab():
    for vocab_size in (1, 63, 64, 65, 127, 8000, 8001, 50257):
        cfg = tiny_config(vocab_size=vocab_size)
        assert cfg.padded_vocab_size % 64 == 0
        assert vocab_size <= cfg.padded_vocab_size < vocab_size + 64
    model = GPT(tiny_config(vocab_size=65))
    assert model.tok_emb.weight.shape == (128, 32)
    logits, _ = model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, 128)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_embd=30, n_head=4), "n_embd"),
        (dict(n_layer=0), "n_layer"),
        (dict(n_head=0), "n_head"),
        (dict(n_embd=-32), "n_embd"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(max_seq_len=0), "max_seq_len"),
        (dict(n_layer=2.5), "n_layer"),
        (dict(dropout=1.0), "dropout"),
        (dict(dropout=-0.1), "dropout"),
        (dict(bias="yes"), "bias"),
    ],
)
def test_config_validation_raises_config_error(overrides, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config(**overrides)


def test_config_error_for_indivisible_width_suggests_a_fix():
    with pytest.raises(ConfigError) as info:
        tiny_config(n_embd=30, n_head=4)
    assert "n_embd=28 or n_embd=32" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_config_round_trips_through_asdict():
    cfg = tiny_config(dropout=0.1, bias=True)
    assert GPTConfig(**dataclasses.asdict(cfg)) == cfg
    assert "padded_vocab_size" not in dataclasses.asdict(cfg)


def test_presets():
    demo = GPTConfig.demo(8000)
    assert (demo.n_layer, demo.n_head, demo.n_embd, demo.max_seq_len) == (4, 4, 256, 256)
    assert 3_000_000 <= GPT(demo).num_params(exclude_embeddings=True) <= 5_000_000
    small = GPTConfig.gpt2_small(8000, dropout=0.1)
    assert (small.n_layer, small.n_head, small.n_embd, small.max_seq_len, small.dropout) == (12, 12, 768, 1024, 0.1)
    assert GPTConfig.from_preset("demo", 8000, max_seq_len=128) == GPTConfig.demo(8000, max_seq_len=128)
    assert set(MODEL_PRESETS) == {"demo", "gpt2_small"}
    with pytest.raises(ConfigError, match="gpt2_small"):
        GPTConfig.from_preset("gpt3", 8000)


# ------------------------------------------------------------------------------------------------------------
# Model structure and initialisation


@ARCHITECTURE
def test_embeddings_are_tied(architecture):
    model = tiny_model(architecture=architecture)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    # Still one tensor after a state-dict round trip into a fresh model.
    other = tiny_model(seed=5, architecture=architecture)
    other.load_state_dict(model.state_dict())
    assert other.lm_head.weight is other.tok_emb.weight
    assert torch.equal(other.tok_emb.weight, model.tok_emb.weight)


def test_num_params_counts_tied_weight_once():
    model = tiny_model()
    cfg = model.config
    C = cfg.n_embd
    per_block = 4 * C * C + 8 * C * C + 2 * C  # attention + MLP matrices + two LayerNorm weights
    embeddings = cfg.padded_vocab_size * C + cfg.max_seq_len * C
    assert model.num_params(exclude_embeddings=True) == cfg.n_layer * per_block + C  # + ln_f weight
    assert model.num_params() == model.num_params(exclude_embeddings=True) + embeddings


def test_estimate_flops_per_token_formula():
    model = tiny_model()
    cfg = model.config
    n_matmul = model.num_params() - cfg.max_seq_len * cfg.n_embd
    expected = 6 * n_matmul + 12 * cfg.n_layer * cfg.n_embd * cfg.max_seq_len
    assert model.estimate_flops_per_token() == expected
    assert model.estimate_flops_per_token(seq_len=8) == 6 * n_matmul + 12 * cfg.n_layer * cfg.n_embd * 8


def test_init_std_follows_gpt2():
    torch.manual_seed(0)
    cfg = tiny_config(n_layer=2, n_embd=64, bias=True)
    model = GPT(cfg)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for block in model.blocks:
        for proj in (block.attn.out_proj, block.mlp.out_proj):
            assert proj.weight.std().item() == pytest.approx(residual_std, rel=0.1)
            assert torch.all(proj.bias == 0)
        assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert block.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
        assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.pos_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_no_bias_parameters_when_bias_false():
    model = tiny_model(bias=False)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_llama_architecture_has_rotary_positions_rmsnorm_and_swiglu():
    model = tiny_model(architecture="llama", n_embd=48, n_head=4)
    assert model.pos_emb is None and "pos_emb.weight" not in model.state_dict()
    assert isinstance(model.ln_f, torch.nn.RMSNorm) and isinstance(model.blocks[0].ln_1, torch.nn.RMSNorm)
    mlp = model.blocks[0].mlp
    assert isinstance(mlp, gpt_module.SwiGLU) and mlp.gate.out_features == mlp.up.out_features == 128  # 8/3*48 -> 64s
    assert model.lm_head.weight is model.tok_emb.weight
    # Every parameter but the token embedding is a block's or ln_f's.
    C, H = 48, 128
    per_block = 4 * C * C + 3 * C * H + 2 * C
    assert model.num_params(exclude_embeddings=True) == model.config.n_layer * per_block + C
    assert model.estimate_flops_per_token(seq_len=8) == 6 * model.num_params() + 12 * 2 * C * 8


def test_the_two_architectures_have_about_the_same_size_at_the_demo_shape():
    sizes = {arch: GPT(GPTConfig.demo(8000, architecture=arch)).num_params(exclude_embeddings=True)
             for arch in gpt_module.ARCHITECTURES}
    assert sizes["llama"] == pytest.approx(sizes["gpt2"], rel=0.03)


@pytest.mark.parametrize("overrides, message", [
    (dict(architecture="mistral"), "architecture must be one of gpt2, llama"),
    (dict(architecture="llama", n_embd=36, n_head=4), "must be even"),
    (dict(rope_theta=0), "rope_theta"),
    (dict(norm_eps=-1.0), "norm_eps"),
])
def test_architecture_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)


def test_rotary_attention_depends_on_relative_positions_only():
    # Rotating queries and keys by their positions: shifting both by the same offset leaves q . k unchanged.
    from lowmem.model.rotary import apply_rotary, rotary_angles

    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    scores = []
    for offset in (0, 17):
        cos, sin = rotary_angles(torch.arange(offset, offset + 5), 8, 10000.0)
        scores.append(apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).transpose(-1, -2))
    torch.testing.assert_close(scores[0], scores[1], atol=1e-5, rtol=1e-5)
    cos, sin = rotary_angles(torch.zeros(5, dtype=torch.long), 8, 10000.0)
    torch.testing.assert_close(apply_rotary(q, cos, sin), q)  # position 0 is no rotation


# ------------------------------------------------------------------------------------------------------------
# Forward and loss


@ARCHITECTURE
def test_causality_later_tokens_never_change_earlier_logits(architecture):
    model = tiny_model(architecture=architecture)
    idx, _ = random_batch(model.config, B=2, T=12)
    logits, _ = model(idx)
    for t in (0, 5, 11):
        changed = idx.clone()
        changed[:, t:] = (changed[:, t:] + 7) % model.config.vocab_size
        changed_logits, _ = model(changed)
        torch.testing.assert_close(changed_logits[:, :t], logits[:, :t])
        # The changed position itself does see its own token.
        assert not torch.allclose(changed_logits[:, t], logits[:, t])


def test_sequence_longer_than_max_seq_len_is_rejected():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, model.config.max_seq_len + 1, dtype=torch.long))


@ARCHITECTURE
def test_loss_equals_manual_cross_entropy(architecture):
    model = tiny_model(architecture=architecture)
    idx, targets = random_batch(model.config)
    logits, loss = model(idx, targets, return_logits=True)
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    manual = -log_probs.gather(-1, targets.unsqueeze(-1)).mean()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert loss.item() == pytest.approx(manual.item(), rel=1e-5)
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)))
    # A fresh model is close to uniform over the padded vocabulary.
    assert loss.item() == pytest.approx(math.log(model.config.padded_vocab_size), rel=0.05)


def test_ignore_index_and_loss_mask():
    model = tiny_model()
    idx, targets = random_batch(model.config)
    logits, _ = model(idx)
    per_token = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), reduction="none").view_as(targets)

    keep = torch.ones_like(targets, dtype=torch.bool)
    keep[:, :5] = False  # e.g. prompt tokens
    keep[1] = False  # e.g. a padding row

    ignored = targets.masked_fill(~keep, IGNORE_INDEX)
    _, loss_ignore = model(idx, ignored)
    _, loss_mask = model(idx, targets, loss_mask=keep)
    _, loss_float_mask = model(idx, targets, loss_mask=keep.float())
    expected = per_token[keep].mean()
    torch.testing.assert_close(loss_ignore, expected)
    torch.testing.assert_close(loss_mask, expected)
    torch.testing.assert_close(loss_float_mask, expected)

    # Both together: a position counts only when neither excludes it.
    extra = keep.clone()
    extra[0, 5:8] = False
    _, loss_both = model(idx, ignored, loss_mask=extra)
    torch.testing.assert_close(loss_both, per_token[keep & extra].mean())


def test_fully_masked_batch_gives_zero_loss_and_finite_gradients():
    model = tiny_model().train()
    idx, targets = random_batch(model.config)
    _, loss = model(idx, torch.full_like(targets, IGNORE_INDEX))
    assert loss.item() == 0.0
    _, loss = model(idx, targets, loss_mask=torch.zeros_like(targets))
    assert loss.item() == 0.0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_loss_mask_shape_mismatch_is_rejected():
    model = tiny_model()
    idx, targets = random_batch(model.config)
    with pytest.raises(ValueError, match="loss_mask"):
        model(idx, targets, loss_mask=torch.ones(targets.size(0), targets.size(1) + 1))


# ------------------------------------------------------------------------------------------------------------
# Training


def test_weight_decay_groups():
    model = tiny_model(bias=True)
    opt = model.configure_optimizer(weight_decay=0.1, learning_rate=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["params"] and no_decay["params"]
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    # Every parameter exactly once; the tied embedding/head weight is not duplicated.
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert sum(1 for p in decay["params"] if p is model.tok_emb.weight) == 1
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["betas"] == (0.9, 0.95)
    # Fused on the CPU too: its kernel skips a non-finite step on the device (lowmem.train.step).
    assert opt.defaults.get("fused") is True
    assert not model.configure_optimizer(0.1, 1e-3, fused=False).defaults.get("fused")


@ARCHITECTURE
def test_a_few_steps_overfit_a_fixed_batch(architecture):
    model = tiny_model(architecture=architecture).train()
    idx, targets = random_batch(model.config, B=2, T=8)
    opt = model.configure_optimizer(weight_decay=0.0, learning_rate=3e-3)
    _, first = model(idx, targets)
    for _ in range(40):
        _, loss = model(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    _, last = model(idx, targets)
    assert last.item() < 0.5 * first.item()


@ARCHITECTURE
def test_dropout_is_active_only_in_training_mode(architecture):
    model = tiny_model(dropout=0.5, architecture=architecture)
    idx, _ = random_batch(model.config)
    torch.testing.assert_close(model(idx)[0], model(idx)[0])
    model.train()
    assert not torch.allclose(model(idx)[0], model(idx)[0])


# ------------------------------------------------------------------------------------------------------------
# Generation


def test_generate_greedy_is_deterministic():
    model = tiny_model()
    prompt, _ = random_batch(model.config, B=2, T=4)
    out1 = model.generate(prompt, max_new_tokens=6, greedy=True)
    out2 = model.generate(prompt, max_new_tokens=6, greedy=True)
    assert out1.shape == (2, 10)
    assert torch.equal(out1, out2)
    assert torch.equal(out1[:, :4], prompt)
    # temperature 0 means greedy; top_k=1 sampling picks the same tokens.
    assert torch.equal(model.generate(prompt, max_new_tokens=6, temperature=0.0), out1)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, top_k=1), out1)


@ARCHITECTURE
def test_generate_greedy_matches_forward_argmax(architecture):
    model = tiny_model(architecture=architecture)
    prompt, _ = random_batch(model.config, B=2, T=4)
    out = model.generate(prompt, max_new_tokens=1, greedy=True)
    logits, _ = model(prompt)
    torch.testing.assert_close(out[:, -1], logits[:, -1, : model.config.vocab_size].argmax(-1))


def test_generate_never_outputs_padding_ids():
    model = tiny_model(bias=True)  # vocab 50, padded to 64
    cfg = model.config
    padding_ids = list(range(cfg.vocab_size, cfg.padded_vocab_size))
    force_constant_logits(model, padding_ids)
    prompt = torch.zeros(4, 3, dtype=torch.long)
    logits, _ = model(prompt)
    assert (logits[:, -1].argmax(-1) >= cfg.vocab_size).all()  # without masking, padding would win
    greedy = model.generate(prompt, max_new_tokens=8, greedy=True)
    g = torch.Generator().manual_seed(0)
    sampled = model.generate(prompt, max_new_tokens=8, temperature=2.0, top_p=0.9, generator=g)
    assert (greedy < cfg.vocab_size).all()
    assert (sampled < cfg.vocab_size).all()


def test_generate_sampling_is_reproducible_with_a_generator():
    model = tiny_model()
    prompt, _ = random_batch(model.config, B=3, T=4)
    a = model.generate(prompt, 10, temperature=1.5, top_k=20, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 10, temperature=1.5, top_k=20, generator=torch.Generator().manual_seed(7))
    c = model.generate(prompt, 10, temperature=1.5, top_k=20, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert (a < model.config.vocab_size).all()


def test_generate_top_k_and_top_p_restrict_the_candidates(monkeypatch):
    model = tiny_model()
    probs = torch.zeros(model.config.padded_vocab_size)
    probs[:4] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    monkeypatch.setattr(model, "next_token_logits", lambda idx: probs.log().expand(idx.size(0), -1).clone())
    prompt = torch.zeros(400, 1, dtype=torch.long)

    def sampled(**kwargs) -> set[int]:
        out = model.generate(prompt, 1, generator=torch.Generator().manual_seed(0), **kwargs)
        return set(out[:, -1].tolist())

    assert sampled() == {0, 1, 2, 3}
    assert sampled(top_k=2) == {0, 1}
    assert sampled(top_p=0.6) == {0, 1}  # 0.4 alone is short of 0.6; 0.4 + 0.3 reaches it
    assert sampled(top_p=0.35) == {0}
    assert sampled(top_p=0.75) == {0, 1, 2}
    assert sampled(top_k=3, top_p=1.0) == {0, 1, 2}


def test_generate_crops_context_to_max_seq_len():
    model = tiny_model()
    T = model.config.max_seq_len + 5
    prompt = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompt, max_new_tokens=3, greedy=True)
    assert out.shape == (2, T + 3)
    # The next token depends only on the last max_seq_len tokens.
    cropped = model.generate(prompt[:, -model.config.max_seq_len :], max_new_tokens=1, greedy=True)
    assert torch.equal(out[:, T], cropped[:, -1])


def test_generate_stops_at_eos():
    model = tiny_model(bias=True)
    eos = 7
    force_constant_logits(model, [eos])
    prompt = torch.zeros(2, 3, dtype=torch.long)
    out = model.generate(prompt, max_new_tokens=10, eos_id=eos, greedy=True)
    assert out.shape == (2, 4)
    assert (out[:, -1] == eos).all()


def test_generate_finished_rows_emit_padding_until_all_finish(monkeypatch):
    model = tiny_model()
    eos, pad = 1, 0
    # Scripted next tokens per step: row 0 ends at step 1, row 1 at step 3.
    script = torch.tensor([[5, 6], [eos, 7], [9, 8], [9, eos], [9, 9]])
    step = {"i": 0}

    def scripted_logits(idx: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(idx.size(0), model.config.padded_vocab_size)
        logits[torch.arange(idx.size(0)), script[step["i"]]] = 10.0
        step["i"] += 1
        return logits

    monkeypatch.setattr(model, "next_token_logits", scripted_logits)
    prompt = torch.full((2, 2), 4)
    out = model.generate(prompt, max_new_tokens=10, eos_id=eos, greedy=True, pad_id=pad)
    assert out.tolist() == [[4, 4, 5, eos, pad, pad], [4, 4, 6, 7, 8, eos]]
    assert step["i"] == 4  # stopped as soon as every row finished

    step["i"] = 0
    out = model.generate(prompt, max_new_tokens=10, eos_id=eos, greedy=True)  # pads with eos by default
    assert out[0].tolist() == [4, 4, 5, eos, eos, eos]


def test_generate_restores_training_mode():
    model = tiny_model(dropout=0.1).train()
    model.generate(torch.zeros(1, 2, dtype=torch.long), 2, greedy=True)
    assert model.training


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5), dict(max_new_tokens=-1)],
)
def test_generate_rejects_bad_sampling_settings(kwargs):
    model = tiny_model()
    args = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ConfigError):
        model.generate(torch.zeros(1, 2, dtype=torch.long), **args)


# ------------------------------------------------------------------------------------------------------------
# Generation with a key/value cache and left-padded prompts


def left_pad(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D prompts of different lengths into a left-padded (B, T) batch and their lengths (B,)."""
    T = max(len(r) for r in rows)
    batch = torch.full((len(rows), T), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, T - len(r) :] = r
    return batch, torch.tensor([len(r) for r in rows])


def varied_model(seed: int = 0, **overrides) -> GPT:
    """A tiny random model whose greedy output wanders over many tokens.

    At GPT-2's init scale the tied embedding makes a random model repeat its last token forever, which
    would make "the same greedy tokens" a weak check; larger weights give varied continuations whose top
    two logits still differ by far more than float rounding (about 1e-3 against 1e-7).
    """
    model = tiny_model(seed, **overrides)
    # Without a position table the llama model needs larger weights to stop repeating itself as soon.
    std = 0.3 if model.config.architecture == "llama" else 0.15
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    return model


def test_kv_cache_writes_in_place_and_returns_all_positions():
    cache = KVCache(n_layer=1, max_len=5)
    layer = cache.layers[0]
    k1, v1 = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8)
    k, v = layer.append(k1, v1)
    storage = layer.k.data_ptr()
    assert k.shape == (2, 4, 3, 8) and cache.length == 3
    k2, v2 = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8)
    k, v = layer.append(k2, v2)
    assert layer.k.data_ptr() == storage  # preallocated: no copy per step
    assert torch.equal(k, torch.cat([k1, k2], dim=2)) and torch.equal(v, torch.cat([v1, v2], dim=2))
    with pytest.raises(ValueError, match="5 positions"):
        layer.append(torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8))


@ARCHITECTURE
def test_cached_forward_matches_full_forward(architecture):
    model = tiny_model(max_seq_len=32, architecture=architecture)
    idx, _ = random_batch(model.config, B=2, T=20)
    full = model.lm_head(model.hidden_states(idx))  # (B, T, V)
    cache = KVCache(model.config.n_layer, max_len=20)
    with torch.no_grad():
        parts = [model.lm_head(model.hidden_states(idx[:, :6], cache=cache))]  # a prompt
        parts += [model.lm_head(model.hidden_states(idx[:, t : t + 1], cache=cache)) for t in range(6, 12)]  # steps
        parts.append(model.lm_head(model.hidden_states(idx[:, 12:], cache=cache)))  # several positions after a cache
    torch.testing.assert_close(torch.cat(parts, dim=1), full)


def test_unpadded_forward_keeps_the_is_causal_fast_path(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        calls.append((kwargs["attn_mask"], kwargs["is_causal"]))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    model = tiny_model()
    idx, targets = random_batch(model.config)
    model(idx, targets)
    assert calls and all(mask is None and is_causal for mask, is_causal in calls)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@ARCHITECTURE
def test_generate_cached_and_uncached_give_the_same_greedy_tokens(seed, architecture):
    model = varied_model(seed, max_seq_len=64, architecture=architecture)
    prompt, _ = random_batch(model.config, B=3, T=8, seed=seed)
    cached = model.generate(prompt, max_new_tokens=50, greedy=True)
    uncached = model.generate(prompt, max_new_tokens=50, greedy=True, use_cache=False)
    assert cached.shape == (3, 58)
    assert all(len(set(row[8:].tolist())) >= 3 for row in cached)  # not one token repeated
    assert torch.equal(cached, uncached)


def test_generate_with_cache_runs_only_the_new_token_per_step(monkeypatch):
    model = tiny_model(max_seq_len=64)
    widths = []
    hidden = model.hidden_states

    def recording_hidden(idx, *args, **kwargs):
        widths.append(idx.size(1))
        return hidden(idx, *args, **kwargs)

    monkeypatch.setattr(model, "hidden_states", recording_hidden)
    prompt, _ = random_batch(model.config, B=2, T=5)
    model.generate(prompt, max_new_tokens=4, greedy=True)
    assert widths == [5, 1, 1, 1]
    widths.clear()
    model.generate(prompt, max_new_tokens=4, greedy=True, use_cache=False)
    assert widths == [5, 6, 7, 8]
    assert model.decoding is None  # the cache does not outlive the call


@ARCHITECTURE
def test_generate_sampling_with_the_same_seed_matches_cached_and_uncached(architecture):
    # The logits of the two paths differ by float rounding only (~1e-7), so the probabilities and the
    # generator's draws agree unless a draw lands within that distance of a bucket edge.
    model = varied_model(max_seq_len=64, architecture=architecture)
    prompt, _ = random_batch(model.config, B=3, T=6)
    settings = dict(max_new_tokens=40, temperature=1.3, top_k=20, top_p=0.9)
    cached = model.generate(prompt, generator=torch.Generator().manual_seed(11), **settings)
    uncached = model.generate(prompt, generator=torch.Generator().manual_seed(11), use_cache=False, **settings)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("use_cache", [True, False])
@ARCHITECTURE
def test_generate_left_padded_batch_matches_each_row_alone(use_cache, architecture):
    model = varied_model(3, max_seq_len=64, architecture=architecture)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (3, 9, 6)]
    batch, lengths = left_pad(rows, pad=7)
    out = model.generate(batch, max_new_tokens=30, greedy=True, prompt_lengths=lengths, use_cache=use_cache)
    assert out.shape == (3, 9 + 30)
    assert torch.equal(out[:, :9], batch)
    for i, row in enumerate(rows):
        alone = model.generate(row.unsqueeze(0), max_new_tokens=30, greedy=True, use_cache=use_cache)
        assert torch.equal(out[i, 9:], alone[0, len(row) :]), f"row {i}"


@ARCHITECTURE
def test_generate_left_padding_ids_do_not_matter(architecture):
    model = varied_model(max_seq_len=64, architecture=architecture)
    rows = [torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 4, 5, 6])]
    zeros, lengths = left_pad(rows, pad=0)
    other, _ = left_pad(rows, pad=model.config.vocab_size - 1)
    a = model.generate(zeros, max_new_tokens=10, greedy=True, prompt_lengths=lengths)
    b = model.generate(other, max_new_tokens=10, greedy=True, prompt_lengths=lengths)
    assert torch.equal(a[:, 6:], b[:, 6:])
    # Full-length rows are the unpadded case.
    full = model.generate(zeros, max_new_tokens=10, greedy=True, prompt_lengths=torch.tensor([6, 6]))
    assert torch.equal(full, model.generate(zeros, max_new_tokens=10, greedy=True))


def test_generate_stops_at_eos_with_cache():
    model = tiny_model(bias=True)
    eos = 7
    force_constant_logits(model, [eos])
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=10, eos_id=eos, greedy=True)
    assert out.shape == (2, 4)
    assert (out[:, -1] == eos).all()


@ARCHITECTURE
def test_generate_eos_mid_batch_same_with_and_without_cache(architecture):
    model = varied_model(max_seq_len=64, architecture=architecture)
    prompt, _ = random_batch(model.config, B=3, T=5, seed=2)
    free = model.generate(prompt, max_new_tokens=20, greedy=True)
    eos = int(free[0, 5 + 3])  # row 0 produces it by step 3; a finished row is then fed padding
    pad = model.config.vocab_size - 1
    cached = model.generate(prompt, max_new_tokens=20, greedy=True, eos_id=eos, pad_id=pad)
    uncached = model.generate(prompt, max_new_tokens=20, greedy=True, eos_id=eos, pad_id=pad, use_cache=False)
    assert torch.equal(cached, uncached)
    first_eos = int((cached[0, 5:] == eos).nonzero()[0])
    assert first_eos <= 3 and (cached[0, 5 + first_eos + 1 :] == pad).all()
    assert cached.size(1) > 5 + first_eos + 1  # other rows went on after row 0 finished


@pytest.mark.parametrize("prompt_len", [10, 16, 20])
@ARCHITECTURE
def test_generate_with_cache_past_max_seq_len_stays_valid(prompt_len, architecture):
    model = varied_model(architecture=architecture)  # max_seq_len 16
    prompt, _ = random_batch(model.config, B=2, T=prompt_len)
    cached = model.generate(prompt, max_new_tokens=15, greedy=True)
    assert cached.shape == (2, prompt_len + 15)
    assert (cached < model.config.vocab_size).all()
    # Past max_seq_len the cache is dropped for the uncached sliding window, so the tokens still agree.
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=15, greedy=True, use_cache=False))
    sampled = model.generate(prompt, max_new_tokens=15, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, prompt_len + 15) and (sampled < model.config.vocab_size).all()


@ARCHITECTURE
def test_generate_left_padded_past_max_seq_len_matches_each_row_alone(architecture):
    model = varied_model(2, architecture=architecture)  # max_seq_len 16
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (4, 12)]
    batch, lengths = left_pad(rows)
    out = model.generate(batch, max_new_tokens=12, greedy=True, prompt_lengths=lengths)
    for i, row in enumerate(rows):
        alone = model.generate(row.unsqueeze(0), max_new_tokens=12, greedy=True)
        assert torch.equal(out[i, 12:], alone[0, len(row) :]), f"row {i}"


@pytest.mark.parametrize("lengths", [[3], [0, 3], [3, 5], [2.0, 3.0]])
def test_generate_rejects_bad_prompt_lengths(lengths):
    model = tiny_model()
    with pytest.raises(ValueError, match="prompt_lengths"):
        model.generate(torch.zeros(2, 4, dtype=torch.long), 2, prompt_lengths=torch.tensor(lengths))


def test_no_repeat_ngram_size_forbids_repeating_an_ngram_of_the_answer(monkeypatch):
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=64, n_layer=1, n_head=1, n_embd=8))
    preference = torch.arange(64, dtype=torch.float32).flip(0)  # token 0 most likely, then 1, 2, ...

    def scripted(idx):  # the same preferences at every step: plain greedy repeats token 0 forever
        return preference.expand(idx.size(0), -1).clone()

    monkeypatch.setattr(model, "next_token_logits", scripted)
    prompt = torch.tensor([[5, 0, 0, 0]])
    plain = model.generate(prompt, max_new_tokens=10, greedy=True, use_cache=False)[0, 4:].tolist()
    assert plain == [0] * 10
    banned = model.generate(prompt, max_new_tokens=30, greedy=True, use_cache=False,
                            no_repeat_ngram_size=2)[0, 4:].tolist()
    bigrams = list(zip(banned, banned[1:]))
    assert len(bigrams) == len(set(bigrams)), banned
    assert banned[:2] == [0, 0], "the prompt's n-grams do not count"


# ------------------------------------------------------------------------------------------------------------
# What forward returns, and the attention kernels masked attention may use


def test_forward_with_targets_returns_no_logits_unless_asked():
    model = tiny_model()
    idx, targets = random_batch(model.config)
    logits, loss = model(idx, targets)
    assert logits is None  # nothing (B, T, V) for accelerate to copy to float32 and keep alive
    asked, same_loss = model(idx, targets, return_logits=True)
    plain, no_loss = model(idx)
    assert no_loss is None and asked.shape == (3, 12, model.config.padded_vocab_size)
    torch.testing.assert_close(asked, plain)
    torch.testing.assert_close(loss, same_loss, rtol=0, atol=0)
    expected = F.cross_entropy(plain.view(-1, plain.size(-1)), targets.view(-1))
    torch.testing.assert_close(loss, expected)


def packed_batch(cfg: GPTConfig,
                 lengths: tuple[int, ...] = (5, 7, 4)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row (1, T) of random tokens, its targets and its segment ids (the last positions padding)."""
    g = torch.Generator().manual_seed(3)
    T = cfg.max_seq_len
    idx = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    segments = torch.zeros(1, T, dtype=torch.long)
    start = 0
    for segment, n in enumerate(lengths, start=1):
        segments[0, start:start + n] = segment
        start += n
    return idx, targets, segments


def recording_sdpa_kernel(monkeypatch) -> list[list]:
    """Replace the model's `sdpa_kernel` with one that records each list of backends it is entered with."""
    entered: list[list] = []
    real = attention_module.sdpa_kernel

    def recording(backends, *args, **kwargs):
        entered.append(list(backends))
        return real(backends, *args, **kwargs)

    monkeypatch.setattr(attention_module, "sdpa_kernel", recording)
    return entered


def test_masked_attention_on_cuda_never_uses_cudnn():
    from torch.nn.attention import SDPBackend

    backends = attention_module.sdpa_backends(torch.device("cuda", 0), masked=True)
    assert SDPBackend.CUDNN_ATTENTION not in backends  # its masked backward has a NaN bug (pytorch#196678)
    # Flash attention takes no mask: the memory-efficient kernel does, and the math kernel takes anything.
    assert backends == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert attention_module.sdpa_backends(torch.device("cuda"), masked=False) is None  # plain causal: SDPA's choice
    assert attention_module.sdpa_backends(torch.device("cpu"), masked=True) is None


def test_cpu_attention_path_is_unchanged(monkeypatch):
    entered = recording_sdpa_kernel(monkeypatch)
    model = tiny_model()
    idx, targets, segments = packed_batch(model.config)
    model(idx, targets, segment_ids=segments)  # masked
    model(idx, targets)  # causal
    prompt, lengths = left_pad([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8])])
    model.generate(prompt, max_new_tokens=3, greedy=True, prompt_lengths=lengths)  # masked, with a cache
    assert entered == []


def test_masked_attention_runs_with_the_cuda_backend_list(monkeypatch):
    """The backend list the GPU path enters is one the masked call accepts, forward and backward, with the
    same results; plain causal attention does not enter it."""
    model = tiny_model(dropout=0.0).train()
    idx, targets, segments = packed_batch(model.config)
    _, reference = model(idx, targets, segment_ids=segments)
    reference.backward()
    reference_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    entered = recording_sdpa_kernel(monkeypatch)
    monkeypatch.setattr(attention_module, "sdpa_backends",
                        lambda device, masked: attention_module.MASKED_SDPA_BACKENDS if masked else None)
    _, loss = model(idx, targets, segment_ids=segments)
    loss.backward()
    assert entered == [attention_module.MASKED_SDPA_BACKENDS] * model.config.n_layer
    torch.testing.assert_close(loss, reference)
    for param, expected in zip(model.parameters(), reference_grads):
        assert torch.isfinite(param.grad).all()
        torch.testing.assert_close(param.grad, expected)
    entered.clear()
    model(idx, targets)
    assert entered == []



def test_the_rms_norm_of_a_bf16_weight_normalises_a_float32_input_in_float32_without_a_warning():
    # FSDP2's final norm: the weight gathered in bf16, the residual stream float32.
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "Mismatch dtype between input and weight" fallback
        y = norm(x)
        y.square().sum().backward()
    expected = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.bfloat16
