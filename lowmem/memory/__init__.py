"""Host-memory budget, cleanup, measurement, the per-rank memory log and the watchdog."""

from lowmem.memory.budget import MemoryBudget, memory_budget_bytes, read_cgroup_limit_bytes
from lowmem.memory.cleanup import (cleanup_memory, forced_cleanup, release_arrow_memory, release_cuda_cache,
                                   select_arrow_memory_pool)
from lowmem.memory.log import MemoryLogger, format_line, memory_log_path, new_run_id
from lowmem.memory.monitor import MemoryMonitor
from lowmem.memory.probe import MemorySnapshot, take_snapshot
from lowmem.memory.watchdog import SETTINGS_TO_LOWER, MemoryWatchdog, WatchdogResult

__all__ = [
    "MemoryBudget", "memory_budget_bytes", "read_cgroup_limit_bytes",
    "cleanup_memory", "forced_cleanup", "release_arrow_memory", "release_cuda_cache", "select_arrow_memory_pool",
    "MemoryLogger", "format_line", "memory_log_path", "new_run_id",
    "MemoryMonitor",
    "MemorySnapshot", "take_snapshot",
    "SETTINGS_TO_LOWER", "MemoryWatchdog", "WatchdogResult",
]
