"""The ready Accelerate config files: they load with Accelerate's own loader, say what the README says,
and the DeepSpeed / FSDP plugins build from them the way `accelerate launch` passes them on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType
from training_helpers import launcher_args

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs" / "accelerate"
EXPECTED = {"multi_gpu.yaml", "multi_node.yaml", "deepspeed_zero2_offload.yaml", "fsdp.yaml"}


def load(name: str) -> ClusterConfig:
    config = load_config_from_file(str(CONFIG_DIR / name))
    assert isinstance(config, ClusterConfig)
    return config


def test_every_expected_file_is_there_and_loads():
    assert EXPECTED <= {path.name for path in CONFIG_DIR.glob("*.yaml")}
    for path in CONFIG_DIR.glob("*.yaml"):
        config = load(path.name)
        assert config.compute_environment.value == "LOCAL_MACHINE", path.name
        assert config.mixed_precision == "bf16" and not config.use_cpu, f"{path.name}: bf16 on GPUs"
        assert config.num_processes >= 2, path.name


def test_multi_gpu_is_one_machine_of_data_parallel():
    config = load("multi_gpu.yaml")
    assert config.distributed_type == DistributedType.MULTI_GPU
    assert config.num_machines == 1 and config.machine_rank == 0


def test_multi_node_names_the_main_machine_and_comments_what_to_edit():
    config = load("multi_node.yaml")
    assert config.distributed_type == DistributedType.MULTI_GPU
    assert config.num_machines >= 2 and config.machine_rank == 0
    assert config.num_processes % config.num_machines == 0, "num_processes is the total over all machines"
    assert config.main_process_ip and config.main_process_port
    text = (CONFIG_DIR / "multi_node.yaml").read_text()
    for field in ("machine_rank", "num_machines", "num_processes", "main_process_ip", "main_process_port"):
        line = next(line for line in text.splitlines() if line.startswith(field + ":"))
        assert "# EDIT" in line, f"{field} must say that it is edited per machine"
    args = launcher_args("multi_node.yaml")
    assert args.multi_gpu and args.num_machines == config.num_machines


def test_deepspeed_is_zero2_with_the_optimizer_offloaded_to_the_cpu():
    config = load("deepspeed_zero2_offload.yaml")
    assert config.distributed_type == DistributedType.DEEPSPEED
    ds = config.deepspeed_config
    assert ds["zero_stage"] == 2 and ds["offload_optimizer_device"] == "cpu" and ds["offload_param_device"] == "none"
    # Left to the trainer, which passes --gradient_accumulation_steps and --grad_clip.
    assert "gradient_accumulation_steps" not in ds and "gradient_clipping" not in ds


def deepspeed_launch_environment(monkeypatch) -> None:
    """The environment `accelerate launch --config_file configs/accelerate/deepspeed_zero2_offload.yaml` gives
    each process."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    _command, env = prepare_deepspeed_cmd_env(launcher_args("deepspeed_zero2_offload.yaml"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_deepspeed_plugin_builds_from_the_file(monkeypatch):
    """DeepSpeedPlugin needs no deepspeed package to build: its config is what the engine would get."""
    from accelerate.utils import DeepSpeedPlugin

    deepspeed_launch_environment(monkeypatch)
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 2 and plugin.offload_optimizer_device == "cpu"
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu"
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto", \
        "filled in by lowmem.distributed.strategy"
    assert "optimizer" not in plugin.deepspeed_config, "the trainer's AdamW is used (as DeepSpeed's CPU Adam)"


def test_fsdp_is_full_shard_wrapping_the_models_blocks():
    config = load("fsdp.yaml")
    assert config.distributed_type == DistributedType.FSDP
    fsdp = config.fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is True  # FSDP2's full shard
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    from lowmem.model import gpt as model

    assert isinstance(getattr(model, fsdp["fsdp_transformer_layer_cls_to_wrap"]), type), "a class of lowmem.model"


def test_fsdp_plugin_builds_from_the_file(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    env = prepare_multi_gpu_env(launcher_args("fsdp.yaml"))
    assert env["ACCELERATE_USE_FSDP"] == "true"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        plugin = FullyShardedDataParallelPlugin()
    except (ImportError, RuntimeError) as error:  # FSDP2 needs a recent torch; some builds lack distributed
        pytest.skip(f"the FSDP plugin cannot be built here: {error}")
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["Block"]
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"
    assert not plugin.cpu_ram_efficient_loading


def fsdp_launch_environment(monkeypatch) -> None:
    """The environment `accelerate launch --config_file configs/accelerate/fsdp.yaml` gives each process."""
    from accelerate.utils.launch import prepare_multi_gpu_env

    for name, value in prepare_multi_gpu_env(launcher_args("fsdp.yaml")).items():
        monkeypatch.setenv(name, value)


def test_fsdp2_in_bf16_gets_float32_reduction_and_outputs(monkeypatch):
    """Accelerate's own FSDP2 policy for bf16 is bf16 throughout (and FSDP2 runs without autocast): the trainer
    gives it bf16 compute with float32 gradient reduction and outputs instead, and Accelerate keeps it."""
    from lowmem.distributed.accelerator import fsdp_plugin_for

    fsdp_launch_environment(monkeypatch)
    try:
        plugin = fsdp_plugin_for("bf16")
    except (ImportError, RuntimeError) as error:
        pytest.skip(f"the FSDP plugin cannot be built here: {error}")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = plugin.mixed_precision_policy
    assert isinstance(policy, MixedPrecisionPolicy) and plugin.fsdp_version == 2
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32,
                                                                             torch.float32)
    plugin.set_mixed_precision("bf16")  # what AcceleratorState does with the plugin it is given
    assert plugin.mixed_precision_policy is policy
    assert plugin.transformer_cls_names_to_wrap == ["Block"], "the rest comes from the launcher's environment"

    # What Accelerate would have used: bf16 for all three.
    accelerate_default = fsdp_plugin_for("no")
    accelerate_default.set_mixed_precision("bf16")
    default = accelerate_default.mixed_precision_policy
    assert (default.param_dtype, default.reduce_dtype, default.output_dtype) == (torch.bfloat16,) * 3


