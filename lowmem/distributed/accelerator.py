"""Creating the Accelerator: GPUs when there are any, else the CPU with gloo, and as many processes as launched."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (DistributedDataParallelKwargs, DistributedType, FullyShardedDataParallelPlugin,
                               InitProcessGroupKwargs, parse_flag_from_env)

from lowmem.config import OptimConfig
from lowmem.distributed.collectives import local_processes
from lowmem.errors import ConfigError
from lowmem.program import launch_line

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

logger = logging.getLogger(__name__)



def bf16_supported(device: torch.device) -> bool:
    """True when bf16 autocast pays on `device`: a CUDA GPU that computes in bf16 natively (compute
    capability 8.0 and later: A100, RTX 30xx, H100, ...; ROCm GPUs).

    torch's default answer counts emulation, true on a T4 or V100, where bf16 runs slower than float32: it
    does not count here. The question is asked of `device`, this process's own GPU, so that no rank touches
    GPU 0 (creating a context there) on the way. On the CPU it stays off: even on a Xeon with AVX-512 BF16
    and AMX, the demo model's steps under CPU autocast took about twice as long as in float32, with a higher
    and growing RSS.
    """
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def bf16_for(device: torch.device, bf16: bool, bf16_on_cpu: bool = False) -> bool:
    """Whether this process computes under bf16 autocast: the config's `bf16` on a GPU that computes bf16
    natively (`bf16_supported`), and on the CPU only when asked for with `bf16_on_cpu` (to run the GPU's
    precision where there is no GPU: CPU autocast is correct but rarely faster)."""
    if not bf16:
        return False
    return bf16_on_cpu if device.type == "cpu" else bf16_supported(device)


def _precision_reason(mixed_precision: str, device: torch.device, bf16: bool, bf16_on_cpu: bool) -> str:
    """Why the run computes as it does, in the words of the flags that decide it (see `bf16_for`)."""
    if mixed_precision == "bf16":
        return "from --bf16=True and --bf16_on_cpu=True" if device.type == "cpu" else "from --bf16=True"
    if not bf16:
        return "from --bf16=False"
    if device.type == "cpu":
        return "--bf16=True is for GPUs: the CPU runs float32 unless --bf16_on_cpu=True"
    return "--bf16=True, but this GPU does not compute bf16 natively"


def launcher_precision_note(mixed_precision: str, device: torch.device, bf16: bool,
                            bf16_on_cpu: bool = False) -> str | None:
    """One line for the run log when `accelerate launch` announced a precision the run does not use; else None.

    lowmem chooses the precision itself (`create_accelerator` passes it to the Accelerator, which then ignores the
    launcher's): without a config file, the launcher prints that `--mixed_precision` was set to 'no' while the run
    trains in bf16. The launcher prints that before our code runs, so the log says which precision is used and why.

    Args:
        mixed_precision: the Accelerator's, "bf16" or "no".
        device: this process's device.
        bf16 / bf16_on_cpu: the config's flags, which decided it (see `bf16_for`).
    """
    # `accelerate launch` passes its --mixed_precision on in this variable: "no" when neither the flag nor a config
    # file gave one, and then it prints "`--mixed_precision` was set to a value of `'no'`" before our code runs.
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "").strip().lower()
    if not launcher or launcher == mixed_precision:
        return None  # not started by accelerate launch, or it said what the run does
    used = "bf16" if mixed_precision == "bf16" else "float32"
    reason = _precision_reason(mixed_precision, device, bf16, bf16_on_cpu)
    if launcher == "no":
        launcher_said = "accelerate launch's note that --mixed_precision was set to 'no' is its own default"
    else:
        launcher_said = f"accelerate launch's --mixed_precision={launcher} is not used"
    if used == "bf16":
        other = "--bf16=False trains in float32"
    else:
        other = "--bf16=True trains in bf16 on GPUs that compute it natively (on the CPU with --bf16_on_cpu=True)"
    return f"Mixed precision: {used} ({reason}). {launcher_said}: lowmem sets the precision itself; {other}."


def log_launcher_precision_note(accelerator: Accelerator, bf16: bool, bf16_on_cpu: bool = False) -> None:
    """Log `launcher_precision_note` for this run, when there is one."""
    note = launcher_precision_note(str(accelerator.mixed_precision), accelerator.device, bf16, bf16_on_cpu)
    if note is not None:
        logger.info(note)


def requested_processes() -> int:
    """How many processes the launcher was asked for, over all machines.

    torchrun and multi-process `accelerate launch` set WORLD_SIZE (the total over all machines; on several
    machines `accelerate launch --num_processes` is that total too, and each machine starts its share). A
    single-process `accelerate launch` sets nothing, even when given `--num_processes 3` (on a machine
    without GPUs and without `--multi_gpu`), so the launcher's own command line (our parent process) is
    read as well.
    """
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    try:
        import psutil

        arguments = psutil.Process().parent().cmdline()
    except Exception:  # noqa: BLE001 - no parent information: nothing more to check
        return 1
    if not any(arg.endswith("accelerate") for arg in arguments[:2]) or "launch" not in arguments:
        return 1
    for index, arg in enumerate(arguments):
        if arg == "--num_processes" and index + 1 < len(arguments):
            return int(arguments[index + 1])
        if arg.startswith("--num_processes="):
            return int(arg.split("=", 1)[1])
    return 1


def fsdp2_bf16_policy() -> MixedPrecisionPolicy:
    """FSDP2's mixed precision as DDP's bf16 autocast has it: bf16 compute, float32 gradients and outputs.

    Accelerate's own FSDP2 policy for bf16 is bf16 throughout, and FSDP2 gets no autocast wrapper: the loss
    would come back in bf16, and gradients would be reduced over the ranks (and accumulated over
    micro-batches) in bf16, losing the small updates that float32 keeps. With `reduce_dtype` float32 the
    gradients are upcast before the reduce-scatter and accumulate in float32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)


