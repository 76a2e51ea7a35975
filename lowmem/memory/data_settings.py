"""Memory-dependent settings: decided once from the budget, the same on every rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lowmem.memory.budget import MemoryBudget, budget_source
from lowmem.units import GIB

# DataLoader workers per process when memory allows: tokenizing in a worker overlaps with the model's step.
DEFAULT_WORKERS_ON_GPU = 2
# On a low budget a GPU process still gets one worker when its share allows it: a GPU step of the large
# config takes tens of milliseconds, and tokenizing and reading in the training process would leave the
# GPU idle for a good part of each step. The worker holds one row group and the shuffle buffer, like the
# main process would (bench_train measures that share).
MIN_SHARE_FOR_A_WORKER_GIB = 2.0


@dataclass(frozen=True)
class MemorySettings:
    """What the budget decided, and why (logged on every rank)."""

    budget_bytes: int
    local_processes: int
    ultra_low_mem: bool
    num_workers: int
    pin_memory: bool
    reason: str
    # The budget is below the threshold, whatever was set explicitly: what else must stay small (the
    # torch.compile worker pool, say) follows this.
    low_budget: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def per_process_bytes(self) -> int:
        return self.budget_bytes // self.local_processes


def decide_memory_settings(ultra_low_mem: bool | None, num_workers: int | None, threshold_gb: float,
                           local_processes: int, on_gpu: bool, budget_gb: float = 0.0) -> MemorySettings:
    """Choose ultra-low-mem mode, DataLoader workers and pinned memory from the host's budget.

    Values given explicitly (not None) are kept; automatic ones follow the budget: below `threshold_gb`,
    ultra-low-mem mode, one worker on a GPU if the process's share is at least `MIN_SHARE_FOR_A_WORKER_GIB`
    (else none), and no pinned memory (page-locked memory cannot be swapped or reclaimed). On the CPU there are
    no workers: they would take cores from the model's own step.

    `num_workers` is --dataloader_num_workers: None decides, and so does a number below 0, which a config built in
    Python may still hold (-1, the older spelling of None that the option declares; the config layer sits above
    this one, so the range is checked here).
    """
    budget = MemoryBudget.detect(local_processes, budget_gb)
    low = budget.is_low(threshold_gb)
    auto_ultra = ultra_low_mem is None
    ultra = low if auto_ultra else bool(ultra_low_mem)
    given_workers = None if num_workers is None or num_workers < 0 else num_workers
    if given_workers is not None:
        workers = given_workers
    elif not on_gpu:
        workers = 0
    elif not low:
        workers = DEFAULT_WORKERS_ON_GPU
    else:
        workers = 1 if budget.per_process_bytes >= MIN_SHARE_FOR_A_WORKER_GIB * GIB else 0
    pin = on_gpu and not low
    reason = (
        f"memory budget {budget.total_bytes / GIB:.1f} GiB ({budget_source(budget_gb)}) for "
        f"{budget.local_processes} process(es) "
        f"({budget.per_process_bytes / GIB:.1f} GiB each), {'below' if low else 'at or above'} the "
        f"{threshold_gb:g} GiB threshold; ultra_low_mem={ultra} ({'auto' if auto_ultra else 'set'}), "
        f"num_workers={workers} ({'auto' if given_workers is None else 'set'}), pin_memory={pin}"
    )
    return MemorySettings(budget.total_bytes, budget.local_processes, ultra, workers, pin, reason, low_budget=low)
