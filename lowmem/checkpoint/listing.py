"""Finding a run folder's checkpoints: every `checkpoint-<step>` folder, the complete ones, the newest intact one.

Only reading happens here; what is found damaged is remembered (`CheckpointFolders.damaged`) so that retention
never keeps it and a resume never takes it, and the other modules decide what to do with it.

The folder is listed, and each marker read, once: a listing is kept until whoever changes the run's checkpoints
says so (`changed()`: the CheckpointManager, after each save, retention or setting aside). The start-up's listing
is the one the run's CheckpointManager goes on with (`lowmem.train.startup.read_saved_run`); another process that
would change the folder meanwhile is kept out by the run folder's lock.
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
        self._entries: list[Path] = []  # every folder in the run folder, as last listed
        self._listed: list[Found] | None = None  # the last listing, until `changed()`

    def scan(self) -> list[Found]:
        """Every `checkpoint-<step>` folder, sorted by step: listed (and each marker read) the first time and
        after `changed()`, else that listing again."""
        if self._listed is not None:
            return list(self._listed)
        found = []
        self._entries = self._list_folders()
        for path in self._entries:
            if FINAL.fullmatch(path.name):
                found.append(Found(step_of(path), path, read_marker(path), (path / MARKER_NAME).exists()))
        self._listed = sorted(found, key=lambda f: f.step)
        return list(self._listed)

    def folders(self) -> list[Path]:
        """Every folder in the run folder (not through a link), sorted by name: from `scan`'s listing while it holds,
        else listed now (no marker is read)."""
        return list(self._entries) if self._listed is not None else self._list_folders()

    def _list_folders(self) -> list[Path]:
        if not self.run_dir.is_dir():
            return []
        return sorted(path for path in self.run_dir.iterdir() if path.is_dir() and not path.is_symlink())

    def changed(self) -> None:
        """Say that a checkpoint was added, removed or rewritten here: the next `scan` lists the folder again."""
        self._listed = None

    def marker_of(self, folder: Path) -> dict[str, Any] | None:
        """The marker of the checkpoint `folder` of this run, as listed (read now for a folder of another run)."""
        for found in self.scan():
            if found.path.name == Path(folder).name and Path(folder).parent.resolve() == self.run_dir.resolve():
                return found.marker
        return read_marker(folder)

    def complete(self, found: list[Found] | None = None) -> list[Found]:
        """The folders with a readable marker that were not found damaged, oldest first: of `found` (a scan
        already made), else of a new scan."""
        return [f for f in (self.scan() if found is None else found)
                if f.marker is not None and f.step not in self.damaged]

    def latest_complete(self, verify_hashes: bool = True) -> Path | None:
        """The checkpoint a resume continues from: the newest that is complete and intact, or None; newer damaged
        ones are logged and remembered (and not checked again).

        Only the returned checkpoint's files are hashed (sizes only without `verify_hashes`), plus those of any
        damaged newer ones.
        """
        for found in reversed(self.scan()):
            if found.step in self.damaged:
                continue
            problems = verify_checkpoint(found.path, check_hashes=verify_hashes, marker=found.marker,
                                         has_marker_file=found.has_marker_file)
            if not problems:
                return found.path
            self.set_damaged(found.path, problems)
        return None

    def set_damaged(self, folder: Path, problems: list[str]) -> None:
        """Remember the checkpoint `folder` as damaged (`problems`: what is wrong), logged: never kept or resumed
        from."""
        self.damaged.add(step_of(folder))
        self.damage[folder.name] = problems
        logger.warning("Checkpoint %s is damaged and will not be used: %s. Falling back to an earlier one.",
                       folder, "; ".join(problems))
