"""lowmem.distributed.strategy on the CPU: plain names for wrapped models, checkpoint parts per strategy, the
eval model.

DeepSpeed and FSDP need GPUs (and deepspeed) to run for real; here their checkpoint code runs on a plain
model in one process (torch.distributed.checkpoint works without a process group), and a stand-in for
DeepSpeed's engine checks what the engine is asked to do.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_model

from lowmem.distributed import strategy
from lowmem.model import weights
from lowmem.errors import ConfigError
from lowmem.model import GPT, GPTConfig


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=100, max_seq_len=16, n_layer=2, n_head=2, n_embd=16))


def stub_accelerator(kind: DistributedType = DistributedType.NO, fsdp_version: int = 2,
                     **plugin: object) -> types.SimpleNamespace:
    """What parallelism reads from an Accelerator, for one process."""
    state = types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(**plugin) if plugin else None,
                                  fsdp_plugin=types.SimpleNamespace(fsdp_version=fsdp_version))
    return types.SimpleNamespace(distributed_type=kind, is_main_process=True, process_index=0, num_processes=1,
                                 device=torch.device("cpu"), state=state)


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, 100, (2, 12))  # (B, T)
    _, loss = model(tokens, tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    left, right = weights.model_state_dict(a), weights.model_state_dict(b)
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


class DistributedDataParallel(torch.nn.Module):
    """Stands in for DDP's wrapper (a real one needs a process group): the model under `.module`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


# ----- names ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["blocks.0.ln_1.weight", "module.blocks.0.ln_1.weight",
                                 "_orig_mod.blocks.0.ln_1.weight", "_orig_mod.module.blocks.0.ln_1.weight",
                                 "module._orig_mod.blocks.0.ln_1.weight"])
def test_wrapper_prefixes_are_stripped(key):
    assert weights.strip_prefixes(key) == "blocks.0.ln_1.weight"


def test_compiled_and_ddp_models_give_plain_names():
    model = tiny_gpt()
    plain_keys = set(model.state_dict())
    compiled = torch.compile(model)  # not run: the wrapper's keys already carry `_orig_mod.`
    assert all(key.startswith("_orig_mod.") for key in compiled.state_dict())
    assert set(weights.model_state_dict(compiled)) == plain_keys
    assert set(weights.model_state_dict(DistributedDataParallel(model))) == plain_keys
    assert weights.unwrap(torch.compile(DistributedDataParallel(model))) is model


def test_state_with_prefixes_loads_into_a_plain_model():
    source, target = tiny_gpt(0), tiny_gpt(1)
    weights.load_model_state_dict(target, DistributedDataParallel(source).state_dict())  # `module.` keys
    assert same_weights(source, target)
    weights.load_model_state_dict(target, torch.compile(tiny_gpt(2)).state_dict())  # `_orig_mod.` keys
    assert same_weights(tiny_gpt(2), target)


# ----- weight files -----------------------------------------------------------------------------------------
def test_save_compiled_load_plain_and_back(tmp_path):
    trained = tiny_gpt(0)
    weights.save_weights(torch.compile(trained), tmp_path / "compiled.safetensors")
    assert not any(key.startswith("_orig_mod.") for key in load_file(tmp_path / "compiled.safetensors"))
    plain = tiny_gpt(1)
    weights.load_weights(plain, tmp_path / "compiled.safetensors")
    assert same_weights(trained, plain)

    weights.save_weights(plain, tmp_path / "plain.safetensors")
    compiled = torch.compile(tiny_gpt(2))
    weights.load_weights(compiled, tmp_path / "plain.safetensors")
    assert same_weights(trained, compiled)
    assert compiled._orig_mod.lm_head.weight is compiled._orig_mod.tok_emb.weight, "the tie survives loading"


def test_weight_files_match_safetensors_save_model(tmp_path):
    """Tied weights are written once, under the name save_model keeps: old and new files are interchangeable."""
    model = tiny_gpt()
    save_model(model, str(tmp_path / "reference.safetensors"))
    weights.save_weights(model, tmp_path / "ours.safetensors")
    reference, ours = load_file(tmp_path / "reference.safetensors"), load_file(tmp_path / "ours.safetensors")
    assert reference.keys() == ours.keys()
    assert all(torch.equal(reference[key], ours[key]) for key in reference)


def test_loading_weights_of_another_model_fails(tmp_path):
    weights.save_weights(tiny_gpt(), tmp_path / "w.safetensors")
    state = load_file(tmp_path / "w.safetensors")
    del state["blocks.1.mlp.fc.weight"]
    with pytest.raises(RuntimeError, match=r"missing \['blocks.1.mlp.fc.weight'\]"):
        weights.load_model_state_dict(tiny_gpt(), state)


