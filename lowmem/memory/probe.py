"""One measurement of a training process's memory: host (RSS, USS, workers, system), Arrow and CUDA."""

from __future__ import annotations

import os
import re
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import pyarrow as pa

from lowmem.memory.collector import tracked_objects

# A child can exit between being listed and being measured (a DataLoader worker at the end of an epoch),
# and another user's process can refuse us: neither may stop a measurement.
_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess)
# Children that are not DataLoader workers: torch.compile's compile-worker pool and autotuning process run
# scripts from torch/_inductor/ (compile_worker/__main__.py, __autotune_main__.py). Their own children are
# left out with them, whatever their command line (spawned ones are fresh interpreters).
_NOT_WORKER_SCRIPT = re.compile(r"[/\\]torch[/\\]_inductor[/\\]")


# The highest VmHWM read before the kernel's mark was last reset (`reset_high_water`): the process's own high-water
# is the larger of it and the mark now.
_HIGH_WATER_BEFORE_RESET = [0]


def own_high_water() -> int:
    """This process's highest RSS so far, in bytes: /proc/self/status VmHWM, or `ru_maxrss` off Linux; over the whole
    life of the process, also across `reset_high_water`.

    `ru_maxrss` is not this process's own on Linux: exec keeps the high-water mark of the process that forked
    it, so a child started by an 800 MB parent reports at least 800 MB however little it holds. VmHWM
    belongs to the address space, which exec replaces.
    """
    return max(_HIGH_WATER_BEFORE_RESET[0], high_water_since_reset())


def reset_high_water() -> bool:
    """Start the kernel's high-water mark (VmHWM) again from the RSS now, to measure a phase's own peak with
    `high_water_since_reset`; the peak so far is kept for `own_high_water`. False where the kernel has no such reset
    (`/proc/self/clear_refs` missing or not writable): the mark then runs on, and a phase's peak reads as the peak so
    far."""
    current = high_water_since_reset()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")  # 5: reset the peak RSS (Linux 4.0 and later)
    except OSError:
        return False
    _HIGH_WATER_BEFORE_RESET[0] = max(_HIGH_WATER_BEFORE_RESET[0], current)
    return True