def fsdp_plugin_for(mixed_precision: str) -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin `accelerate launch` configured (from its environment), with `fsdp2_bf16_policy` when
    the run is FSDP2 in bf16; None when the launch is not FSDP (Accelerate then builds nothing either)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    plugin = FullyShardedDataParallelPlugin()  # every other setting as the launcher's environment says
    if plugin.fsdp_version == 2 and mixed_precision == "bf16":
        # Accelerate keeps a policy object it is given (it replaces only a missing one, a string or a dict).
        plugin.mixed_precision_policy = fsdp2_bf16_policy()
    return plugin


def fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin | None) -> None:
    """Run FSDP2 on the CPU (gloo) when the launcher asked for FSDP and there is no GPU.

    Accelerate builds FSDP only on accelerators: on the CPU (`MULTI_CPU`) it keeps a full replica per process
    and trains DDP, so `accelerate launch --config_file configs/accelerate/fsdp.yaml` on a machine without GPUs
    would log FSDP's settings while running something else. FSDP2's `fully_shard` itself runs on CPU tensors
    over gloo, so the state is given what Accelerate's `AcceleratorState` gives a GPU launch (the FSDP
    distributed type and the plugin), and `accelerator.prepare`, the checkpoints and evaluation then take the
    very path they take on GPUs. (FSDP1 never gets here on a machine without GPUs: Accelerate's FSDP1 plugin
    asks for a GPU when it is built.)
    """
    if plugin is None or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    if torch.accelerator.is_available() or plugin.fsdp_version != 2:
        # The CPU asked for on a machine with GPUs (ACCELERATE_USE_CPU=1, use_cpu: true): fully_shard's
        # default device mesh would be on the GPU, which gloo on the CPU cannot feed.
        raise ConfigError("FSDP on the CPU of a machine with a GPU visible is not supported: run FSDP on the GPUs "
                          "(without ACCELERATE_USE_CPU=1 or use_cpu: true), or hide them (CUDA_VISIBLE_DEVICES=) "
                          "to run FSDP2 on the CPU.")
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState sets it