# ----- checkpoint parts -------------------------------------------------------------------------------------
def round_trip(folder: Path, accelerator, wrap=lambda m: m) -> tuple[GPT, torch.optim.Optimizer, GPT,
                                                                       torch.optim.Optimizer]:
    model = tiny_gpt(0)
    optimizer = model.configure_optimizer(0.1, 1e-3)
    one_step(model, optimizer)
    strategy.save_model_and_optimizer(folder, wrap(model), optimizer, accelerator)
    restored = tiny_gpt(1)
    restored_optimizer = restored.configure_optimizer(0.1, 1e-3)
    strategy.load_model_and_optimizer(folder, wrap(restored), restored_optimizer, accelerator)
    return model, optimizer, restored, restored_optimizer


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert left["param_groups"] == right["param_groups"]
    assert left["state"].keys() == right["state"].keys()
    for index, values in left["state"].items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(right["state"][index][name])), (index, name)


@pytest.mark.parametrize("wrap", [lambda m: m, torch.compile, DistributedDataParallel],
                         ids=["plain", "compiled", "ddp"])
def test_plain_checkpoint_round_trip(tmp_path, wrap):
    model, optimizer, restored, restored_optimizer = round_trip(tmp_path, stub_accelerator(), wrap)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model_config.json", "optimizer.pt"]
    assert same_weights(model, restored)
    assert_same_optimizer(optimizer, restored_optimizer)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp2_checkpoint_code_on_one_process(tmp_path):
    """FSDP2's path (each rank's shards of the weights and of the optimizer state, with JSON indexes) on an unsharded
    model: one piece of each tensor, nothing pickled."""
    model, optimizer, restored, restored_optimizer = round_trip(tmp_path, stub_accelerator(DistributedType.FSDP))
    for folder in ("model_shards", "optimizer_shards"):
        assert sorted(path.name for path in (tmp_path / folder).iterdir()) == ["index.json", "rank00000.safetensors"]
    assert not (tmp_path / "optimizer.pt").exists() and not (tmp_path / "model.safetensors").exists()
    assert same_weights(model, restored)
    assert_same_optimizer(optimizer, restored_optimizer)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp1_checkpoint_code_on_one_process(tmp_path):
    """FSDP1's path (gathered weights, optimizer through torch.distributed.checkpoint) on an unsharded model."""
    model, optimizer, restored, restored_optimizer = round_trip(tmp_path, stub_accelerator(DistributedType.FSDP, 1))
    assert (tmp_path / "optimizer" / ".metadata").is_file() and list((tmp_path / "optimizer").glob("*.distcp"))
    assert not (tmp_path / "optimizer.pt").exists()
    assert same_weights(model, restored)
    assert_same_optimizer(optimizer, restored_optimizer)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("version", [1, 2])
def test_checkpoint_of_another_strategy_is_refused_with_a_message(tmp_path, version):
    round_trip(tmp_path, stub_accelerator(DistributedType.FSDP, version))
    model = tiny_gpt()
    with pytest.raises(ConfigError, match="saved under fsdp and this run uses plain"):
        strategy.load_model_and_optimizer(tmp_path, model, model.configure_optimizer(0.1, 1e-3),
                                             stub_accelerator())


