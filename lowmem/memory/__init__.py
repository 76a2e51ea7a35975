"""Host-memory budget and cleanup."""

from lowmem.memory.budget import MemoryBudget, memory_budget_bytes, read_cgroup_limit_bytes
from lowmem.memory.cleanup import release_arrow_memory

__all__ = ["MemoryBudget", "memory_budget_bytes", "read_cgroup_limit_bytes", "release_arrow_memory"]
