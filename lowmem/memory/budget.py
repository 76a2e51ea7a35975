"""The memory budget: the smaller of physical RAM and the cgroup (container) limit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from lowmem.units import GIB

# cgroup v2 exposes one file; v1 a different one. "max" (v2) or a huge number (v1) means no limit.
_CGROUP_V2_LIMIT = Path("/sys/fs/cgroup/memory.max")
_CGROUP_V1_LIMIT = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
# v1 reports "unlimited" as a page-aligned value near 2**63; anything above 2**60 is treated as no limit.
_UNLIMITED_ABOVE = 2**60


def read_cgroup_limit_bytes(v2_path: Path = _CGROUP_V2_LIMIT, v1_path: Path = _CGROUP_V1_LIMIT) -> int | None:
    """Return the cgroup memory limit in bytes, or None when there is none (or no cgroup files)."""
    for path in (v2_path, v1_path):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= _UNLIMITED_ABOVE else value
    return None


def memory_budget_bytes() -> int:
    """The host memory this machine may use: min(physical RAM, cgroup limit)."""
    physical = psutil.virtual_memory().total
    limit = read_cgroup_limit_bytes()
    return physical if limit is None else min(physical, limit)


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
