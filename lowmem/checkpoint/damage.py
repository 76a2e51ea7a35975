"""What a run folder's damage is done with: nothing a resume could use is ever deleted here.

Leftovers of interrupted saves are removed (a replaced checkpoint whose replacement never arrived is put
back), damaged checkpoints are moved into `damaged/`, and the checkpoints newer than the one a resume starts
from are moved into `superseded-<time>/`. When every checkpoint is damaged, the resume stops with a message
that lists them.
"""

from __future__ import annotations

import logging
import os
import shutil
from datetime import datetime
from pathlib import Path

from lowmem.checkpoint.layout import DAMAGED_DIR, FINAL, MARKER_NAME, OLD, TMP
from lowmem.checkpoint.listing import Found

logger = logging.getLogger(__name__)


def cleanup_incomplete(run_dir: Path, folders: list[Path] | None = None) -> list[Path]:
    """Remove leftovers of interrupted saves and deletions; returns what was removed.

    That is: temporary folders `.checkpoint-<step>.tmp`, and `checkpoint-<step>` folders with no marker
    file. A folder whose marker exists is never removed here, even if it is unreadable. A `.checkpoint-
    <step>.old` (the previous checkpoint of the same step, moved aside while being replaced) is put back if
    the replacement never arrived, else removed. Call it only while no save is running (the main process
    does at start and at the beginning of each save). `folders`: the run folder's folders as a listing already
    found them (`CheckpointFolders.folders`), else listed here.
    """
    if not run_dir.is_dir():
        return []
    removed = []
    if folders is None:
        folders = sorted(path for path in run_dir.iterdir() if path.is_dir() and not path.is_symlink())
    for path in folders:
        if TMP.fullmatch(path.name):
            logger.info("Removing %s, left by an interrupted save.", path)
        elif old := OLD.fullmatch(path.name):
            final = run_dir / f"checkpoint-{old.group(1)}"  # the name as written, leading zeros and all
            if not final.exists():
                logger.warning("Restoring %s from %s: its replacement was interrupted.", final, path)
                os.replace(path, final)
                continue
            logger.info("Removing %s, replaced by %s.", path, final)
        elif FINAL.fullmatch(path.name) and not (path / MARKER_NAME).exists():
            logger.warning("Removing %s: it has no %s marker, so it was never completely saved.",
                           path, MARKER_NAME)
        else:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def set_aside(run_dir: Path, folder: Path) -> bool:
    """Move a damaged checkpoint into `damaged/` under a name of its own; True if it was moved.

    It is never deleted: it may still hold what someone needs. A failure (a full disk cannot make the folder)
    leaves it where it is, with a warning, and returns False.
    """
    aside = run_dir / DAMAGED_DIR / f"{folder.name}-{datetime.now():%Y%m%d-%H%M%S-%f}"
    try:
        aside.parent.mkdir(exist_ok=True)
        folder.rename(aside)
    except OSError as exc:
        logger.warning("Damaged checkpoint %s could not be moved into %s (%s); it stays, and is never resumed "
                       "from.", folder, aside.parent, exc)
        return False
    logger.warning("Damaged checkpoint %s moved to %s (delete it once you no longer need it).", folder, aside)
    return True


def move_superseded(run_dir: Path, start: Path, newer: list[Found]) -> None:
    """Move the checkpoints `newer` than `start` into `superseded-<time>/`, never deleting them: a later resume
    would otherwise take the newest, from the line of training that resuming from `start` replaces."""
    stamp = f"superseded-{datetime.now():%Y%m%d-%H%M%S}"
    aside, number = run_dir / stamp, 1
    while True:
        try:
            aside.mkdir()
            break
        except FileExistsError:  # an earlier resume from an older checkpoint, in the same second
            number += 1
            aside = run_dir / f"{stamp}-{number}"
    for found in newer:
        found.path.rename(aside / found.path.name)
    logger.info("Resuming from %s: the newer %s moved to %s.", start.name,
                ", ".join(found.path.name for found in newer), aside)


def no_usable_checkpoint(run_dir: Path, damage: dict[str, list[str]]) -> str | None:
    """The message that stops a resume when checkpoints exist but every one is damaged (`damage`: what is wrong
    with each, by folder name); None when nothing was found damaged."""
    if not damage:
        return None
    listing = "; ".join(f"{name}: {', '.join(problems)}" for name, problems in damage.items())
    return (f"--is_keep_training=True found no usable checkpoint in {run_dir}: every one is damaged "
            f"({listing}). Nothing was changed or deleted. Restore the run folder from a copy if you have one; to "
            f"start a new run there instead, run without --is_keep_training and with --overwrite=True (that "
            f"deletes these checkpoints), or choose another --output_dir.")
