"""`train --print_config` and `plan --print_config`: the config the run will use, as `train` settles it.

The JSON on stdout is the settled config, field by field (what a run of these flags uses: the saved run's
settings on a resume, a source model's shape, the memory plan's savers and micro-batches, and the device's
speed and data settings as the plan's device would have them). The lines on stderr say where each value that was
not given comes from: the saved run or the data, the memory plan, or the process's own start (with the rule).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Collection

from lowmem.config import TrainConfig

# The fields each process decides for itself when it starts (its own device and budget), and the rule it uses.
DECIDED_AT_START = {
    "compile": "on with CUDA, off on the CPU and under FSDP or DeepSpeed",
    "static_shapes": "on with CUDA, off on the CPU",
    "attention": "flex on CUDA from 1024 tokens per sequence, sdpa otherwise",
    "dataloader_num_workers": "from the memory budget's share per process",
    "ultra_low_mem": "on below --ultra_low_mem_threshold_gb of budget",
}


def launched_layout() -> tuple[int, str]:
    """The processes `accelerate launch` starts on this machine (1 when run alone) and its strategy ("" for the
    default: ddp for several processes)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    processes = max(1, int(local)) if local.isdigit() else 1
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return processes, "fsdp"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return processes, "deepspeed"
    return processes, ""


def settle_and_plan(config: TrainConfig, given: Collection[str], is_keep_training: bool, layout: Any,
                    largest: bool = False) -> tuple[TrainConfig, Any, Any]:
    """The run as `train` settles it (a resume's saved settings, a source model's shape and load) and the memory
    plan's decision for `layout` (with `largest`, the largest model of its proportions the host trains); the third
    value is the model the run starts from (`lowmem.source.settle.StartingPoint`; None: random weights)."""
    from lowmem.config.overrides import explicit_fields
    from lowmem.data.path_checks import check_data_files
    from lowmem.train.memory_fit import decide
    from lowmem.train.startup import SavedRun, read_saved_run, settle_run

    check_data_files(config)  # as `train` checks them first: a plan of data training would refuse is no plan
    saved = read_saved_run(config.output_dir) if is_keep_training else SavedRun()
    settled, start = settle_run(config, given, saved)
    decision = decide(settled, layout, explicit_fields(settled, given), saved.memory_choice(allow_config_change=False),
                      start=start, largest=largest)
    return settled, decision, start


def settled_printout(config: TrainConfig, given: Collection[str], is_keep_training: bool, layout: Any
                     ) -> tuple[dict[str, Any], list[str]]:
    """The settled config as a dict of fields, and the lines that say where each value not given came from.

    Args:
        config: the config resolved from the preset, the config file and the flags.
        given: the fields the user set.
        is_keep_training: settle the resume of the run in output_dir (its saved settings are kept).
        layout: the `RunLayout` to plan for (`lowmem.train.memory_fit`).
    """
    settled, decision, start = settle_and_plan(config, given, is_keep_training, layout)
    stage = start.stage if start is not None else None  # a new run from a model: what its stage chose
    settled_values = dataclasses.asdict(settled)
    values = {**settled_values, **decision.changes}
    at_start: dict[str, Any] = {}
    if decision.speed is not None:
        at_start.update(compile=decision.speed.compile, static_shapes=decision.speed.static_shapes,
                        attention=decision.speed.attention)
    if decision.settings is not None:
        at_start.update(dataloader_num_workers=decision.settings.num_workers,
                        ultra_low_mem=decision.settings.ultra_low_mem)
    for name, value in at_start.items():
        if name in values and values[name] is None:
            values[name] = value
    before = dataclasses.asdict(config)
    by_stage = stage.chosen if stage is not None else {}
    from_run = sorted(name for name, value in settled_values.items()
                      if value != before[name] and name not in given and name not in decision.changes
                      and name not in by_stage)
    source = ("the saved run, the source model or the data" if is_keep_training or start is not None
              else "the data and tokenizer")
    lines = [f"Given (preset aside): {', '.join(sorted(given)) or 'nothing'}."]
    if stage is not None:
        lines += [stage.line()] + ([stage.warning] if stage.warning else [])
    if from_run:
        lines.append(f"Settled from {source}: {', '.join(from_run)}.")
    if decision.changes:
        lines.append(f"Chosen by the memory plan: {', '.join(sorted(decision.changes))}.")
    decided = [f"{name} ({DECIDED_AT_START[name]})" for name in DECIDED_AT_START
               if name in at_start and name in before and before[name] is None]  # None: decide, given or not
    if decided:
        lines.append(f"Decided by each process when it starts, shown as for {layout.device} x {layout.processes}: "
                     + "; ".join(decided) + ".")
    length = run_length_line(settled, given, decision, layout)
    return values, lines + ([length] if length else [])


def run_length_line(settled: TrainConfig, given: Collection[str], decision: Any, layout: Any) -> str | None:
    """The run's length and the warmup its schedule will use (`planned_run_line`), from the training rows the
    plan indexed, shared by `layout`'s processes; None for a mixture, whose length is planned per source at the
    start."""
    index = decision.measured.index
    if index is None:
        return None
    from lowmem.train.schedule import planned_run_line

    return planned_run_line(settled, given, index.num_rows // max(layout.world_size, 1))
