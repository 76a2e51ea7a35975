"""Run folders holding a saved run, written as lowmem saves one: a complete checkpoint (its marker last) whose
trainer state holds the config a test gives, for the tests of what a resume and the commands read from a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowmem.checkpoint.folders import CheckpointManager


def write_saved_run(run_dir: Path, step: int, state: dict[str, Any]) -> Path:
    """`run_dir/checkpoint-<step>`, complete, whose trainer_state.json is `state` (nothing else is written)."""
    def write(folder: Path) -> None:
        (folder / "trainer_state.json").write_text(json.dumps(state))

    return CheckpointManager(run_dir, keep_best_n=1, fsync=False).save(step, write)


def rewrite_trainer_state(checkpoint: Path, state: dict[str, Any]) -> None:
    """A saved checkpoint's trainer state replaced by `state`, its marker kept true (as a run saved that state)."""
    from lowmem.checkpoint.marker import read_marker, write_marker
    from lowmem.checkpoint.folders import file_crc32

    path = checkpoint / "trainer_state.json"
    path.write_text(json.dumps(state))
    marker = read_marker(checkpoint)
    assert marker is not None
    size, crc = file_crc32(path)
    marker["files"]["trainer_state.json"].update(size=size, crc32=crc)
    write_marker(checkpoint, marker)
