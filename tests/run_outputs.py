"""Reading back what a run or a command wrote: the training curves of TensorBoard's event files, and the records of
the GPU check."""

from __future__ import annotations

import json
from pathlib import Path


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in `folder` (not its subfolders): tag → [(step, value)]. Needs tensorboard
    (a test module that calls it skips itself without: `pytest.importorskip("tensorboard")`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def check_results(folder: Path) -> list[dict]:
    """The records of a GPU check whose `--folder` was `folder / "check"`, in the order written."""
    return [json.loads(line) for line in (folder / "check" / "results.jsonl").read_text().splitlines()]