def high_water_since_reset() -> int:
    """The kernel's high-water mark of this process's RSS (VmHWM), since it last reset it; see `own_high_water`."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


@dataclass(frozen=True)
class MemorySnapshot:
    """Memory figures in bytes; None where the figure does not exist here or could not be read.

    rss / uss: the process's resident and unique set sizes. USS (pages no other process shares) is what
    the process would give back by exiting; it needs /proc/PID/smaps and is None where that is denied.
    workers, workers_rss / workers_uss: how many DataLoader workers (the process's descendants, less
    torch.compile's helper processes) were measured and their summed RSS / USS (None when not measured).
    Forked workers share the parent's pages, so their RSS counts those pages again; their USS is their own cost.
    cuda_peak: the highest CUDA memory allocated since the previous memory record (the memory log resets
    the peak after each record), or since the start for the first one.
    """

    rss: int
    uss: int | None
    workers: int
    workers_rss: int | None
    workers_uss: int | None
    sys_available: int
    arrow_bytes: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_peak: int | None = None
    rss_high_water: int | None = None  # the process's highest RSS so far (VmHWM), this process only
    # Objects Python's collector tracks outside the frozen ones (`lowmem.memory.collector`); full snapshots only.
    python_objects: int | None = None

    @property
    def footprint(self) -> int:
        """What this rank costs the host: its RSS plus its workers' own (unique) memory where measured.

        Workers' RSS is not added: right after a fork it is mostly the parent's pages, counted twice.
        """
        return self.rss + (self.workers_uss or 0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _uss(process: psutil.Process) -> int | None:
    """The process's USS, or None where smaps cannot be read (permissions, platforms without it)."""
    try:
        return process.memory_full_info().uss
    except (psutil.AccessDenied, AttributeError, NotImplementedError):
        return None


def _is_compile_helper(process: psutil.Process) -> bool:
    """True for a torch.compile helper process (by its command line); False when that cannot be read."""
    try:
        return any(_NOT_WORKER_SCRIPT.search(arg) for arg in process.cmdline())
    except (psutil.Error, AttributeError):
        return False


def _dataloader_workers(children: list[psutil.Process]) -> list[psutil.Process]:
    """The descendants that are DataLoader workers: all but torch.compile's helpers and their descendants."""
    helpers = {child.pid for child in children if _is_compile_helper(child)}
    if not helpers:
        return children
    parents: dict[int, int] = {}
    for child in children:
        try:
            parents[child.pid] = child.ppid()
        except (psutil.Error, AttributeError):
            continue  # exited meanwhile: measuring it fails too

    def under_a_helper(pid: int) -> bool:
        seen: set[int] = set()
        while pid in parents and pid not in seen:  # up to the measured process, whose pid is not a key
            if pid in helpers:
                return True
            seen.add(pid)
            pid = parents[pid]
        return False

    return [child for child in children if not under_a_helper(child.pid)]


def _children_memory(process: psutil.Process, include_uss: bool) -> tuple[int, int, int | None]:
    """(count, summed RSS, summed USS) of the process's live DataLoader workers; USS None if any is unreadable."""
    try:
        children = _dataloader_workers(process.children(recursive=True))
    except _GONE:
        return 0, 0, 0 if include_uss else None
    count, rss = 0, 0
    uss: int | None = 0 if include_uss else None
    for child in children:
        try:
            child_rss = child.memory_info().rss
            child_uss = _uss(child) if include_uss else None
        except _GONE:
            continue  # exited meanwhile: it no longer uses memory
        except psutil.AccessDenied:
            child_rss, child_uss = 0, None
        count += 1
        rss += child_rss
        if uss is not None:
            uss = None if child_uss is None else uss + child_uss
    return count, rss, uss


def _cuda_memory() -> tuple[int | None, int | None, int | None]:
    """(allocated, reserved, peak allocated) on the current CUDA device, or Nones when CUDA is not in use.

    torch is not imported here and CUDA is not initialised: a process that has not done either has no CUDA
    memory, and initialising CUDA in a forked DataLoader worker would fail.
    """
    torch = _torch_with_cuda_in_use()
    if torch is None:
        return None, None, None
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated()


def _torch_with_cuda_in_use() -> Any:
    """The torch module when it is imported and CUDA is initialised in this process, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch


def reset_cuda_peak() -> None:
    """Start a new CUDA peak on the current device: the next `cuda_peak` covers the time from now.

    The memory log calls it after each record, so that each record's peak is its interval's, not the
    lifetime's; the largest of them is still the lifetime peak. A no-op where CUDA is not in use.
    """
    torch = _torch_with_cuda_in_use()
    if torch is not None:
        torch.cuda.reset_peak_memory_stats()


def take_snapshot(process: psutil.Process | None = None, include_children: bool = True,
                  include_uss: bool = True) -> MemorySnapshot:
    """Measure `process` (default: this one) and, with `include_children`, its DataLoader workers.

    Cost, measured with torch imported (~420 mappings): RSS, system and Arrow figures ~50 µs; listing the
    children scans /proc, ~0.6 ms; USS reads /proc/PID/smaps_rollup, whose cost follows the number of
    mappings rather than RSS, ~1.2 ms per torch process (0.1 ms for a bare interpreter). In all ~2 ms, or
    ~4 ms with two workers; counting Python's tracked objects (this process's full snapshots) walks the objects
    not frozen, a few ms once the set-up is frozen. `include_uss=False` (uss, workers_uss and python_objects None)
    and `include_children=False` keep checks cheap when they are frequent.
    """
    own = process is None or process.pid == os.getpid()
    process = process or psutil.Process()
    rss = process.memory_info().rss
    # Records come right after a cleanup; the kernel's high-water mark also sees the peaks between them.
    high_water = own_high_water() if own else None
    uss = _uss(process) if include_uss else None
    workers, workers_rss, workers_uss = (_children_memory(process, include_uss) if include_children
                                         else (0, None, None))
    allocated, reserved, peak = _cuda_memory()
    return MemorySnapshot(
        rss=rss, uss=uss, workers=workers, workers_rss=workers_rss, workers_uss=workers_uss,
        sys_available=psutil.virtual_memory().available,
        arrow_bytes=pa.default_memory_pool().bytes_allocated(),
        cuda_allocated=allocated, cuda_reserved=reserved, cuda_peak=peak, rss_high_water=high_water,
        python_objects=tracked_objects() if own and include_uss else None,
    )
