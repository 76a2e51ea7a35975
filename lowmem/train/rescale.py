"""Resuming on another number of processes or DataLoader workers: every rank's data position, and the one
line that says what changed.

The data layer shares out the rest of the epoch among the new readers (`lowmem.data.elastic`); it needs every
old rank's position, so each new rank reads all of them. Steps, the schedule (see `Trainer.continue_schedule`)
and the best-checkpoint ranking continue; the global batch changes with the number of processes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowmem.checkpoint.contents import VALUES_BEFORE_THE_FIELD
from lowmem.config import TrainConfig
from lowmem.data.elastic import merge_rank_states
from lowmem.errors import DataError

# What decides the layout of the data readers: a change of any of them shares the epoch's rest out anew.
READER_FIELDS = ("dataloader_buffer_size", "dataloader_mix_row_groups")
READER_FACTS = ("world_size", "workers_per_rank")


def processes_changed(saved: dict[str, Any], run_facts: dict[str, Any]) -> bool:
    """True when the saved run had another number of processes or of DataLoader workers per process."""
    return any(saved.get(fact) != run_facts[fact] for fact in READER_FACTS)


def readers_changed(saved: dict[str, Any], config: TrainConfig, run_facts: dict[str, Any]) -> bool:
    """True when the saved run read its data with another layout than this run will."""
    saved_config = {**VALUES_BEFORE_THE_FIELD, **saved["config"]}
    return (processes_changed(saved, run_facts)
            or any(saved_config.get(name) != getattr(config, name) for name in READER_FIELDS))


def merged_data_state(folder: Path, world_size: int) -> dict[str, Any]:
    """Every saved rank's data position in `folder`, merged into one state."""
    states = []
    for rank in range(world_size):
        path = folder / f"rank{rank}" / "data.json"
        if not path.is_file():
            raise DataError(f"{path} is missing, so the rest of the epoch cannot be shared out among the new "
                            "processes. The checkpoint is incomplete; resume from another one.")
        states.append(json.loads(path.read_text()))
    return merge_rank_states(states)


def accumulation_to_keep(old_rows: int, new_processes: int, batch_size: int) -> int | None:
    """The gradient accumulation that keeps `old_rows` rows per optimizer step, if a whole number does."""
    per_micro_step = new_processes * batch_size
    return old_rows // per_micro_step if old_rows % per_micro_step == 0 else None


def rescale_line(saved: dict[str, Any], config: TrainConfig, run_facts: dict[str, Any], rows_per_process: int,
                 steps_left: int) -> str:
    """One log line: processes and workers before and after, the global batch, and how to keep it."""
    saved_config = saved["config"]
    old_processes, new_processes = int(saved.get("world_size", 1)), int(run_facts["world_size"])
    old_rows = old_processes * saved_config["batch_size_per_gpu"] * saved_config["gradient_accumulation_steps"]
    new_rows = new_processes * config.batch_size_per_gpu * config.gradient_accumulation_steps
    line = (f"Resuming on {new_processes} process(es) × {run_facts['workers_per_rank']} reader(s) where the run had "
            f"{old_processes} × {saved.get('workers_per_rank', 1)}: the rows left in this epoch are shared out anew "
            f"({rows_per_process:,} per process), and {steps_left:,} steps remain. ")
    if new_rows == old_rows:
        return line + f"The global batch stays {new_rows:,} rows per optimizer step."
    keep = accumulation_to_keep(old_rows, new_processes, config.batch_size_per_gpu)
    how = (f"to keep {old_rows:,}, resume with --gradient_accumulation_steps={keep} --allow_config_change=True"
           if keep else f"no whole --gradient_accumulation_steps keeps {old_rows:,} with {new_processes} process(es)")
    return line + f"The global batch is now {new_rows:,} rows per optimizer step (it was {old_rows:,}); {how}."