class DeepSpeedEngine(torch.nn.Module):
    """Stands in for DeepSpeed's engine: records what it is asked to save and load."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.calls: list[tuple] = []

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        self.calls.append(("save", save_dir, tag, save_latest))
        (Path(save_dir) / tag).mkdir(parents=True)
        # A pickle of data, as DeepSpeed's writer makes (its loader checks what the pickle names first).
        shard = Path(save_dir) / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": {"zero_stage": 2}}, shard)

    def load_checkpoint(self, load_dir: str, tag: str, **options: object) -> tuple[str | None, dict]:
        self.calls.append(("load", load_dir, tag, options))
        return str(Path(load_dir) / tag), {}


def test_deepspeed_engine_saves_its_own_shards_and_weights_are_exported_whole(tmp_path):
    accelerator = stub_accelerator(DistributedType.DEEPSPEED, zero_stage=2, offload_optimizer_device="cpu")
    model = tiny_gpt()
    engine = DeepSpeedEngine(model)
    strategy.save_model_and_optimizer(tmp_path, engine, optimizer=None, accelerator=accelerator)
    assert engine.calls == [("save", str(tmp_path / "deepspeed"), "state", False)]
    assert (tmp_path / "deepspeed" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    assert not (tmp_path / "optimizer.pt").exists()
    plain = tiny_gpt(1)
    weights.load_weights(plain, tmp_path / "model.safetensors")  # plain names, for evaluation and export
    assert same_weights(model, plain)

    strategy.load_model_and_optimizer(tmp_path, engine, optimizer=None, accelerator=accelerator)
    assert engine.calls[-1][:3] == ("load", str(tmp_path / "deepspeed"), "state")
    assert engine.calls[-1][3]["load_optimizer_states"] is True
    with strategy.model_for_eval(engine, accelerator) as eval_model:
        assert eval_model is model, "ZeRO-2 keeps whole weights on every rank: no copy"


def test_deepspeed_zero3_is_refused_with_a_message():
    accelerator = stub_accelerator(DistributedType.DEEPSPEED, zero_stage=3, offload_optimizer_device="cpu")
    with pytest.raises(ConfigError, match="ZeRO stage 3.*deepspeed_zero2_offload.yaml"):
        strategy.prepare_model_and_optimizer(tiny_gpt(), config=None, accelerator=accelerator)


def test_deepspeed_config_gets_batch_size_and_clipping_from_the_run():
    accelerator = stub_accelerator(DistributedType.DEEPSPEED, zero_stage=2, offload_optimizer_device="none",
                                   deepspeed_config={"train_micro_batch_size_per_gpu": "auto",
                                                     "gradient_clipping": "auto"})
    config = adamw_config()
    strategy._fill_deepspeed_config(config, accelerator)
    assert accelerator.state.deepspeed_plugin.deepspeed_config == {"train_micro_batch_size_per_gpu": 24,
                                                                   "gradient_clipping": 0.5}
    # Without offload the torch AdamW is kept (DeepSpeed wraps it), with the model's two parameter groups.
    optimizer = strategy._create_optimizer(tiny_gpt(), config, accelerator)
    assert isinstance(optimizer, torch.optim.AdamW) and len(optimizer.param_groups) == 2


def adamw_config() -> types.SimpleNamespace:
    return types.SimpleNamespace(batch_size_per_gpu=24, grad_clip=0.5, weight_decay=0.1, learn_rate=1e-3,
                                 adam_beta1=0.9, adam_beta2=0.95)


def deepspeed_on_gpus(offload: str, deepspeed_config: dict | None = None) -> types.SimpleNamespace:
    accelerator = stub_accelerator(DistributedType.DEEPSPEED, zero_stage=2, offload_optimizer_device=offload,
                                   deepspeed_config=deepspeed_config or {})
    accelerator.device = torch.device("cuda", 0)  # only its type is read: "cuda" would choose the fused AdamW
    return accelerator


def test_deepspeed_offload_is_handed_a_plain_torch_adamw():
    """accelerate replaces it with DeepSpeed's CPU Adam, in AdamW mode only for a torch.optim.AdamW, from its
    parameter groups (test_accelerate_configs.py checks the replacement itself where deepspeed is installed)."""
    optimizer = strategy._create_optimizer(tiny_gpt(), adamw_config(), deepspeed_on_gpus("cpu"))
    assert type(optimizer) is torch.optim.AdamW and not optimizer.defaults.get("fused")
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert all(group["betas"] == (0.9, 0.95) for group in optimizer.param_groups)
    # Without offload DeepSpeed steps the torch optimizer on the GPU: the fused kernel is kept.
    optimizer = strategy._create_optimizer(tiny_gpt(), adamw_config(), deepspeed_on_gpus("none"))
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults.get("fused")


def test_deepspeed_config_with_its_own_optimizer_gets_our_groups():
    from accelerate.utils import DummyOptim

    accelerator = deepspeed_on_gpus("cpu", {"optimizer": {"type": "AdamW"}})
    optimizer = strategy._create_optimizer(tiny_gpt(), adamw_config(), accelerator)
    assert isinstance(optimizer, DummyOptim)
    assert [group["weight_decay"] for group in optimizer.params] == [0.1, 0.0]


def test_deepspeed_in_bf16_says_its_exports_are_bf16(caplog):
    accelerator = deepspeed_on_gpus("cpu")
    accelerator.mixed_precision = "bf16"
    accelerator.prepare = lambda *objects: objects
    with caplog.at_level("INFO", logger="lowmem.distributed.strategy"):
        strategy.prepare_model_and_optimizer(tiny_gpt(), adamw_config(), accelerator)
    assert "float32 master weights are only in each checkpoint's deepspeed/ folder" in caplog.text
    assert "zero_to_fp32.py" in caplog.text


def test_plain_tensors_pass_through_plain_tensor():
    value = torch.tensor(1.5)
    assert strategy.plain_tensor(value) is value


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp1_eval_model_is_a_whole_replica_and_fsdp2_runs_sharded():
    model = tiny_gpt().use_memory_savers(loss_chunk_tokens=64, checkpoint_activations=True)
    with strategy.model_for_eval(model, stub_accelerator(DistributedType.FSDP, 2)) as sharded:
        assert sharded is model, "FSDP2: the training model itself, a unit at a time"
    with strategy.model_for_eval(model, stub_accelerator(DistributedType.FSDP, 1)) as replica:
        assert isinstance(replica, GPT) and replica is not model and not replica.training
        assert same_weights(model, replica)
        assert replica.lm_head.weight is replica.tok_emb.weight
        assert replica.memory_savers == model.memory_savers, "the validation loss is chunked in the replica too"
    with strategy.model_for_eval(torch.compile(model), stub_accelerator()) as plain:
        assert plain is model, "plain and DDP: the training model without its wrappers"
