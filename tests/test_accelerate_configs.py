"""The ready Accelerate config files: they load with Accelerate's own loader, say what the README says,
and the DeepSpeed / FSDP plugins build from them the way `accelerate launch` passes them on."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs" / "accelerate"
EXPECTED = {"multi_gpu.yaml", "multi_node.yaml", "deepspeed_zero2_offload.yaml", "fsdp.yaml"}


def load(name: str) -> ClusterConfig:
    config = load_config_from_file(str(CONFIG_DIR / name))
    assert isinstance(config, ClusterConfig)
    return config


def launcher_args(name: str) -> argparse.Namespace:
    """The arguments `accelerate launch --config_file <name>` works with, after it merged the file in."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(CONFIG_DIR / name), "train_low_mem.py", "train"])
    args, defaults, mixed_precision_from_file = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command does before starting DeepSpeed
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_file else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args


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


def test_deepspeed_plugin_builds_from_the_file(monkeypatch):
    """DeepSpeedPlugin needs no deepspeed package to build: its config is what the engine would get."""
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    _command, env = prepare_deepspeed_cmd_env(launcher_args("deepspeed_zero2_offload.yaml"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 2 and plugin.offload_optimizer_device == "cpu"
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu"
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto", "filled in by lowmem.distributed.strategy"
    assert "optimizer" not in plugin.deepspeed_config, "the trainer's optimizer (DeepSpeed's CPU Adam) is used"


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


def test_deepspeed_cpu_adam_is_there_when_deepspeed_is():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (it is only needed with deepspeed_zero2_offload.yaml)")
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # what lowmem.distributed.strategy creates with optimizer offload

    assert DeepSpeedCPUAdam