def test_fsdp_plugin_is_built_only_for_an_fsdp_launch(monkeypatch):
    from lowmem.distributed.accelerator import fsdp_plugin_for

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert fsdp_plugin_for("bf16") is None


class CPUAdamKernel:
    """Stands in for DeepSpeed's compiled cpu_adam extension (a C++ build of a minute or more): records what the
    optimizer hands the kernel."""

    def __init__(self) -> None:
        self.created: dict = {}
        self.updates: list[dict] = []

    def load(self) -> "CPUAdamKernel":  # CPUAdamBuilder().load()
        return self

    def create_adam(self, opt_id, lr, beta1, beta2, eps, weight_decay, adamw_mode, should_log) -> None:
        self.created = {"adamw_mode": adamw_mode}

    def adam_update(self, opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, param, grad,
                    exp_avg, exp_avg_sq) -> None:
        self.updates.append({"dim": param.dim(), "betas": (beta1, beta2), "weight_decay": weight_decay, "lr": lr})

    def destroy_adam(self, opt_id) -> None:
        pass


def test_deepspeed_offload_steps_our_adamw_as_cpu_adam_in_adamw_mode(monkeypatch):
    """Under the offload config accelerate swaps the trainer's optimizer for DeepSpeed's CPU Adam
    (`map_pytorch_optim_to_deepspeed`, as `Accelerator.prepare` does): it must come out in AdamW mode (decoupled
    weight decay), with our betas, and weight decay on matrices only."""
    pytest.importorskip("deepspeed", reason="deepspeed is only needed with deepspeed_zero2_offload.yaml")
    import types

    import deepspeed.ops.adam.cpu_adam as cpu_adam
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed

    from lowmem.distributed import strategy
    from lowmem.model import GPT, GPTConfig

    deepspeed_launch_environment(monkeypatch)
    kernel = CPUAdamKernel()
    monkeypatch.setattr(cpu_adam, "CPUAdamBuilder", lambda: kernel)
    accelerator = types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, device=torch.device("cuda", 0),
                                        state=types.SimpleNamespace(deepspeed_plugin=DeepSpeedPlugin()))
    config = types.SimpleNamespace(weight_decay=0.1, learn_rate=3e-4, adam_beta1=0.9, adam_beta2=0.95)
    model = GPT(GPTConfig(vocab_size=96, max_seq_len=16, n_layer=1, n_head=2, n_embd=16))

    handed = strategy._create_optimizer(model, config, accelerator)
    assert type(handed) is torch.optim.AdamW and not handed.defaults.get("fused"), "a plain torch AdamW"
    optimizer = map_pytorch_optim_to_deepspeed(handed)
    assert isinstance(optimizer, cpu_adam.DeepSpeedCPUAdam)
    assert optimizer.adam_w_mode and kernel.created == {"adamw_mode": True}

    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    assert len(kernel.updates) == len(list(model.parameters()))
    for update in kernel.updates:
        assert update["betas"] == (0.9, 0.95) and update["lr"] == 3e-4
        assert update["weight_decay"] == (0.1 if update["dim"] >= 2 else 0.0), update


def test_deepspeed_offload_config_leaves_host_memory_unpinned(monkeypatch):
    """Recent DeepSpeed pins offloaded buffers unless told otherwise; the trainer tells it (see the yaml file)."""
    import types

    from accelerate.utils import DeepSpeedPlugin

    from lowmem.distributed import strategy

    deepspeed_launch_environment(monkeypatch)
    plugin = DeepSpeedPlugin()
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(deepspeed_plugin=plugin))
    strategy._fill_deepspeed_config(types.SimpleNamespace(batch_size_per_gpu=8, grad_clip=1.0), accelerator)
    assert plugin.deepspeed_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "nvme_path": None,
                                                                               "pin_memory": False}
    assert "pin_memory" in (CONFIG_DIR / "deepspeed_zero2_offload.yaml").read_text(), "the file says why"
