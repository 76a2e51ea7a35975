"""The `plan` command: the memory plan of a `train` command, before anything is launched."""

from __future__ import annotations

from typing import Any

from lowmem.cli.common import resolve_config
from lowmem.cli.print_config import run_length_line, settle_and_plan, settled_printout
from lowmem.config import TrainConfig


def plan(use_large_config: bool = False, num_processes: int = 1, strategy: str = "", device: str = "",
         gpu_memory_gb: float = 0.0, is_keep_training: bool = False, largest: bool = False, **overrides: Any) -> None:
    """Print the memory plan of `train` with the same flags: each process's high-water by part, this machine's
    total against its budget, and the memory savers `train` would turn on (or why nothing fits).

    Nothing is launched or written; the interpreter's own memory is measured here, the batches from a sample
    of the training rows. Exit code 2 when nothing fits.

    Args:
        use_large_config: start from TrainConfigPretrainLarge, as `train --use_large_config=True`.
        num_processes: processes on this machine, as `accelerate launch --num_processes`.
        strategy: ddp (the default for several processes), fsdp (configs/accelerate/fsdp.yaml) or deepspeed
            (configs/accelerate/deepspeed_zero2_offload.yaml); single for one process.
        device: cpu or cuda (default: cuda when a GPU is visible).
        gpu_memory_gb: one GPU's memory (default: read from the GPU when there is one).
        is_keep_training: plan the resume of the run in output_dir (its model and memory savers are kept).
        largest: also say the largest model of these proportions this host trains, in full and with adapters (its
            width and depth scaled together, the memory savers chosen for each size); an FSDP plan always says it.
        overrides: any config field, as for `train`.
    """
    import accelerate  # noqa: F401 - measured with the interpreter, as a training process has it

    from lowmem.errors import ConfigError

    config, given = resolve_config(use_large_config, overrides, settle_for_print=lambda config, given: (
        settled_printout(config, given, is_keep_training,
                         planned_layout(config, num_processes, strategy, device, gpu_memory_gb))))
    layout = planned_layout(config, num_processes, strategy, device, gpu_memory_gb)
    # The run as `train` would settle it: a resume's architecture and savers, a source model's shape and load.
    config, decision, _ = settle_and_plan(config, given, is_keep_training, layout, largest=bool(largest))
    length = run_length_line(config, given, decision, layout)
    for line in decision.lines + decision.warnings + ([length] if length else []):
        print(line)
    if decision.error is not None:
        raise ConfigError(decision.error)


def planned_layout(config: TrainConfig, num_processes: int = 1, strategy: str = "", device: str = "",
                   gpu_memory_gb: float = 0.0) -> Any:
    """The `RunLayout` a plan is made for: `num_processes` on this machine, the strategy (ddp for several, single
    for one), the device (cuda when a GPU is visible) and one GPU's memory (read from the GPU when not given)."""
    import torch

    from lowmem.config import validate_config
    from lowmem.errors import ConfigError
    from lowmem.memory.plan import DDP, DEEPSPEED, FSDP, SINGLE, STRATEGIES
    from lowmem.train.memory_fit import RunLayout
    from lowmem.train.setup import refuse_adapters_under_deepspeed

    validate_config(config)
    if num_processes < 1:
        raise ConfigError(f"--num_processes must be at least 1 (it is {num_processes}).")
    strategy = strategy or (DDP if num_processes > 1 else SINGLE)
    if strategy not in STRATEGIES:
        raise ConfigError(f"--strategy must be one of {', '.join(STRATEGIES)} (it is {strategy!r}).")
    if strategy in (FSDP, DEEPSPEED, DDP) and num_processes == 1:
        strategy = SINGLE if strategy == DDP else strategy
    refuse_adapters_under_deepspeed(config, strategy == DEEPSPEED)
    on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if device not in ("", "cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda (it is {device!r}).")
    gpu_bytes = int(gpu_memory_gb * 2**30)
    if on_gpu and not gpu_bytes and torch.cuda.is_available():
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    return RunLayout(strategy=strategy, processes=num_processes, world_size=num_processes,
                     device="cuda" if on_gpu else "cpu", bf16=config.bf16 and (on_gpu or config.bf16_on_cpu),
                     deepspeed_offload=strategy == DEEPSPEED, launcher=num_processes > 1, gpu_bytes=gpu_bytes)
