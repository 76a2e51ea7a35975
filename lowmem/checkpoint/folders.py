"""Checkpoint folders: atomic save, completeness marker, validation, retention by score, manifest.

A run directory looks like this::

    <run_dir>/checkpoint-<step>/        a complete checkpoint: its files plus COMPLETE.json
    <run_dir>/.checkpoint-<step>.tmp/   a save in progress, or left by one that was interrupted
    <run_dir>/checkpoints.json          the manifest: which checkpoints are kept and why

What goes into a checkpoint is the caller's business: `CheckpointManager.save(step, write)` calls
`write(folder)` on every rank and each rank writes its own files (named per rank) into the shared temporary
folder. This module only owns the folders: it makes them appear atomically, proves they are complete, finds
the latest good one, and deletes the ones no longer needed.

The completeness marker `COMPLETE.json` is written last, by the main rank, and lists every file with its
size and CRC-32. A `checkpoint-<step>` folder without a valid marker is never loaded and never counted.
CRC-32 (zlib) was chosen over SHA-256 because the aim is to catch truncated, torn or bit-rotted files, not
tampering, and zlib's CRC-32 runs more than twice as fast as hashlib's SHA-256: reading a 512 MB file from the
page cache in 1 MiB chunks on one core of the development machine, about 3.2 GB/s against 1.4 GB/s, so a 1.5 GB
checkpoint costs about half a second of hashing, and the read buffer is the only memory it needs.
Hashes are computed once on save and checked on load only for the checkpoint about to be resumed from.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from lowmem.atomic_files import fsync_read_only, replace_folder, write_json_atomic
from lowmem.disk_errors import disk_write_error, free_bytes, write_errno
from lowmem.errors import CheckpointError, ConfigError, LowmemError
from lowmem.program import command_line
from lowmem.units import MB

logger = logging.getLogger(__name__)

MARKER_NAME = "COMPLETE.json"
MANIFEST_NAME = "checkpoints.json"
DAMAGED_DIR = "damaged"  # where damaged checkpoints are set aside instead of being deleted
FORMAT_VERSION = 1

_CHUNK = 1 << 20  # 1 MiB reads: large enough for full hashing speed, small enough to keep RSS flat
_FINAL = re.compile(r"checkpoint-(\d+)")
_TMP = re.compile(r"\.checkpoint-(\d+)\.tmp")
_OLD = re.compile(r"\.checkpoint-(\d+)\.old")  # where replace_folder moves the checkpoint it replaces


# ----- small file helpers ---------------------------------------------------------------------------------
def file_crc32(path: str | Path, sync: bool = False) -> tuple[int, str]:
    """Size in bytes and CRC-32 (8 hex digits) of a file, read in 1 MiB chunks into one reused buffer.

    With `sync`, the file's data is fsynced first, so that a marker written afterwards never describes data
    that is still only in the page cache.
    """
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        if sync:
            fsync_read_only(f.fileno())
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, f"{crc:08x}"


def _files_in(folder: Path) -> list[Path]:
    """Every regular file under `folder` except the marker, sorted; symlinks are not followed."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            path = Path(root) / name
            if path.is_file() and not path.is_symlink() and path != folder / MARKER_NAME:
                found.append(path)
    return sorted(found)


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


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_marker(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """The parsed `COMPLETE.json` of a checkpoint folder, or None if it is missing or unreadable.

    Besides the file list it holds `step`, `score`, `metric` and the `info` dict given to `save`.
    """
    try:
        with open(Path(checkpoint_dir) / MARKER_NAME, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        return None
    return marker


def verify_checkpoint(checkpoint_dir: str | Path, check_hashes: bool = True) -> list[str]:
    """What is wrong with a checkpoint folder: an empty list means it is complete and intact.

    Checks that the marker exists and parses, and that every file it lists exists with the listed size and,
    with `check_hashes`, the listed CRC-32 (this reads every byte, so do it only for the one being loaded).
    """
    folder = Path(checkpoint_dir)
    if not (folder / MARKER_NAME).exists():
        return [f"no {MARKER_NAME} marker (the save did not finish)"]
    marker = read_marker(folder)
    if marker is None:
        return [f"{MARKER_NAME} is unreadable"]
    problems = []
    match = _FINAL.fullmatch(folder.name)
    if match and marker.get("step") != int(match.group(1)):
        problems.append(f"{MARKER_NAME} says step {marker.get('step')}, the folder name says {match.group(1)}")
    for rel, expected in sorted(marker["files"].items()):
        path = folder / rel
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{rel} is missing")
            continue
        if size != expected.get("size"):
            problems.append(f"{rel} has {size} bytes, the marker says {expected.get('size')} (truncated or rewritten)")
            continue
        if check_hashes:
            _size, crc = file_crc32(path)
            if crc != expected.get("crc32"):
                problems.append(f"{rel} has CRC-32 {crc}, the marker says {expected.get('crc32')} (corrupted)")
    return problems


def _step_of(path: Path) -> int:
    match = _FINAL.fullmatch(path.name)
    assert match is not None  # called only on `checkpoint-<step>` folders
    return int(match.group(1))


def _clean_score(score: float | None, step: int) -> float | None:
    """A float, or None for no score; NaN (a diverged validation) counts as no score rather than a best."""
    if score is None:
        return None
    value = float(score)
    if math.isnan(value):
        logger.warning("The score of checkpoint-%d is NaN; it is treated as unscored.", step)
        return None
    return value


@dataclass
class _Found:
    """A `checkpoint-<step>` folder on disk with its marker (None: marker missing or unreadable)."""

    step: int
    path: Path
    marker: dict[str, Any] | None
    has_marker_file: bool


# ----- the manager ----------------------------------------------------------------------------------------
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

    The main process removes leftovers of interrupted saves when it is created (never a complete checkpoint)
    and reads the manifest back, so the retention list survives resumes.
    """

    def __init__(self, run_dir: str | Path, keep_best_n: int, metric: str = "val_loss", mode: str = "min",
                 is_main: bool = True, barrier: Callable[[], None] = lambda: None,
                 all_ok: Callable[[bool], bool] | None = None, fsync: bool = True, save_every: int = 0,
                 resume_only: tuple[str, ...] = (), keep_resumable_n: int = 2) -> None:
        if not isinstance(keep_best_n, int) or keep_best_n < 0:
            raise ConfigError(f"keep_best_n must be 0 or more (it is {keep_best_n!r}); 0 keeps only the latest.")
        if mode not in ("min", "max"):
            raise ConfigError(f"mode must be 'min' (lower {metric} is better) or 'max' (higher is better), "
                              f"not {mode!r}.")
        if not metric:
            raise ConfigError("metric must name the score used to rank checkpoints, e.g. 'val_loss'.")
        self.run_dir = Path(run_dir)
        self.keep_best_n = keep_best_n
        self.metric = metric
        self.mode = mode
        self.is_main = is_main
        self._barrier = barrier
        self._all_ok = all_ok
        self._fsync = fsync
        self.save_every = save_every
        self.resume_only, self.keep_resumable_n = tuple(resume_only), max(1, keep_resumable_n)
        self._sizes_reported = False
        self.last_saved_step: int | None = None  # this training's last save (a resume loads it)
        self._scores: dict[int, float | None] = {}
        self._damaged: set[int] = set()  # steps found damaged by latest_complete(); never kept or resumed from
        self.damage: dict[str, list[str]] = {}  # what latest_complete() found wrong, by folder name
        if is_main and self.run_dir.is_dir():
            self.cleanup_incomplete()
            self._load_scores()
            self._refresh_manifest()

    # ----- when, and what the trainer keeps of it ------------------------------------------------------
    def due(self, step: int) -> bool:
        """True when a checkpoint is due after optimizer step `step`."""
        return bool(self.save_every) and step % self.save_every == 0

    def state_dict(self) -> dict[str, Any]:
        return {"last_saved_step": self.last_saved_step, "metric": self.metric, "mode": self.mode}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_saved_step = state.get("last_saved_step")

    # ----- looking at what is on disk -------------------------------------------------------------------
    def _scan(self) -> list[_Found]:
        """Every `checkpoint-<step>` folder, sorted by step."""
        if not self.run_dir.is_dir():
            return []
        found = []
        for path in self.run_dir.iterdir():
            if _FINAL.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                found.append(_Found(_step_of(path), path, read_marker(path), (path / MARKER_NAME).exists()))
        return sorted(found, key=lambda f: f.step)

    def _complete(self) -> list[_Found]:
        return [f for f in self._scan() if f.marker is not None and f.step not in self._damaged]

    def complete_checkpoints(self) -> list[Path]:
        """Folders with a readable marker, oldest first (a cheap check: files are verified by latest_complete)."""
        return [f.path for f in self._complete()]

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
        self.damage = {}
        for found in reversed(self._scan()):
            problems = verify_checkpoint(found.path, check_hashes=verify_hashes)
            if not problems:
                return found.path
            self._damaged.add(found.step)
            self.damage[found.path.name] = problems
            logger.warning("Checkpoint %s is damaged and will not be used: %s. Falling back to an earlier one.",
                           found.path, "; ".join(problems))
        return None

    def no_usable_checkpoint(self, found: Path | None) -> str | None:
        """The message that stops a resume when `latest_complete` found nothing (`found` is None) although
        checkpoints exist, every one damaged; None when it found one, or there are none and starting fresh is right."""
        if found is not None or not self.damage:
            return None
        listing = "; ".join(f"{name}: {', '.join(problems)}" for name, problems in self.damage.items())
        return (f"--is_keep_training=True found no usable checkpoint in {self.run_dir}: every one is damaged "
                f"({listing}). Nothing was changed or deleted. Restore the run folder from a copy if you have one; to "
                f"start a new run there instead, run without --is_keep_training and with --overwrite=True (that "
                f"deletes these checkpoints), or choose another --output_dir.")

    def start_from(self, checkpoint: str | Path) -> Path:
        """Resume from this checkpoint instead of the newest (main process): it must be one of this run folder's
        intact checkpoints. Newer checkpoints are moved into `superseded-<time>/` beside them, never deleted: a
        later resume would otherwise take the newest, from the line of training this one replaces."""
        folder = Path(checkpoint)
        if folder.resolve().parent != self.run_dir.resolve() or not _FINAL.fullmatch(folder.name):
            raise ConfigError(f"--resume_from_checkpoint={checkpoint} is not a checkpoint-<step> folder of the run "
                              f"folder {self.run_dir}.")
        problems = verify_checkpoint(folder)
        if problems:
            raise ConfigError(f"--resume_from_checkpoint={checkpoint} cannot be resumed from: {'; '.join(problems)}. "
                              f"Choose another checkpoint-<step> folder of {self.run_dir}.")
        newer = [found for found in self._scan() if found.step > _step_of(folder)]
        if newer and self.is_main:
            aside = self.run_dir / f"superseded-{datetime.now():%Y%m%d-%H%M%S}"
            aside.mkdir()
            for found in newer:
                found.path.rename(aside / found.path.name)
                self._scores.pop(found.step, None)
            logger.info("Resuming from %s: the newer %s moved to %s.", folder.name,
                        ", ".join(found.path.name for found in newer), aside)
            self._refresh_manifest()
        return self.run_dir / folder.name

    # ----- scores and manifest --------------------------------------------------------------------------
    def _load_scores(self) -> None:
        """Scores from the manifest where it has them, else from the markers (the score given to save)."""
        listed: dict[int, float | None] = {}
        manifest_path = self.run_dir / MANIFEST_NAME
        if manifest_path.exists():
            try:
                data = json.loads(manifest_path.read_text(encoding="utf-8"))
                entries = data["checkpoints"]
                listed = {int(e["step"]): e.get("score") for e in entries}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("Could not read %s (%s); rebuilding it from the checkpoint markers. Scores recorded "
                               "after a save are lost.", manifest_path, exc)
                data, listed = {}, {}
            if listed and (data.get("metric"), data.get("mode")) != (self.metric, self.mode):
                raise ConfigError(
                    f"{manifest_path} ranks checkpoints by {data.get('metric')} ({data.get('mode')}), but this run "
                    f"ranks them by {self.metric} ({self.mode}). Use the same metric and mode to continue this run, "
                    f"or another output folder; to re-rank, delete {manifest_path} (scores recorded after saving "
                    "are then lost)."
                )
        for found in self._complete():
            assert found.marker is not None  # _complete() keeps only folders with a readable marker
            if found.step in listed:
                self._scores[found.step] = _clean_score(listed[found.step], found.step)
            elif found.marker.get("metric") == self.metric:
                self._scores[found.step] = _clean_score(found.marker.get("score"), found.step)
            else:
                self._scores[found.step] = None

    def _best(self) -> list[int]:
        """Steps of the `keep_best_n` best-scoring complete checkpoints, best first.

        Ties in score go to the earlier step, so a checkpoint's rank never drops because a later one equals it.
        """
        sign = 1.0 if self.mode == "min" else -1.0
        scored = [(score, f.step) for f in self._complete() if (score := self._scores.get(f.step)) is not None]
        ranked = sorted(scored, key=lambda item: (sign * item[0], item[1]))
        return [step for _score, step in ranked[: self.keep_best_n]]

    def _plan(self, just_saved: int | None) -> dict[int, list[str]]:
        """Which complete checkpoints to keep, each with its reasons: the latest, the one just saved, the best n."""
        complete = self._complete()
        if not complete:
            return {}
        keep: dict[int, list[str]] = {complete[-1].step: ["latest"]}
        if just_saved is not None and just_saved not in keep:
            keep[just_saved] = ["just saved"]  # a save at a lower step than an existing one is still protected
        for rank, step in enumerate(self._best(), start=1):
            keep.setdefault(step, []).append(f"best #{rank} by {self.metric}={self._scores[step]:.6g}")
        return keep

    def _build_manifest(self, plan: dict[int, list[str]]) -> dict[str, Any]:
        complete = self._complete()
        return {
            "format": FORMAT_VERSION,
            "metric": self.metric,
            "mode": self.mode,
            "keep_best_n": self.keep_best_n,
            "latest": complete[-1].path.name if complete else None,
            "best": [f"checkpoint-{step}" for step in self._best()],
            "updated": _now(),
            # an entry with no reasons (keep_best_n was lowered on resume) is removed at the next save
            "checkpoints": [
                {"name": f.path.name, "step": f.step, "score": self._scores.get(f.step),
                 "kept_because": plan.get(f.step, [])}
                for f in complete
            ],
        }

    def _write_manifest(self, plan: dict[int, list[str]]) -> None:
        write_json_atomic(self.run_dir / MANIFEST_NAME, self._build_manifest(plan))

    def _refresh_manifest(self) -> None:
        """At start: rewrite the manifest if it no longer matches the folders (a crash between rename and
        manifest, a checkpoint deleted by hand). A read-only run folder only gets a warning."""
        path = self.run_dir / MANIFEST_NAME
        wanted = self._build_manifest(self._plan(None))
        try:
            current = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            current = None
        if current is None and not wanted["checkpoints"]:
            return
        if isinstance(current, dict) and {**current, "updated": None} == {**wanted, "updated": None}:
            return
        try:
            write_json_atomic(path, wanted)
        except OSError as exc:
            logger.warning("Could not update %s: %s", path, exc)

    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest: metric, mode, latest, best (in rank order) and each kept checkpoint with its reasons.

        On the main process it is computed from the current state; on the others it is read from disk.
        """
        if self.is_main:
            return self._build_manifest(self._plan(None))
        try:
            return json.loads((self.run_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def record_score(self, step: int, score: float | None) -> None:
        """Attach a score to an existing complete checkpoint (validation may run after the save) and re-apply
        retention, which may delete checkpoints that are now neither the latest nor among the best.

        Only the main process acts; on the others this is a no-op.
        """
        if not self.is_main:
            return
        if step not in {f.step for f in self._complete()}:
            logger.warning("No complete checkpoint-%d in %s to attach %s=%s to; the score is ignored.",
                           step, self.run_dir, self.metric, score)
            return
        self._scores[step] = _clean_score(score, step)
        try:
            self._retain(just_saved=None)
        except OSError as exc:  # bookkeeping only: training must not stop over it
            logger.warning("Could not apply retention or write %s after scoring checkpoint-%d (%s); retried at the "
                           "next save.", MANIFEST_NAME, step, exc)

    # ----- retention and cleanup ------------------------------------------------------------------------
    def _retain(self, just_saved: int | None) -> None:
        """Delete the checkpoints the plan does not keep (damaged ones included), then write the manifest."""
        plan = self._plan(just_saved)
        damaged = []
        for found in self._scan():
            if found.step in plan or not found.has_marker_file:
                continue  # marker-less folders are cleanup_incomplete's, and only at a safe moment
            if found.step in self._damaged or found.marker is None:
                damaged.append(found)
                continue
            logger.info("Removing checkpoint %s (%s=%s): neither the latest nor among the %d best.",
                        found.path, self.metric, self._scores.get(found.step), self.keep_best_n)
            self._delete(found.path)
            self._scores.pop(found.step, None)
        # What frees space first; setting aside (a rename, but a folder may have to be made) last.
        self._strip_older(plan)
        for found in damaged:
            self._set_aside(found)
        self._write_manifest(plan)

    def _set_aside(self, found: _Found) -> None:
        """Move a damaged checkpoint into `damaged/` under a name of its own, never deleting it: it may still hold
        what someone needs. A failure (a full disk cannot make the folder) leaves it where it is, with a warning."""
        aside = self.run_dir / DAMAGED_DIR / f"{found.path.name}-{datetime.now():%Y%m%d-%H%M%S-%f}"
        try:
            aside.parent.mkdir(exist_ok=True)
            found.path.rename(aside)
        except OSError as exc:
            logger.warning("Damaged checkpoint %s could not be moved into %s (%s); it stays, and is never resumed "
                           "from.", found.path, aside.parent, exc)
            return
        self._scores.pop(found.step, None)
        self._damaged.discard(found.step)
        logger.warning("Damaged checkpoint %s moved to %s (delete it once you no longer need it).", found.path, aside)

    def _strip_older(self, plan: dict[int, list[str]]) -> None:
        """Remove what only a resume reads (`resume_only`) from kept checkpoints older than the newest
        `keep_resumable_n`: they are kept for their score, and evaluation and export read only the weights. The
        marker is rewritten first, so an interruption leaves files the marker no longer lists, never a marker
        that lists missing files."""
        if not self.resume_only:
            return
        resumable = sorted(plan)[-self.keep_resumable_n:]
        for found in self._complete():
            if found.step not in plan or found.step in resumable:
                continue
            present = [name for name in self.resume_only if (found.path / name).exists()]
            if not present:
                continue
            assert found.marker is not None  # _complete() keeps only folders with a readable marker
            if not found.marker.get("weights_only"):
                files = {rel: entry for rel, entry in found.marker["files"].items() if not self._resume_only(rel)}
                marker = {**found.marker, "files": files, "weights_only": True,
                          "total_bytes": sum(entry["size"] for entry in files.values())}
                write_json_atomic(found.path / MARKER_NAME, marker)
            for name in present:
                target = found.path / name
                shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            logger.info("Checkpoint %s keeps its weights only (%s removed: only the newest %d checkpoints keep what "
                        "a resume needs).", found.path.name, ", ".join(present), self.keep_resumable_n)

    def _resume_only(self, rel: str) -> bool:
        """True for a file of a checkpoint (its path in the marker) that only a resume reads."""
        return any(rel == name or rel.startswith(f"{name}/") for name in self.resume_only)

    def _report_sizes(self, final: Path, marker: dict[str, Any]) -> None:
        """Once per run, at its first save: the checkpoint's size, what the kept ones will take, the space left."""
        if self._sizes_reported:
            return
        self._sizes_reported = True
        total = int(marker["total_bytes"])
        resume_part = sum(entry["size"] for rel, entry in marker["files"].items() if self._resume_only(rel))
        kept = self.keep_best_n + 1
        resumable = min(self.keep_resumable_n, kept) if resume_part else kept  # nothing to strip: all stay whole
        in_all = resumable * total + (kept - resumable) * (total - resume_part)
        free = free_bytes(self.run_dir)
        parts = f" (optimizer state {resume_part / MB:,.1f} MB)" if resume_part else ""
        line = (f"Checkpoint size: {final.name} takes {total / MB:,.1f} MB{parts}. At most {kept} checkpoints are "
                f"kept ({resumable} with what a resume needs, {kept - resumable} with the weights only): about "
                f"{in_all / MB:,.1f} MB in all; {'unknown' if free is None else f'{free / MB:,.1f} MB'} free on "
                f"that disk now.")
        # Still to come: the kept ones but this, and the one being written while the oldest still stands.
        if free is not None and in_all > free:
            logger.warning("%s That is not enough for the checkpoints still to come: free space, lower "
                           "--keep_latest_n_ckp or --keep_optimizer_n_ckp, or set --output_dir to a larger disk.",
                           line)
        else:
            logger.info(line)

    def _delete(self, folder: Path) -> None:
        """Remove a checkpoint so that an interruption midway leaves an incomplete folder, never a damaged one:
        the marker goes first."""
        (folder / MARKER_NAME).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)

    def cleanup_incomplete(self) -> list[Path]:
        """Remove leftovers of interrupted saves and deletions; returns what was removed.

        That is: temporary folders `.checkpoint-<step>.tmp`, and `checkpoint-<step>` folders with no marker
        file. A folder whose marker exists is never removed here, even if it is unreadable. A `.checkpoint-
        <step>.old` (the previous checkpoint of the same step, moved aside while being replaced) is put back if
        the replacement never arrived, else removed. Call it only while no save is running (the main process
        does at start and at the beginning of each save).
        """
        if not self.run_dir.is_dir():
            return []
        removed = []
        for path in sorted(self.run_dir.iterdir()):
            if not path.is_dir() or path.is_symlink():
                continue
            if _TMP.fullmatch(path.name):
                logger.info("Removing %s, left by an interrupted save.", path)
            elif old := _OLD.fullmatch(path.name):
                final = self.run_dir / f"checkpoint-{old.group(1)}"
                if not final.exists():
                    logger.warning("Restoring %s from %s: its replacement was interrupted.", final, path)
                    os.replace(path, final)
                    continue
                logger.info("Removing %s, replaced by %s.", path, final)
            elif _FINAL.fullmatch(path.name) and not (path / MARKER_NAME).exists():
                logger.warning("Removing %s: it has no %s marker, so it was never completely saved.",
                               path, MARKER_NAME)
            else:
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    # ----- saving ---------------------------------------------------------------------------------------
    def _agree(self, ok: bool) -> bool:
        """A sync point of all processes; True if every one of them reports success."""
        if self._all_ok is not None:
            return bool(self._all_ok(ok))
        self._barrier()
        return ok

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
        tmp = self.run_dir / f".checkpoint-{step}.tmp"
        final = self.run_dir / f"checkpoint-{step}"
        previous, self.last_saved_step = self.last_saved_step, step  # the state written into this checkpoint
        try:
            self._stage(step, tmp, (lambda: self._prepare(tmp)) if self.is_main else None)
            self._stage(step, tmp, lambda: write(tmp))
            self._stage(step, tmp, (lambda: self._finish(step, tmp, final, score, info)) if self.is_main else None)
        except BaseException:
            self.last_saved_step = previous
            raise
        return final

    def _prepare(self, tmp: Path) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cleanup_incomplete()
        final = self.run_dir / tmp.name.removeprefix(".").removesuffix(".tmp")
        if _step_of(final) in self._damaged and final.exists():  # saved again after a fallback: the new one
            self._set_aside(_Found(_step_of(final), final, None, True))  # must not delete the damaged one
        tmp.mkdir()

    def _stage(self, step: int, tmp: Path, action: Callable[[], None] | None) -> None:
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
        if self._agree(error is None):
            return
        if self.is_main:  # every process has passed the sync point, so nobody writes into it any more
            shutil.rmtree(tmp, ignore_errors=True)
        self._agree(True)  # the error message below reports free space after the partial folder is gone
        if error is None:
            raise CheckpointError(
                f"Another process failed while saving checkpoint-{step} in {self.run_dir} (its own error says why). "
                "The partial folder was removed; earlier checkpoints are untouched."
            )
        described = self._describe(error, step, written)
        if described is error:
            raise error  # not an OS error: a bug in the write callback, shown as it is
        raise described from error

    def _finish(self, step: int, tmp: Path, final: Path, score: float | None, info: dict[str, Any] | None) -> None:
        """Main process: marker last, rename into place, then retention (only now may anything be deleted)."""
        files: dict[str, dict[str, Any]] = {}
        for path in _files_in(tmp):
            size, crc = file_crc32(path, sync=self._fsync)
            files[path.relative_to(tmp).as_posix()] = {"size": size, "crc32": crc}
        clean = _clean_score(score, step)
        marker: dict[str, Any] = {
            "format": FORMAT_VERSION, "step": step, "created": _now(), "metric": self.metric, "score": clean,
            "info": info or {}, "hash": "crc32", "total_bytes": sum(f["size"] for f in files.values()),
            "files": files,
        }
        write_json_atomic(tmp / MARKER_NAME, marker)
        # An existing folder of the same step is moved aside first and removed after, so an interruption
        # leaves one of the two in place (see cleanup_incomplete).
        replace_folder(tmp, final)
        self._damaged.discard(step)
        self._scores[step] = clean
        logger.info("Saved checkpoint %s (%.1f MB, %s=%s).", final, marker["total_bytes"] / MB, self.metric, clean)
        self._report_sizes(final, marker)
        try:
            self._retain(just_saved=step)
        except OSError as exc:  # the checkpoint is complete; a full disk must not turn that into a failed save
            logger.warning("Checkpoint %s is saved, but applying retention or writing %s failed (%s); both are "
                           "retried at the next save.", final, MANIFEST_NAME, exc)

    def _previous_size(self) -> int:
        """Bytes of the newest complete checkpoint: the best guess of what the next one needs."""
        complete = self._complete()
        if not complete:
            return 0
        marker = complete[-1].marker
        assert marker is not None  # _complete() keeps only folders with a readable marker
        return int(marker.get("total_bytes", 0))

    def _describe(self, error: Exception, step: int, written: int) -> Exception:
        """Turn a write failure into a CheckpointError that says what happened and what to do; a failure that is
        no OS error (a bug in the write callback) passes through as it is."""
        if isinstance(error, LowmemError):
            return error  # says what happened already
        previous = self._complete()
        then = (f"then resume with `{command_line('train ... --is_keep_training=True')}` (your flags, and that "
                f"one: it continues from {previous[-1].path.name})" if previous else "then start again")
        kept = "The partial folder was removed; earlier checkpoints are untouched."
        free = free_bytes(self.run_dir)
        needed = max(written, self._previous_size())
        if free is not None and free < needed and write_errno(error) is None:
            # A library that reports a failed write without its errno (DeepSpeed's torch.save(obj, path): "unexpected
            # pos"): with less free than a checkpoint needs, a full disk is the likely cause.
            error = OSError(errno.ENOSPC, f"{type(error).__name__}: {error}")
        described = disk_write_error(error, f"checkpoint-{step}", self.run_dir, written=written, needed=needed,
                                     then=then, kept=kept, kind=CheckpointError)
        if described is not None:
            return described
        if not isinstance(error, OSError):
            return error
        free_text = f"{free / MB:.1f} MB are free there now" if free is not None else "free space is unknown"
        return CheckpointError(
            f"Could not save checkpoint-{step} in {self.run_dir}: {error} ({free_text}). Check the disk and the "
            f"folder, {then}. {kept}"
        )
