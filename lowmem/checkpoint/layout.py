"""The names in a run folder: where each checkpoint, the leftovers of a save and the bookkeeping live.

A run directory looks like this::

    <run_dir>/checkpoint-<step>/        a complete checkpoint: its files plus COMPLETE.json
    <run_dir>/.checkpoint-<step>.tmp/   a save in progress, or left by one that was interrupted
    <run_dir>/.checkpoint-<step>.old/   the checkpoint of that step, moved aside while a new save replaces it
    <run_dir>/checkpoints.json          the manifest: which checkpoints are kept and why
    <run_dir>/damaged/                  damaged checkpoints, set aside instead of deleted
    <run_dir>/superseded-<time>/        newer checkpoints, moved aside by a resume from an older one

Every module of the package names these folders through this one, so that a save, a cleanup and a listing can
never disagree on what a name means.
"""

from __future__ import annotations

import re
from pathlib import Path

MARKER_NAME = "COMPLETE.json"
MANIFEST_NAME = "checkpoints.json"
DAMAGED_DIR = "damaged"  # where damaged checkpoints are set aside instead of being deleted
FORMAT_VERSION = 1  # of the marker and of the manifest

FINAL = re.compile(r"checkpoint-(\d+)")
TMP = re.compile(r"\.checkpoint-(\d+)\.tmp")
OLD = re.compile(r"\.checkpoint-(\d+)\.old")  # where replace_folder moves the checkpoint it replaces


def final_folder(run_dir: Path, step: int) -> Path:
    """`<run_dir>/checkpoint-<step>`: where a complete checkpoint of `step` lives."""
    return run_dir / f"checkpoint-{step}"


def temporary_folder(run_dir: Path, step: int) -> Path:
    """`<run_dir>/.checkpoint-<step>.tmp`: where the save of `step` is written before its rename."""
    return run_dir / f".checkpoint-{step}.tmp"


def step_of(path: Path) -> int:
    """The step in the name of a `checkpoint-<step>` folder."""
    match = FINAL.fullmatch(path.name)
    assert match is not None  # called only on `checkpoint-<step>` folders
    return int(match.group(1))