def offloads_optimizer(accelerator: Accelerator) -> bool:
    """True when DeepSpeed keeps the optimizer state in host memory (or on NVMe) and steps it on the CPU."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return False
    return accelerator.state.deepspeed_plugin.offload_optimizer_device in ("cpu", "nvme")


def offload_optimizer_threads(accelerator: Accelerator) -> None:
    """Give DeepSpeed's CPU Adam this process's share of the machine's cores when the optimizer is offloaded.

    `accelerate launch` sets OMP_NUM_THREADS=1 unless told otherwise, and the offloaded optimizer step (all
    of AdamW's arithmetic, in host memory) then runs on one core per process while the others idle. The
    CPU Adam extension uses the OpenMP runtime torch has loaded, whose thread count `torch.set_num_threads`
    sets; OMP_NUM_THREADS is set as well for an extension that brings its own runtime and reads it when it
    loads (in `accelerator.prepare`, after this). A value other than 1 was chosen by the user and is kept.
    """
    if not offloads_optimizer(accelerator):
        return
    if os.environ.get("OMP_NUM_THREADS", "1") != "1":
        return
    # The CPUs this process may run on (taskset, a container's cpuset), shared with the machine's other ranks.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // local_processes(accelerator))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    logger.info("DeepSpeed optimizer offload: CPU Adam steps with %d threads per process (%d cores, %d processes "
                "on this machine).", threads, cores, local_processes(accelerator))


@dataclass(frozen=True)
class DdpSettings:
    """How DDP all-reduces the gradients: in buckets of `bucket_cap_mb` MB, and with `bf16_gradients` (in a bf16
    run) as bf16 (`lowmem.distributed.gradient_hooks`, registered when the model is prepared)."""

    bucket_cap_mb: int = 25  # torch's default
    bf16_gradients: bool = False

    def handler(self) -> DistributedDataParallelKwargs:
        """Accelerate's DDP settings. DDP's gradients are views into its all-reduce buckets: without it every gradient
        is held twice, once in the parameter and once in the bucket (4 bytes per parameter more on each process,
        438 MB on the large config), and copied in and out at every step."""
        return DistributedDataParallelKwargs(gradient_as_bucket_view=True, bucket_cap_mb=self.bucket_cap_mb)

    def compresses(self, accelerator: Accelerator) -> bool:
        """Whether the gradients go in bf16: asked for, in a bf16 run."""
        return self.bf16_gradients and accelerator.mixed_precision == "bf16"

    def describe(self, accelerator: Accelerator) -> str:
        """How the gradients are all-reduced, for the log's parallelism line."""
        ignored = " (--ddp_bf16_gradients is for bf16 runs)" if self.bf16_gradients and \
            not self.compresses(accelerator) else ""
        return (f"gradients all-reduced in {'bf16' if self.compresses(accelerator) else 'float32'}{ignored}, buckets "
                f"of {self.bucket_cap_mb} MB")


def ddp_settings(config: OptimConfig) -> DdpSettings:
    """The DDP settings a config asks for (`--ddp_bucket_cap_mb`, `--ddp_bf16_gradients`)."""
    return DdpSettings(config.ddp_bucket_cap_mb, config.ddp_bf16_gradients)


def create_accelerator(gradient_accumulation_steps: int, bf16: bool, process_group_timeout_minutes: float,
                       log_with: str | None = None, project_dir: str | None = None,
                       bf16_on_cpu: bool = False, ddp: DdpSettings | None = None) -> Accelerator:
    """An Accelerator on the GPUs if there are any, else on the CPU (gloo between processes).

    The process group comes first (accelerate's PartialState, which also sets this process's GPU), so that
    bf16 is decided on the GPU this process uses. Fails loudly when the launcher started more processes than
    Accelerate sees: on a machine without GPUs, `accelerate launch --num_processes 3` starts one process
    unless given `--multi_gpu`, and every rank would silently train on all the data.

    Args:
        gradient_accumulation_steps: micro-batches per optimizer step.
        bf16: bf16 mixed precision where the GPU computes bf16 natively (see `bf16_supported`).
        process_group_timeout_minutes: how long a collective waits for the slowest rank before the run fails
            (NCCL's default is 10 minutes; a first run's tokenizer training on rank 0 can take longer).
        log_with: Accelerate's tracker for the training curves ("tensorboard", "wandb"), or None.
        project_dir: the trackers' logging folder (see `lowmem.train.tracking.tracker_arguments`).
        bf16_on_cpu: with `bf16`, bf16 autocast on the CPU as well (see `bf16_for`).
        ddp: how DDP all-reduces the gradients (`DdpSettings`; torch's buckets in float32 by default).
    """
    on_cpu = not torch.cuda.is_available()
    cpu = on_cpu or parse_flag_from_env("ACCELERATE_USE_CPU")  # as AcceleratorState would decide it
    timeout = timedelta(minutes=process_group_timeout_minutes)
    # Passed to PartialState directly: InitProcessGroupKwargs.to_kwargs() drops a timeout equal to NCCL's
    # default, which would leave gloo at its own 30 minutes. The handler tells Accelerate the same.
    state = PartialState(cpu=cpu, timeout=timeout)
    mixed_precision = "bf16" if bf16_for(state.device, bf16, bf16_on_cpu) else "no"
    fsdp_plugin = fsdp_plugin_for(mixed_precision)
    ddp = ddp or DdpSettings()
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=gradient_accumulation_steps,
                              mixed_precision=mixed_precision, fsdp_plugin=fsdp_plugin,
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout), ddp.handler()],
                              log_with=log_with, project_dir=project_dir)
    launched = requested_processes()
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"The launcher was asked for {launched} processes, but Accelerate runs {accelerator.num_processes}. "
            "On a machine without GPUs use "
            f"`ACCELERATE_USE_CPU=1 {launch_line('--multi_gpu --num_processes N', 'train')}`; on GPUs check that "
            "N GPUs are visible (CUDA_VISIBLE_DEVICES). On several "
            "machines N is the total over all of them, and every machine needs --multi_gpu (or a config file "
            "from configs/accelerate/)."
        )
    fsdp_on_cpu(accelerator, fsdp_plugin)
    offload_optimizer_threads(accelerator)
    return accelerator
