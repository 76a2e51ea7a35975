"""Creating the Accelerator, and the checks that keep every rank in step."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from lowmem.errors import ConfigError

T = TypeVar("T")


def bf16_supported(on_cpu: bool) -> bool:
    """True when bf16 autocast pays: a CUDA GPU with bf16.

    On the CPU it stays off: even on a Xeon with AVX-512 BF16 and AMX, the demo model's steps under CPU
    autocast took about twice as long as in float32, with a higher and growing RSS.
    """
    return not on_cpu and torch.cuda.is_bf16_supported()


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


def create_accelerator(gradient_accumulation_steps: int, bf16: bool) -> Accelerator:
    """An Accelerator on the GPUs if there are any, else on the CPU (gloo between processes).

    Fails loudly when the launcher started more processes than Accelerate sees: on a machine without GPUs,
    `accelerate launch --num_processes 3` starts one process unless given `--multi_gpu`, and every rank
    would silently train on all the data.
    """
    on_cpu = not torch.cuda.is_available()
    mixed_precision = "bf16" if bf16 and bf16_supported(on_cpu) else "no"
    accelerator = Accelerator(cpu=on_cpu, gradient_accumulation_steps=gradient_accumulation_steps,
                              mixed_precision=mixed_precision)
    launched = requested_processes()
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"The launcher was asked for {launched} processes, but Accelerate runs {accelerator.num_processes}. "
            "On a machine without GPUs use `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N "
            "train_low_mem.py train`; on GPUs check that N GPUs are visible (CUDA_VISIBLE_DEVICES). On several "
            "machines N is the total over all of them, and every machine needs --multi_gpu (or a config file "
            "from configs/accelerate/)."
        )
    return accelerator


def local_processes(accelerator: Accelerator) -> int:
    """Processes on this machine (LOCAL_WORLD_SIZE, set by the launcher); all of them on one machine."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))


def is_multi_node(accelerator: Accelerator) -> bool:
    """True when the processes run on more than one machine."""
    return accelerator.num_processes > local_processes(accelerator)


def check_shared_folder(accelerator: Accelerator, folder: str | Path, option: str = "--output_dir") -> None:
    """On several machines, fail early unless every process sees `folder` as the same folder.

    A checkpoint is one folder that every rank writes its part into and the main process then marks
    complete and renames: on a disk of one machine only, the other machines' parts would land elsewhere and
    the checkpoint could never be resumed from. The main process writes a probe file; every rank looks for it.
    """
    if not is_multi_node(accelerator):
        return
    token = broadcast_from_main(accelerator, lambda: uuid.uuid4().hex)
    probe = Path(folder) / f".lowmem-shared-{token}"
    if accelerator.is_main_process:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
    accelerator.wait_for_everyone()
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    [blind] = all_reduce_sum(accelerator, [0.0 if seen else 1.0])  # also keeps the probe until all have looked
    if accelerator.is_main_process:
        probe.unlink(missing_ok=True)
    if blind:
        raise ConfigError(
            f"{int(blind)} of {accelerator.num_processes} processes cannot see {option}={folder} as the main "
            "process writes it: on several machines, checkpoints must go to a filesystem that every machine "
            "mounts at the same path (NFS, a cluster filesystem). Set "
            f"{option} to such a path (the tokenizer folder too, or copy the tokenizer to every machine first)."
        )


def broadcast_from_main(accelerator: Accelerator, compute: Callable[[], T]) -> T:
    """Run `compute` on the main process only and give its result (any picklable object) to every rank."""
    value = [compute() if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(value, from_process=0)
    return value[0]


def all_reduce_sum(accelerator: Accelerator, values: list[float]) -> list[float]:
    """Sum a few numbers over all ranks (one small collective)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        tensor = accelerator.reduce(tensor, reduction="sum")
    return tensor.tolist()


def all_reduce_max(accelerator: Accelerator, values: list[float]) -> list[float]:
    """The maximum of a few numbers over all ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        gathered = accelerator.gather(tensor.unsqueeze(0))  # (world, n)
        tensor = gathered.max(dim=0).values
    return tensor.tolist()
