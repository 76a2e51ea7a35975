"""Collectives and checks that keep every rank in step: broadcasts, small all-reduces, the shared-folder probe."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable, TypeVar, cast

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from lowmem.errors import ConfigError, LowmemError

T = TypeVar("T")


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
    return cast(T, value[0])  # compute()'s result: the main process's own, or the broadcast's elsewhere


def run_on_main(accelerator: Accelerator, work: Callable[[], T]) -> T | None:
    """Run `work` on the main process while the others wait, and return its result there (None elsewhere).

    An error the user can fix (a LowmemError: a full disk, bad data) raised by `work` is raised on every rank, its
    message on the main process only: no rank waits for a process that has stopped, and the user reads one
    paragraph, not a launcher's report of hung ranks. Other errors (bugs) propagate from the main process as
    they are.
    """
    result, failure = None, None
    if accelerator.is_main_process:
        try:
            result = work()
        except LowmemError as error:
            failure = error
    failed = broadcast_from_main(accelerator, lambda: failure is not None)
    if failure is not None:
        raise failure
    if failed:
        raise LowmemError("")  # the main process says why
    return result


def end_process_group() -> None:
    """Destroy the process group (and the host group made from it), where one was made: called by the code that
    made it, once every rank has passed a last barrier."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _HOST_GROUP.clear()


_HOST_GROUP: list[dist.ProcessGroup] = []  # created once, on first use


def host_group(accelerator: Accelerator) -> dist.ProcessGroup | None:
    """A gloo process group for the few numbers the ranks exchange on the host (None where the default group
    is the one to use: one process, or processes on the CPU, which run gloo already).

    Through NCCL those numbers would go to the GPU, and reading them back would wait for every kernel queued
    before them: the CPU could no longer prepare the next step while the GPU computes this one. It is
    created on first use, which every rank reaches in the same collective, as `new_group` requires.
    """
    if accelerator.num_processes == 1 or accelerator.device.type == "cpu":
        return None
    if not _HOST_GROUP:
        # The same patience as the main process group (process_group_timeout_minutes), not gloo's default.
        handler = getattr(accelerator, "init_handler", None)
        _HOST_GROUP.append(dist.new_group(backend="gloo", timeout=getattr(handler, "timeout", None)))
    return _HOST_GROUP[0]


def _all_reduce(accelerator: Accelerator, values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)  # on the host: no wait for the GPU to read it back
    if accelerator.num_processes > 1:
        dist.all_reduce(tensor, op=op, group=host_group(accelerator))
    return tensor.tolist()


def all_reduce_sum(accelerator: Accelerator, values: list[float]) -> list[float]:
    """Sum a few numbers over all ranks (one small collective, on the host)."""
    return _all_reduce(accelerator, values, dist.ReduceOp.SUM)


def all_reduce_max(accelerator: Accelerator, values: list[float]) -> list[float]:
    """The maximum of a few numbers over all ranks (one small collective, on the host)."""
    return _all_reduce(accelerator, values, dist.ReduceOp.MAX)
