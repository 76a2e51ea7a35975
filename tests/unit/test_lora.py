"""Low-rank adapters on our GPT: the model at step 0 is the base, training moves the adapters only, the optimizer
holds a sliver of a full run's state, and the merged model and peft's adapter folder compute what ours does."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import qwen as qwen  # the fixture: a tiny Qwen2 folder

from lowmem.adapters import LoRALinear, LoRASpec, add_adapters, adapters_off, merged_state_dict
from lowmem.adapters.lora import adapter_spec, adapter_state_dict, base_state_dict
from lowmem.adapters.peft_files import ADAPTER_CONFIG, write_peft_adapter
from lowmem.errors import ConfigError
from lowmem.hf.weights import hf_config, hf_state_dict
from lowmem.model import GPT, GPTConfig

VOCAB = 128  # a multiple of 64: our logits and transformers' have the same columns

ARCHITECTURES = {
    "gpt2": dict(architecture="gpt2", bias=True),
    "llama-gqa": dict(architecture="llama", n_kv_head=1),  # q, k and v parts of unequal rows
    "qwen2-like": dict(architecture="llama", qkv_bias=True, tie_embeddings=False),
}


def base_model(kind: str, seed: int = 0, n_embd: int = 32, n_layer: int = 2) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=32, n_layer=n_layer, n_head=2, n_embd=n_embd,
                         **ARCHITECTURES[kind])).eval()


def tokens(seed: int = 1, rows: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx)[0][..., :VOCAB]


SMALL_ADAPTERS = LoRASpec(rank=4, alpha=8.0)


def with_adapters(kind: str, spec: LoRASpec = SMALL_ADAPTERS) -> tuple[GPT, GPT]:
    """The base model, and a copy of it with adapters whose B is random (so that they change the output)."""
    base, adapted = base_model(kind), base_model(kind)
    add_adapters(adapted, spec)
    torch.manual_seed(7)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0.0, 0.2)
    return base, adapted


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_at_step_0_the_model_with_adapters_computes_the_base(kind):
    base, adapted = base_model(kind), base_model(kind)
    add_adapters(adapted, LoRASpec(rank=8, alpha=16.0))
    idx = tokens()
    assert torch.equal(logits(adapted, idx), logits(base, idx))  # B starts at zero: the update is exactly zero
    assert any(isinstance(module, LoRALinear) for module in adapted.modules())


def test_training_changes_the_adapters_only_and_the_base_stays_bit_identical():
    model = base_model("llama-gqa")
    add_adapters(model, LoRASpec(rank=4, alpha=8.0, dropout=0.1))
    before = {name: value.clone() for name, value in base_state_dict(model).items()}
    adapters_before = {name: value.clone() for name, value in adapter_state_dict(model).items()}
    optimizer = model.configure_optimizer(weight_decay=0.1, learning_rate=1e-2)
    model.train()
    idx = tokens(rows=4)
    losses = []
    for _ in range(20):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1  # the adapters learn
    after = base_state_dict(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], before[name]) for name in before)
    changed = [name for name, value in adapter_state_dict(model).items() if not torch.equal(value,
                                                                                            adapters_before[name])]
    assert len(changed) == len(adapters_before)  # every A and B moved
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for name, p in model.named_parameters() if ".lora_" in name}


def test_the_optimizer_state_of_adapters_is_under_5_percent_of_a_full_runs():
    def state_bytes(model: GPT) -> int:
        optimizer = model.configure_optimizer(weight_decay=0.1, learning_rate=1e-3)
        _, loss = model(tokens()[:, :-1], tokens()[:, 1:])
        loss.backward()
        optimizer.step()
        return sum(value.numel() * value.element_size() for state in optimizer.state.values()
                   for value in state.values() if torch.is_tensor(value) and value.dim())

    full = state_bytes(base_model("llama-gqa", n_embd=512, n_layer=2))
    adapted = base_model("llama-gqa", n_embd=512, n_layer=2)
    add_adapters(adapted, LoRASpec(rank=8, alpha=16.0))
    lora = state_bytes(adapted)
    assert 0 < lora < 0.05 * full, (lora, full)


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_the_merged_weights_compute_what_the_model_with_adapters_does(kind):
    base, adapted = with_adapters(kind)
    plain = base_model(kind, seed=123)  # other weights, all replaced by the merge
    plain.load_state_dict(merged_state_dict(adapted), strict=True)
    idx = tokens()
    assert torch.allclose(logits(plain, idx), logits(adapted, idx), atol=1e-5)
    assert not torch.allclose(logits(base, idx), logits(adapted, idx), atol=1e-3)  # the adapters matter
    with adapters_off(adapted):
        assert torch.equal(logits(adapted, idx), logits(base, idx))


def test_a_tied_embedding_stays_tied_and_unchanged_in_the_merge():
    base, adapted = with_adapters("llama-gqa")
    merged = merged_state_dict(adapted)
    assert torch.equal(merged["tok_emb.weight"], base.tok_emb.weight)
    assert torch.equal(merged["lm_head.weight"], merged["tok_emb.weight"])


def transformers_model(model_config: GPTConfig, state: dict[str, torch.Tensor]):
    transformers = pytest.importorskip("transformers")
    keys = hf_config(model_config)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**keys)).float().eval()
    model.load_state_dict(hf_state_dict(state, model_config), strict=True)
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa"])
def test_the_merged_model_in_transformers_computes_what_ours_does(kind):
    _, adapted = with_adapters(kind)
    theirs = transformers_model(adapted.config, merged_state_dict(adapted))
    idx = tokens()
    with torch.no_grad():
        expected = theirs(idx).logits
    assert torch.allclose(logits(adapted, idx), expected, atol=1e-4)


@pytest.mark.parametrize("kind, targets", [("gpt2", "all"), ("llama-gqa", "all"), ("llama-gqa", "q_proj,v_proj"),
                                           ("gpt2", "attn.c_proj,c_fc")])
def test_peft_loads_the_adapter_folder_and_computes_what_ours_does(tmp_path, kind, targets):
    peft = pytest.importorskip("peft")
    spec = LoRASpec(rank=4, alpha=8.0, targets=targets)
    base, adapted = with_adapters(kind, spec)
    write_peft_adapter(tmp_path, adapted, spec, adapted.config, base_name="base")
    assert json.loads((tmp_path / ADAPTER_CONFIG).read_text())["r"] == 4
    theirs = peft.PeftModel.from_pretrained(transformers_model(base.config, base.state_dict()), str(tmp_path)).eval()
    idx = tokens()
    with torch.no_grad():
        expected = theirs(input_ids=idx).logits
    assert torch.allclose(logits(adapted, idx), expected, atol=1e-4)
    assert not torch.allclose(logits(base, idx), expected, atol=1e-3)


def test_targets_name_the_projections_that_get_adapters():
    model = base_model("llama-gqa")
    add_adapters(model, LoRASpec(rank=2, alpha=2.0, targets="q_proj,v_proj"))
    names = sorted(adapter_state_dict(model))
    assert names == sorted(f"blocks.{i}.attn.qkv.lora_{m}.{p}" for i in range(2) for m in "AB"
                           for p in ("q_proj", "v_proj"))
    with pytest.raises(ConfigError, match="does not have.*q_proj, k_proj, v_proj, o_proj"):
        add_adapters(base_model("llama-gqa"), LoRASpec(rank=2, alpha=2.0, targets="c_attn"))
    with pytest.raises(ConfigError, match="--lora_rank"):
        LoRASpec(rank=0, alpha=2.0)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_plan_gives_gradients_and_moments_to_the_adapters_only(strategy):
    from dataclasses import replace

    from memory_plan_helpers import LARGE, large_inputs

    from lowmem.memory.plan import format_plan, plan_memory

    adapters = 2_359_296  # rank 16 on the large preset's 12 blocks of llama projections
    full = plan_memory(large_inputs(strategy=strategy))
    lora = plan_memory(large_inputs(strategy=strategy, model=replace(LARGE, adapter_params=adapters)))

    def part(plan, name: str) -> int:
        return sum(p.bytes for p in (*plan.host, *plan.device) if p.name.startswith(name))

    shards = 3 if strategy == "fsdp" else 1
    assert part(lora, "AdamW moments") == 8 * adapters // shards
    if strategy == "fsdp":  # the sharded gradients come at the backward pass's end, with the gathered weights
        [gathered] = [p for p in lora.host if p.name == "gathered weights and gradients"]
        assert f"end ({4 * adapters // shards / 2**20:,.0f} MB: the sharded gradients)" in gathered.basis
    else:
        assert part(lora, "gradients") == 4 * adapters // shards
    assert part(lora, "model weights") == 4 * (LARGE.params + adapters) // shards
    assert part(full, "AdamW moments") == 8 * LARGE.params // shards
    assert lora.high_water(True) < full.high_water(True)
    assert "2.4 M in adapters that train" in format_plan(lora)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_runs_base_is_written_from_the_source_one_tensor_per_tied_weight(tmp_path, dtype):
    """The base is written from the source's files as the model was filled from them, by one process a slice at a
    time: one tensor per tied weight (the resume's strict check of the base's tensors accepts it), in the source's
    dtype; a checkpoint of adapters on it loads as the plain model with them merged."""
    from lowmem.adapters.files import ADAPTERS_FILE, BASE_DIR, base_weights_file, checked_base, finish_base, \
        save_adapters
    from lowmem.checkpoint.model_files import ModelWeights
    from lowmem.model.weights import empty_model, save_model_config, save_weights
    from lowmem.source.load import weight_plan, write_source_weights
    from lowmem.source.locate import find_source

    model = base_model("llama-gqa")
    source_folder = tmp_path / "source"
    source_folder.mkdir()
    save_weights({name: value.to(dtype) for name, value in model.state_dict().items() if name != "tok_emb.weight"},
                 source_folder / "model.safetensors")  # one name of the tied pair, as lowmem's files keep
    save_model_config(model.config, source_folder)
    source = find_source(str(source_folder))
    run = tmp_path / "run"
    write_source_weights(base_weights_file(run), source, weight_plan(source, model.config), model.config)
    finish_base(run, model.config, "a test model", source_folder)
    base = find_source(str(checked_base(run)))
    assert weight_plan(base, model.config)  # every tensor used, none left over
    assert {entry.dtype for entry in base.tensors.values()} == {dtype}
    assert "lm_head.weight" in base.tensors and "tok_emb.weight" not in base.tensors
    assert (run / BASE_DIR / "base.json").is_file()

    _, adapted = with_adapters("llama-gqa")
    checkpoint = run / "checkpoint-4"
    checkpoint.mkdir()
    save_adapters(adapted.state_dict(), checkpoint / ADAPTERS_FILE, SMALL_ADAPTERS)
    save_model_config(model.config, checkpoint)
    with ModelWeights(checkpoint) as weights:
        loaded = empty_model(weights.config)
        weights.load_into(loaded)
    with torch.no_grad():  # the adapters on the base as the source stores it
        for name, parameter in adapted.named_parameters():
            if ".lora_" not in name:
                parameter.copy_(parameter.to(dtype))
    idx = tokens()
    assert torch.allclose(logits(loaded, idx), logits(adapted, idx), atol=1e-6)
    assert adapter_spec(loaded) is None, "merged: a plain model"


def test_a_model_without_adapters_has_none_to_export(tmp_path):
    from lowmem.checkpoint.export import check_has_adapters

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="trained without adapters"):
        check_has_adapters(tmp_path)


def test_the_mfu_counts_no_weight_gradient_for_the_frozen_base():
    base = base_model("gpt2")
    adapted = base_model("gpt2")
    add_adapters(adapted, SMALL_ADAPTERS)
    adapters = sum(p.numel() for name, p in adapted.named_parameters() if ".lora_" in name)
    positions = base.pos_emb.weight.numel()
    assert base.matmul_flops_per_token() == 6 * (base.num_params() - positions)
    assert adapted.matmul_flops_per_token() == 4 * (base.num_params() - positions) + 6 * adapters


def test_targets_have_one_spelling_per_set_of_projections():
    from lowmem.adapters.targets import canonical_targets

    llama, gpt2 = base_model("llama-gqa").config, base_model("gpt2").config
    assert canonical_targets("v_proj, q_proj", llama) == "q_proj,v_proj"
    assert canonical_targets("attention", llama) == "q_proj,k_proj,v_proj,o_proj"
    assert canonical_targets("mlp,attention", llama) == canonical_targets("all", llama) == "all"
    assert canonical_targets("c_proj", gpt2) == "attn.c_proj,mlp.c_proj"


def test_plan_refuses_adapters_under_deepspeed_as_train_does():
    from lowmem.cli.planning import planned_layout
    from lowmem.config import TrainConfig

    with pytest.raises(ConfigError, match="not under DeepSpeed"):
        planned_layout(TrainConfig(lora_rank=8), num_processes=3, strategy="deepspeed", device="cpu")
    assert planned_layout(TrainConfig(lora_rank=8), num_processes=3, strategy="fsdp", device="cpu").strategy == "fsdp"


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one state per process, its precision fixed when first made: a test that trains in another
    precision than the rest of the tier makes its own, and leaves none behind."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "float32"])
def test_the_frozen_base_is_held_in_the_dtype_a_bf16_run_computes_in(tmp_path, monkeypatch, qwen, bf16,
                                                                      fresh_accelerator_state):
    """In a bf16 run (on the CPU: --bf16_on_cpu) the frozen matrices take 2 B a parameter, the adapters, norms and
    biases float32, and training changes the adapters alone; a float32 run keeps every weight in float32."""
    from trainer_fixtures import tiny_config
    from training_helpers import write_chat_rows

    from lowmem.config import TrainConfig
    from lowmem.model.weights import unwrap_gpt
    from lowmem.train.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    data = (write_chat_rows(tmp_path / "train.parquet", 64, seed=1), write_chat_rows(tmp_path / "valid.parquet", 8, 2))
    defaults = TrainConfig()  # the model's shape comes from the source: the tiny run's own shape left out
    config = tiny_config(tmp_path, data, defaults.tokenizer_dir, init_from=str(qwen), lora_rank=4, bf16=bf16,
                         bf16_on_cpu=bf16, max_steps=2, dropout=0.0, n_head=defaults.n_head, n_embd=defaults.n_embd,
                         n_layer=defaults.n_layer, vocab_size=defaults.vocab_size)
    trainer = Trainer(config)
    plain = unwrap_gpt(trainer.model)
    parameters = dict(plain.named_parameters())
    frozen_matrices = {name for name, p in parameters.items() if p.dim() == 2 and ".lora_" not in name}
    assert frozen_matrices and "tok_emb.weight" in frozen_matrices
    expected = torch.bfloat16 if bf16 else torch.float32
    assert {parameters[name].dtype for name in frozen_matrices} == {expected}
    assert {p.dtype for name, p in parameters.items() if name not in frozen_matrices} == {torch.float32}
    base = {name: parameters[name].detach().clone() for name in frozen_matrices}
    adapters = {name: p.detach().clone() for name, p in parameters.items() if ".lora_B." in name}
    summary = trainer.fit()
    assert summary["steps"] == 2 and summary["val_loss_end"] == summary["val_loss_end"]  # not NaN
    assert all(torch.equal(parameters[name], value) for name, value in base.items()), "the base stays as it was"
    assert any(not torch.equal(parameters[name], value) for name, value in adapters.items()), "the adapters train"


def test_an_export_hands_the_heap_back_after_each_tensor_it_writes(tmp_path, monkeypatch):
    """A tensor's temporaries (a merged matrix and its update, a slice read) are handed back before the next one is
    written, from the model in memory as from a checkpoint's files: exporting final/ and then best/ of adapters on a
    model of Qwen2.5-0.5B's widths held 315 MB above the start without it, 140 MB with it."""
    from safetensors import safe_open

    from lowmem.checkpoint import model_files
    from lowmem.model.weights import WEIGHTS_FILE, save_model_config

    handed_back: list[str] = []
    monkeypatch.setattr(model_files, "return_free_heap", lambda: handed_back.append("heap"))
    _, adapted = with_adapters("llama-gqa")
    folder = tmp_path / "merged"
    folder.mkdir()
    model_files.write_model(adapted, folder / WEIGHTS_FILE)
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as written:
        tensors = len(list(written.keys()))
    assert tensors > 10 and len(handed_back) == tensors

    save_model_config(base_model("llama-gqa").config, folder)
    handed_back.clear()
    with model_files.ModelWeights(folder) as weights:
        weights.write(tmp_path / "copy.safetensors")
    assert len(handed_back) == tensors
