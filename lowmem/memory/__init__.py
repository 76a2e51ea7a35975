"""Host-memory budget and cleanup."""

from lowmem.memory.budget import MemoryBudget, memory_budget_bytes, read_cgroup_limit_bytes
from lowmem.memory.cleanup import release_arrow_memory, select_arrow_memory_pool

__all__ = ["MemoryBudget", "memory_budget_bytes", "read_cgroup_limit_bytes", "release_arrow_memory", "select_arrow_memory_pool"]
