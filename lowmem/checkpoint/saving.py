"""Writing a checkpoint folder atomically, across processes: each step of a save ends at a sync point where all
processes agree it went fine, and the folder appears under its final name only once it is whole.

What goes into a checkpoint is the caller's business: every rank writes its own files (named per rank) into the
shared temporary folder `.checkpoint-<step>.tmp`. The main rank then writes the completeness marker last and
renames the folder to `checkpoint-<step>`. A failure on any rank makes every rank raise together, with one error
that says what happened and what to do; the temporary folder is removed and earlier checkpoints are untouched.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from lowmem.atomic_files import replace_folder
from lowmem.checkpoint.listing import CheckpointFolders, Found
from lowmem.checkpoint.marker import new_marker, write_marker
from lowmem.disk_errors import disk_write_error, free_bytes, write_errno
from lowmem.errors import CheckpointError, LowmemError
from lowmem.program import command_line
from lowmem.units import MB


def seal(tmp: Path, final: Path, step: int, metric: str, score: float | None, info: dict[str, Any] | None,
         sync: bool) -> dict[str, Any]:
    """Main process: hash the files of the finished `tmp`, write its marker last, rename it to `final`.

    An existing folder of the same step is moved aside first and removed after, so an interruption leaves one
    of the two in place (see `cleanup_incomplete`). Returns the marker.
    """
    marker = new_marker(tmp, step, metric, score, info, sync)
    write_marker(tmp, marker)
    replace_folder(tmp, final)
    return marker


def _folder_bytes(folder: Path) -> int:
    """Total size of the files under `folder` (0 if it is gone); used only for error messages."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


class SaveSteps:
    """The steps of a save on this process, each followed by a sync point of all processes.

    Args:
        folders: the run folder's checkpoints (the newest complete one is named in error messages).
        is_main: True on the one process that prepares and finishes the folder.
        barrier: waits for every process; used at the sync points when `all_ok` is not given.
        all_ok: a collective that takes this process's "my part went fine" and returns True only if it did on
            every process. With only a barrier, a process whose write failed cannot stop the main one from
            marking the checkpoint complete.
    """

    def __init__(self, folders: CheckpointFolders, is_main: bool, barrier: Callable[[], None],
                 all_ok: Callable[[bool], bool] | None) -> None:
        self._folders = folders
        self._is_main = is_main
        self._barrier = barrier
        self._all_ok = all_ok

    def agree(self, ok: bool) -> bool:
        """A sync point of all processes; True if every one of them reports success."""
        if self._all_ok is not None:
            return bool(self._all_ok(ok))
        self._barrier()
        return ok

    def run(self, step: int, tmp: Path, action: Callable[[], None] | None) -> None:
        """Run this process's part of a save step, then a sync point; on failure anywhere, every process raises.

        Only Exceptions are caught: an interrupt propagates at once and leaves the temporary folder behind.
        """
        error: Exception | None = None
        written = 0
        try:
            if action is not None:
                action()
        except Exception as exc:  # noqa: BLE001 - reported to every process below, then re-raised
            error = exc
            written = _folder_bytes(tmp)
        if self.agree(error is None):
            return
        if self._is_main:  # every process has passed the sync point, so nobody writes into it any more
            shutil.rmtree(tmp, ignore_errors=True)
        self.agree(True)  # the error message below reports free space after the partial folder is gone
        run_dir = self._folders.run_dir
        if error is None:
            raise CheckpointError(
                f"Another process failed while saving checkpoint-{step} in {run_dir} (its own error says why). "
                "The partial folder was removed; earlier checkpoints are untouched."
            )
        described = _describe(error, step, written, self._folders)
        if described is error:
            raise error  # not an OS error: a bug in the write callback, shown as it is
        raise described from error


def _newest_size(complete: list[Found]) -> int:
    """Bytes of the newest complete checkpoint: the best guess of what the next one needs."""
    if not complete:
        return 0
    marker = complete[-1].marker
    assert marker is not None  # complete checkpoints all have a readable marker
    return int(marker.get("total_bytes", 0))


def _describe(error: Exception, step: int, written: int, folders: CheckpointFolders) -> Exception:
    """Turn a write failure into a CheckpointError that says what happened and what to do; a failure that is
    no OS error (a bug in the write callback) passes through as it is.

    Args:
        error: what the write raised.
        step: the step being saved.
        written: bytes in the temporary folder when it failed.
        folders: the run folder's checkpoints: a resume continues from the newest complete one.
    """
    if isinstance(error, LowmemError):
        return error  # says what happened already
    run_dir = folders.run_dir
    previous = folders.complete()
    then = (f"then resume with `{command_line('train ... --is_keep_training=True')}` (your flags, and that "
            f"one: it continues from {previous[-1].path.name})" if previous else "then start again")
    kept = "The partial folder was removed; earlier checkpoints are untouched."
    free = free_bytes(run_dir)
    needed = max(written, _newest_size(previous))
    if free is not None and free < needed and write_errno(error) is None:
        # A library that reports a failed write without its errno (DeepSpeed's torch.save(obj, path): "unexpected
        # pos"): with less free than a checkpoint needs, a full disk is the likely cause.
        error = OSError(errno.ENOSPC, f"{type(error).__name__}: {error}")
    described = disk_write_error(error, f"checkpoint-{step}", run_dir, written=written, needed=needed,
                                 then=then, kept=kept, kind=CheckpointError)
    if described is not None:
        return described
    if not isinstance(error, OSError):
        return error
    free_text = f"{free / MB:.1f} MB are free there now" if free is not None else "free space is unknown"
    return CheckpointError(
        f"Could not save checkpoint-{step} in {run_dir}: {error} ({free_text}). Check the disk and the "
        f"folder, {then}. {kept}"
    )
