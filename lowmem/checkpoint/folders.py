"""Checkpoint folders: `CheckpointManager` saves them atomically, keeps the latest plus the best few, and finds the
latest intact one to resume from.

It coordinates the modules that each own one concern, in the order that keeps a run resumable whatever moment
it is killed at:

    layout.py     the names in a run folder (`checkpoint-<step>/`, `.checkpoint-<step>.tmp/`, checkpoints.json)
    marker.py     the completeness marker COMPLETE.json: every file's size and CRC-32, written last, verified
    listing.py    the checkpoint folders found on disk, the complete ones, the newest intact one
    saving.py     the steps of a save across processes, the rename into place, one error for all ranks
    retention.py  which checkpoints stay (the latest and the best by score), the deletion of the others
    manifest.py   checkpoints.json: what is kept and why, the scores that survive a resume
    damage.py     leftovers of interrupted saves, damaged and superseded checkpoints set aside, never deleted

What goes into a checkpoint is the caller's business: `CheckpointManager.save(step, write)` calls
`write(folder)` on every rank and each rank writes its own files (named per rank) into the shared temporary
folder. The package only owns the folders: it makes them appear atomically, proves they are complete, finds
the latest good one, and deletes the ones no longer needed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from lowmem.checkpoint import damage
from lowmem.checkpoint.layout import (FINAL, MANIFEST_NAME, MARKER_NAME, OLD, final_folder, step_of,
                                     temporary_folder)
from lowmem.checkpoint.listing import CheckpointFolders, Found
from lowmem.checkpoint.manifest import build_manifest, read_manifest, read_scores, refresh_manifest, write_manifest
from lowmem.checkpoint.marker import file_crc32, read_marker, verify_checkpoint
from lowmem.checkpoint.retention import Retention, clean_score
from lowmem.checkpoint.saving import SaveSteps, seal
from lowmem.errors import ConfigError
from lowmem.units import MB

# Re-exported: code and tests import these names from this module.
__all__ = ["MANIFEST_NAME", "MARKER_NAME", "CheckpointManager", "file_crc32", "read_marker", "verify_checkpoint"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves checkpoint folders atomically under `run_dir`, keeps the latest plus the best few, and finds the
    latest intact one to resume from.

    Args:
        run_dir: the run folder; checkpoints go to `<run_dir>/checkpoint-<step>/`.
        keep_best_n: how many of the best-scoring checkpoints to keep besides the latest (0: only the latest).
        metric: the name of the score, e.g. "val_loss" or "bleu4"; recorded in the manifest and messages.
        mode: "min" if lower scores are better (losses), "max" if higher are (BLEU).
        is_main: True on the one process that writes markers, renames, deletes and writes the manifest.
        barrier: waits for every process; used at the sync points when `all_ok` is not given.
        all_ok: a collective that takes this process's "my part went fine" and returns True only if it did on
            every process (e.g. an all-reduce of a 0/1 flag). With more than one process pass it: with only a
            barrier, a process whose write failed cannot stop the main one from marking the checkpoint complete.
        fsync: fsync each file before the marker is written, so a power cut cannot leave a marker that
            describes data never written to disk. Off only for tests on throwaway folders.
        save_every: `due(step)` is True every this many steps (0: never; the caller saves when it decides).
        resume_only: files and folders of a checkpoint that only a resume reads (the optimizer state). They are
            kept in the `keep_resumable_n` newest checkpoints and removed from the older ones kept for their score,
            whose markers then say `"weights_only": true`.
        keep_resumable_n: how many of the newest checkpoints keep `resume_only` (at least 1: the latest).
        folders: the run folder's listing made at start-up (`lowmem.train.startup.read_saved_run`), gone on with
            rather than listed again; default: a new one.

    The main process removes leftovers of interrupted saves when it is created (never a complete checkpoint)
    and reads the manifest back, so the retention list survives resumes.
    """

    def __init__(self, run_dir: str | Path, keep_best_n: int, metric: str = "val_loss", mode: str = "min",
                 is_main: bool = True, barrier: Callable[[], None] = lambda: None,
                 all_ok: Callable[[bool], bool] | None = None, fsync: bool = True, save_every: int = 0,
                 resume_only: tuple[str, ...] = (), keep_resumable_n: int = 2,
                 folders: CheckpointFolders | None = None) -> None:
        self.run_dir = Path(run_dir)
        self._retention = Retention(self.run_dir, keep_best_n, metric, mode, resume_only, keep_resumable_n)
        self.is_main = is_main
        self.save_every = save_every
        self.last_saved_step: int | None = None  # this training's last save (a resume loads it)
        self._fsync = fsync
        self._folders = folders if folders is not None and folders.run_dir == self.run_dir else \
            CheckpointFolders(self.run_dir)
        self._steps = SaveSteps(self._folders, is_main, barrier, all_ok)
        if is_main and self.run_dir.is_dir():
            self.cleanup_incomplete()
            complete = self._folders.complete()
            self._retention.scores = read_scores(self.run_dir, metric, mode, complete)
            refresh_manifest(self.run_dir, self._build_manifest(complete))

    # ----- the settings, as given (the retention owns them) -----------------------------------------------
    @property
    def keep_best_n(self) -> int:
        """How many of the best-scoring checkpoints are kept besides the latest."""
        return self._retention.keep_best_n

    @property
    def metric(self) -> str:
        """The name of the score checkpoints are ranked by."""
        return self._retention.metric

    @property
    def mode(self) -> str:
        """"min" if lower scores are better, "max" if higher are."""
        return self._retention.mode

    @property
    def resume_only(self) -> tuple[str, ...]:
        """Files and folders of a checkpoint that only a resume reads."""
        return self._retention.resume_only

    @property
    def keep_resumable_n(self) -> int:
        """How many of the newest checkpoints keep `resume_only`."""
        return self._retention.keep_resumable_n

    @property
    def damage(self) -> dict[str, list[str]]:
        """What the last `latest_complete()` found wrong, by folder name (empty: nothing)."""
        return self._folders.damage

    # ----- when, and what the trainer keeps of it ------------------------------------------------------
    def due(self, step: int) -> bool:
        """True when a checkpoint is due after optimizer step `step`."""
        return bool(self.save_every) and step % self.save_every == 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the manager: its last save, and the score it ranks by."""
        return {"last_saved_step": self.last_saved_step, "metric": self.metric, "mode": self.mode}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back the last save from `state_dict()`."""
        self.last_saved_step = state.get("last_saved_step")

    # ----- looking at what is on disk -------------------------------------------------------------------
    def complete_checkpoints(self) -> list[Path]:
        """Folders with a readable marker, oldest first (a cheap check: files are verified by latest_complete)."""
        return [f.path for f in self._folders.complete()]

    def marker_of(self, folder: str | Path) -> dict[str, Any] | None:
        """The marker of the checkpoint `folder`, as the run folder's listing read it."""
        return self._folders.marker_of(Path(folder))

    def verify(self, checkpoint_dir: str | Path, check_hashes: bool = True) -> list[str]:
        """Problems with one checkpoint folder (empty: intact); see `verify_checkpoint`."""
        return verify_checkpoint(checkpoint_dir, check_hashes)

    def latest_complete(self, verify_hashes: bool = True) -> Path | None:
        """The newest checkpoint that is complete and intact, or None if there is none.

        Newer folders that fail the check (marker missing, a listed file missing, a size or CRC-32 mismatch)
        are logged with a WARNING that names them and skipped; they are not resumed from, not kept by
        retention, and removed at the next save. Only the returned checkpoint's files are hashed, plus those of
        any damaged newer ones. Every process may call it (each reads the files), or the main one may call it
        and broadcast the path.
        """
        return self._folders.latest_complete(verify_hashes)

    def no_usable_checkpoint(self, found: Path | None) -> str | None:
        """The message that stops a resume when `latest_complete` found nothing (`found` is None) although
        checkpoints exist, every one damaged; None when it found one, or there are none and starting fresh is right."""
        if found is not None:
            return None
        return damage.no_usable_checkpoint(self.run_dir, self.damage)

    def resume_from(self, checkpoint: str | Path) -> Path:
        """Resume from this checkpoint instead of the newest (main process): it must be one of this run folder's
        intact checkpoints. Newer checkpoints are moved into `superseded-<time>/` beside them, never deleted: a
        later resume would otherwise take the newest, from the line of training this one replaces."""
        folder = Path(checkpoint)
        if folder.resolve().parent != self.run_dir.resolve() or not FINAL.fullmatch(folder.name):
            raise ConfigError(f"--resume_from_checkpoint={checkpoint} is not a checkpoint-<step> folder of the run "
                              f"folder {self.run_dir}.")
        problems = verify_checkpoint(folder)
        if problems:
            raise ConfigError(f"--resume_from_checkpoint={checkpoint} cannot be resumed from: {'; '.join(problems)}. "
                              f"Choose another checkpoint-<step> folder of {self.run_dir}.")
        newer = [found for found in self._folders.scan() if found.step > step_of(folder)]
        if newer and self.is_main:
            damage.move_superseded(self.run_dir, folder, newer)
            self._folders.changed()
            for found in newer:
                self._retention.scores.pop(found.step, None)
            refresh_manifest(self.run_dir, self._build_manifest())
        return self.run_dir / folder.name

    def cleanup_incomplete(self) -> list[Path]:
        """Remove leftovers of interrupted saves and deletions (never a complete checkpoint); returns what was
        removed. See `damage.cleanup_incomplete`; call it only while no save is running."""
        listed = self._folders.folders()
        removed = damage.cleanup_incomplete(self.run_dir, listed)
        if removed or any(OLD.fullmatch(path.name) for path in listed):  # removed, or a replaced one put back
            self._folders.changed()
        return removed

    # ----- scores and manifest --------------------------------------------------------------------------
    def _build_manifest(self, complete: list[Found] | None = None) -> dict[str, Any]:
        """The manifest of the `complete` checkpoints (else of those on disk now), with the current plan's reasons."""
        complete = self._folders.complete() if complete is None else complete
        return build_manifest(self._retention, complete, self._retention.plan(complete, None))

    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest: metric, mode, latest, best (in rank order) and each kept checkpoint with its reasons.

        On the main process it is computed from the current state; on the others it is read from disk.
        """
        if self.is_main:
            return self._build_manifest()
        return read_manifest(self.run_dir)

    def record_score(self, step: int, score: float | None) -> None:
        """Attach a score to an existing complete checkpoint (validation may run after the save) and re-apply
        retention, which may delete checkpoints that are now neither the latest nor among the best.

        Only the main process acts; on the others this is a no-op.
        """
        if not self.is_main:
            return
        if step not in {f.step for f in self._folders.complete()}:
            logger.warning("No complete checkpoint-%d in %s to attach %s=%s to; the score is ignored.",
                           step, self.run_dir, self.metric, score)
            return
        self._retention.scores[step] = clean_score(score, step)
        try:
            self._retain(just_saved=None)
        except OSError as exc:  # bookkeeping only: training must not stop over it
            logger.warning("Could not apply retention or write %s after scoring checkpoint-%d (%s); retried at the "
                           "next save.", MANIFEST_NAME, step, exc)

    # ----- retention and damage -------------------------------------------------------------------------
    def _retain(self, just_saved: int | None) -> None:
        """Delete the checkpoints the plan does not keep (damaged ones included), then write the manifest."""
        found_all = self._folders.scan()  # one look at the folder: what follows changes only what it decides
        complete = self._folders.complete(found_all)
        plan = self._retention.plan(complete, just_saved)
        try:
            damaged = self._retention.remove_unkept(found_all, plan, self._folders.damaged)
            # What frees space first; setting aside (a rename, but a folder may have to be made) last.
            self._retention.strip_older(plan, complete)  # rewrites markers: "weights_only"
        finally:
            self._folders.changed()
        for found in damaged:
            self._set_aside(found)
        kept = [found for found in complete if found.step in plan]  # the others were just removed
        write_manifest(self.run_dir, build_manifest(self._retention, kept, plan))

    def _set_aside(self, found: Found) -> None:
        """Move a damaged checkpoint into `damaged/` and forget it; if it cannot be moved, it stays damaged."""
        moved = damage.set_aside(self.run_dir, found.path)
        self._folders.changed()
        if moved:
            self._retention.scores.pop(found.step, None)
            self._folders.damaged.discard(found.step)

    # ----- saving ---------------------------------------------------------------------------------------
    def save(self, step: int, write: Callable[[Path], None], score: float | None = None,
             info: dict[str, Any] | None = None) -> Path:
        """Save checkpoint `step`; every process calls it, and every process returns or raises together.

        1. The main process removes leftovers of interrupted saves and creates `.checkpoint-<step>.tmp/`.
           (Sync, so no process writes into a folder that is about to be cleaned.)
        2. Every process calls `write(tmp_dir)`, which writes this process's files (named per rank). Sync.
        3. The main process hashes every file, writes `COMPLETE.json` last, renames the folder to
           `checkpoint-<step>/`, then applies retention and writes the manifest. Sync.

        Args:
            step: the optimizer step; names the folder. Saving a step that already exists replaces it.
            write: writes this process's part into the folder it is given.
            score: this checkpoint's `metric`, if known now (else see `record_score`); None keeps it only while
                it is the latest.
            info: small JSON-serialisable facts stored in the marker (epoch, tokens seen, ...).

        Returns:
            the final folder `<run_dir>/checkpoint-<step>`.

        Raises:
            CheckpointError: writing failed on some process (disk full, no permission, ...). The temporary
                folder is removed and earlier checkpoints are untouched. An interrupt (KeyboardInterrupt) while
                saving propagates at once and leaves only the temporary folder, removed at the next start.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int of 0 or more, not {step!r}")
        tmp = temporary_folder(self.run_dir, step)
        final = final_folder(self.run_dir, step)
        previous, self.last_saved_step = self.last_saved_step, step  # the state written into this checkpoint
        try:
            self._steps.run(step, tmp, (lambda: self._prepare(step, tmp, final)) if self.is_main else None)
            self._steps.run(step, tmp, lambda: write(tmp))
            self._steps.run(step, tmp, (lambda: self._finish(step, tmp, final, score, info)) if self.is_main else None)
        except BaseException:
            self.last_saved_step = previous
            raise
        finally:  # the folder changed, whatever happened: the next look lists it again
            self._folders.changed()
        return final

    def _prepare(self, step: int, tmp: Path, final: Path) -> None:
        """Main process: clean up after interrupted saves, then create the temporary folder."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cleanup_incomplete()
        if step in self._folders.damaged and final.exists():  # saved again after a fallback: the new one
            self._set_aside(Found(step, final, None, True))  # must not delete the damaged one
        tmp.mkdir()

    def _finish(self, step: int, tmp: Path, final: Path, score: float | None, info: dict[str, Any] | None) -> None:
        """Main process: marker last, rename into place, then retention (only now may anything be deleted)."""
        clean = clean_score(score, step)
        marker = seal(tmp, final, step, self.metric, clean, info, self._fsync)
        self._folders.changed()
        self._folders.damaged.discard(step)
        self._retention.scores[step] = clean
        logger.info("Saved checkpoint %s (%.1f MB, %s=%s).", final, marker["total_bytes"] / MB, self.metric, clean)
        self._retention.report_sizes(final, marker)
        try:
            self._retain(just_saved=step)
        except OSError as exc:  # the checkpoint is complete; a full disk must not turn that into a failed save
            logger.warning("Checkpoint %s is saved, but applying retention or writing %s failed (%s); both are "
                           "retried at the next save.", final, MANIFEST_NAME, exc)
