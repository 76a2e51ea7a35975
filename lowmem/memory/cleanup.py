"""Giving memory back to the OS: Arrow's allocator and pool, the C heap, the CUDA cache, Python's cycles (when the
collector runs a full collection: `lowmem.memory.collector`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
from typing import Callable

import psutil
import pyarrow as pa

logger = logging.getLogger(__name__)
_POOL_SELECTED = False


def select_arrow_memory_pool() -> str:
    """Make jemalloc Arrow's allocator for this process when the build has it; return the backend name.

    Measured on streaming a 1M-row file one row group at a time: with jemalloc the peak RSS is the
    lowest of the three backends in both modes, and releasing the pool after every row group (ultra-
    low-mem) costs no speed, where mimalloc, Arrow's default, loses a quarter of its rate to page faults
    after each release and peaks higher. A choice made through ARROW_DEFAULT_MEMORY_POOL is kept.
    """
    global _POOL_SELECTED
    if not _POOL_SELECTED and not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        try:
            pa.set_memory_pool(pa.jemalloc_memory_pool())
        except (NotImplementedError, pa.ArrowNotImplementedError):
            logger.debug("pyarrow has no jemalloc; keeping %s", pa.default_memory_pool().backend_name)
    _POOL_SELECTED = True
    return pa.default_memory_pool().backend_name


def release_arrow_memory() -> None:
    """Return the Arrow pool's unused memory to the OS.

    Arrow's allocators keep freed blocks for reuse, so RSS stays high after a row group is dropped
    unless the pool is asked to let go. The call is cheap.
    """
    pa.default_memory_pool().release_unused()


@functools.cache
def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows); looked up once."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        logger.debug("No malloc_trim in this C library: cleanup skips it.")
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


# mallopt's parameter number for the mmap threshold (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3


@functools.cache
def _find_mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None where the C library has none; looked up once."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def set_malloc_mmap_threshold(megabytes: float) -> bool:
    """Give every C allocation of at least `megabytes` its own mapping, returned to the OS when freed.

    glibc starts by mapping blocks of 128 KiB and more, but raises that threshold (up to 32 MiB) to the size
    of each mapped block that is freed: after the first training step, a step's activations (a few MB each)
    come from the heap, and the heap keeps what is freed, scattered, so a process's RSS settles near its
    peak and creeps up. A fixed threshold stops the raising: measured on a 17 M-parameter model with
    3 processes, DDP's high-water RSS fell from 1,036 to 781 MB and FSDP's from 904 to 620 MB. The price is
    the pages mapped afresh for each large tensor at every step (on the demo, a quarter of the tokens/s).
    Setting MALLOC_MMAP_THRESHOLD_ in the environment does the same for a whole launch.

    Returns:
        Whether the threshold was set (False without glibc's mallopt, or for 0: glibc's default kept).
    """
    mallopt = _find_mallopt()
    if megabytes <= 0 or mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(megabytes * 1024 * 1024)))


def cleanup_memory(on_gpu: bool, empty_cuda_cache: bool = False, collect: bool | None = None) -> int:
    """Give unused memory back to the OS; return the bytes of RSS it freed (before − after, at least 0).

    In order: with `collect`, `gc.collect()` frees reference cycles; the Arrow pool returns the blocks it keeps
    for reuse; glibc's `malloc_trim(0)` returns free heap pages that `free()` leaves mapped (why RSS stays high
    after many small objects are dropped); with `empty_cuda_cache` on a GPU, see `release_cuda_cache`.

    Args:
        on_gpu: this process computes on a GPU.
        empty_cuda_cache: also hand the CUDA cache back to the driver. Off for the routine cleanups of
            the training loop; on in the watchdog's (`forced_cleanup`).
        collect: make a full garbage collection; by default on the CPU only: on a GPU the device would idle
            through it, and the memory records collect when Python objects grow (`lowmem.memory.collector`).
    """
    process = psutil.Process()
    before = process.memory_info().rss
    if collect if collect is not None else not on_gpu:
        gc.collect()
    release_arrow_memory()
    trim = _find_malloc_trim()
    if trim is not None:
        trim(0)
    if empty_cuda_cache:
        release_cuda_cache(on_gpu)
    return max(0, before - process.memory_info().rss)


def return_free_heap() -> None:
    """Hand back to the OS what the Arrow pool and glibc's heap keep free (no garbage collection, no CUDA cache): a
    few milliseconds, done as a phase of the run begins (`lowmem.memory.phases`), so that what the last training steps
    freed is not held through a validation or a save."""
    release_arrow_memory()
    trim = _find_malloc_trim()
    if trim is not None:
        trim(0)


def forced_cleanup(on_gpu: bool) -> int:
    """`cleanup_memory` with a full collection and the CUDA cache emptied too: the watchdog's cleanup, when a rank
    is near its limit."""
    return cleanup_memory(on_gpu, empty_cuda_cache=True, collect=True)


def release_cuda_cache(on_gpu: bool) -> None:
    """On a GPU, hand the caching allocator's unused blocks back to the driver (`torch.cuda.empty_cache()`).

    It lowers reserved GPU memory, frees no host RAM, synchronizes the device, and the next step has to
    allocate its blocks again: worth it when the watchdog fires, not as a routine every few steps, nor before a
    validation (the allocator frees cached blocks by itself when a new one does not fit).
    """
    if on_gpu:
        import torch  # only here: the data layer imports this module and must not pay for torch

        torch.cuda.empty_cache()
