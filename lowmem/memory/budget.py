"""The memory budget: the smaller of physical RAM and the memory limit of this process's own cgroup."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from lowmem.memory.cgroup import CgroupLimit, own_cgroup_limit, parse_limit
from lowmem.units import GIB


def read_cgroup_limit_bytes(v2_path: Path | None = None, v1_path: Path | None = None) -> int | None:
    """The cgroup memory limit in bytes, or None when there is none.

    Without arguments: the tightest limit of this process's own cgroup and its ancestors (v2 memory.max and
    memory.high, v1 memory.limit_in_bytes; see `lowmem.memory.cgroup`). With paths: the first of those two
    limit files that holds a value ("max" or v1's near-2**63 value being no limit).
    """
    if v2_path is None and v1_path is None:
        limit = own_cgroup_limit()
        return None if limit is None else limit.bytes
    for path in (v2_path, v1_path):
        if path is None:
            continue
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max" or text.isdigit():
            return parse_limit(text)
    return None


def memory_budget_bytes() -> int:
    """The host memory this process may use: min(physical RAM, its cgroup's limit)."""
    physical = psutil.virtual_memory().total
    limit = read_cgroup_limit_bytes()
    return physical if limit is None else min(physical, limit)


def budget_source(budget_gb: float = 0.0) -> str:
    """Where the budget comes from, in words: --memory_budget_gb, a cgroup's limit, or the physical RAM."""
    if budget_gb > 0:
        return "--memory_budget_gb"
    limit: CgroupLimit | None = own_cgroup_limit()
    if limit is not None and limit.bytes < psutil.virtual_memory().total:
        return limit.describe()
    return "physical RAM"


@dataclass(frozen=True)
class MemoryBudget:
    """The budget of the host, and each local process's share of it."""

    total_bytes: int
    local_processes: int = 1

    @classmethod
    def detect(cls, local_processes: int = 1, budget_gb: float = 0.0) -> "MemoryBudget":
        """Measure the budget of this host (or take `budget_gb` when above 0), shared among `local_processes`."""
        # Looked up at call time, so that a test may replace the detection.
        total = int(budget_gb * GIB) if budget_gb > 0 else memory_budget_bytes()
        return cls(total_bytes=total, local_processes=max(1, local_processes))

    @property
    def per_process_bytes(self) -> int:
        return self.total_bytes // self.local_processes

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GIB

    def is_low(self, threshold_gb: float) -> bool:
        """True when the host has less than `threshold_gb` GiB: the signal for ultra-low-mem mode."""
        return self.total_bytes < threshold_gb * GIB
