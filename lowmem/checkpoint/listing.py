"""Finding a run folder's checkpoints: every `checkpoint-<step>` folder, the complete ones, the newest intact one.

Only reading happens here; what is found damaged is remembered (`CheckpointFolders.damaged`) so that retention
never keeps it and a resume never takes it, and the other modules decide what to do with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem.checkpoint.layout import FINAL, MARKER_NAME, step_of
from lowmem.checkpoint.marker import read_marker, verify_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class Found:
    """A `checkpoint-<step>` folder on disk with its marker (None: marker missing or unreadable)."""

    step: int
    path: Path
    marker: dict[str, Any] | None
    has_marker_file: bool


class CheckpointFolders:
    """The checkpoint folders of one run folder, and which of them were found damaged.

    Args:
        run_dir: the run folder the `checkpoint-<step>` folders are in.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.damaged: set[int] = set()  # steps found damaged by latest_complete(); never kept or resumed from
        self.damage: dict[str, list[str]] = {}  # what latest_complete() found wrong, by folder name

    def scan(self) -> list[Found]:
        """Every `checkpoint-<step>` folder, sorted by step."""
        if not self.run_dir.is_dir():
            return []
        found = []
        for path in self.run_dir.iterdir():
            if FINAL.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                found.append(Found(step_of(path), path, read_marker(path), (path / MARKER_NAME).exists()))
        return sorted(found, key=lambda f: f.step)

    def complete(self, found: list[Found] | None = None) -> list[Found]:
        """The folders with a readable marker that were not found damaged, oldest first: of `found` (a scan
        already made), else of a new scan."""
        return [f for f in (self.scan() if found is None else found)
                if f.marker is not None and f.step not in self.damaged]

    def latest_complete(self, verify_hashes: bool = True) -> Path | None:
        """The newest checkpoint that is complete and intact, or None; newer damaged ones are logged and remembered.

        Only the returned checkpoint's files are hashed, plus those of any damaged newer ones.
        """
        self.damage = {}
        for found in reversed(self.scan()):
            problems = verify_checkpoint(found.path, check_hashes=verify_hashes)
            if not problems:
                return found.path
            self.damaged.add(found.step)
            self.damage[found.path.name] = problems
            logger.warning("Checkpoint %s is damaged and will not be used: %s. Falling back to an earlier one.",
                           found.path, "; ".join(problems))
        return None
