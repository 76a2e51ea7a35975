"""Retention by score: which complete checkpoints stay (the latest, the one just saved, the `keep_best_n` best by
the metric), the deletion of the others, and the optimizer state kept only in the newest few.

Deleting and stripping are ordered so that an interruption at any moment leaves folders that are either intact
or visibly incomplete (no marker, removed at the next start), never a marker that lists files that are gone.
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any

from lowmem.checkpoint.layout import MARKER_NAME
from lowmem.checkpoint.listing import Found
from lowmem.checkpoint.marker import write_marker
from lowmem.disk_errors import free_bytes
from lowmem.errors import ConfigError
from lowmem.units import MB

logger = logging.getLogger(__name__)


def clean_score(score: float | None, step: int) -> float | None:
    """A float, or None for no score; NaN (a diverged validation) counts as no score rather than a best."""
    if score is None:
        return None
    value = float(score)
    if math.isnan(value):
        logger.warning("The score of checkpoint-%d is NaN; it is treated as unscored.", step)
        return None
    return value


def delete_checkpoint(folder: Path) -> None:
    """Remove a checkpoint so that an interruption midway leaves an incomplete folder, never a damaged one:
    the marker goes first."""
    (folder / MARKER_NAME).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


class Retention:
    """The scores of a run's checkpoints and the rule that decides which of them stay.

    Args:
        run_dir: the run folder (for the free space in the size report).
        keep_best_n: how many of the best-scoring checkpoints to keep besides the latest (0: only the latest).
        metric: the name of the score, e.g. "val_loss" or "bleu4".
        mode: "min" if lower scores are better (losses), "max" if higher are (BLEU).
        resume_only: files and folders of a checkpoint that only a resume reads (the optimizer state).
        keep_resumable_n: how many of the newest kept checkpoints keep `resume_only` (at least 1: the latest).
    """

    def __init__(self, run_dir: Path, keep_best_n: int, metric: str, mode: str, resume_only: tuple[str, ...],
                 keep_resumable_n: int) -> None:
        if not isinstance(keep_best_n, int) or keep_best_n < 0:
            raise ConfigError(f"keep_best_n must be 0 or more (it is {keep_best_n!r}); 0 keeps only the latest.")
        if mode not in ("min", "max"):
            raise ConfigError(f"mode must be 'min' (lower {metric} is better) or 'max' (higher is better), "
                              f"not {mode!r}.")
        if not metric:
            raise ConfigError("metric must name the score used to rank checkpoints, e.g. 'val_loss'.")
        self.run_dir = run_dir
        self.keep_best_n, self.metric, self.mode = keep_best_n, metric, mode
        self.resume_only, self.keep_resumable_n = tuple(resume_only), max(1, keep_resumable_n)
        self.scores: dict[int, float | None] = {}
        self._sizes_reported = False

    def best(self, complete: list[Found]) -> list[int]:
        """Steps of the `keep_best_n` best-scoring of the `complete` checkpoints, best first.

        Ties in score go to the earlier step, so a checkpoint's rank never drops because a later one equals it.
        """
        sign = 1.0 if self.mode == "min" else -1.0
        scored = [(score, f.step) for f in complete if (score := self.scores.get(f.step)) is not None]
        ranked = sorted(scored, key=lambda item: (sign * item[0], item[1]))
        return [step for _score, step in ranked[: self.keep_best_n]]

    def plan(self, complete: list[Found], just_saved: int | None) -> dict[int, list[str]]:
        """Which of the `complete` checkpoints to keep, each with its reasons: the latest, the one just saved,
        the best n."""
        if not complete:
            return {}
        keep: dict[int, list[str]] = {complete[-1].step: ["latest"]}
        if just_saved is not None and just_saved not in keep:
            keep[just_saved] = ["just saved"]  # a save at a lower step than an existing one is still protected
        for rank, step in enumerate(self.best(complete), start=1):
            keep.setdefault(step, []).append(f"best #{rank} by {self.metric}={self.scores[step]:.6g}")
        return keep

    def remove_unkept(self, found_all: list[Found], plan: dict[int, list[str]], damaged: set[int]) -> list[Found]:
        """Delete the checkpoints of `found_all` that `plan` does not keep; returns the damaged ones (steps in
        `damaged`, or an unreadable marker), which are not deleted but left to be set aside."""
        left_damaged = []
        for found in found_all:
            if found.step in plan or not found.has_marker_file:
                continue  # marker-less folders are cleanup_incomplete's, and only at a safe moment
            if found.step in damaged or found.marker is None:
                left_damaged.append(found)
                continue
            logger.info("Removing checkpoint %s (%s=%s): neither the latest nor among the %d best.",
                        found.path, self.metric, self.scores.get(found.step), self.keep_best_n)
            delete_checkpoint(found.path)
            self.scores.pop(found.step, None)
        return left_damaged

    def strip_older(self, plan: dict[int, list[str]], complete: list[Found]) -> None:
        """Remove what only a resume reads (`resume_only`) from kept checkpoints older than the newest
        `keep_resumable_n`: they are kept for their score, and evaluation and export read only the weights. The
        marker is rewritten first, so an interruption leaves files the marker no longer lists, never a marker
        that lists missing files."""
        if not self.resume_only:
            return
        resumable = sorted(plan)[-self.keep_resumable_n:]
        for found in complete:
            if found.step not in plan or found.step in resumable:
                continue
            present = [name for name in self.resume_only if (found.path / name).exists()]
            if not present:
                continue
            assert found.marker is not None  # complete checkpoints all have a readable marker
            if not found.marker.get("weights_only"):
                files = {rel: entry for rel, entry in found.marker["files"].items() if not self.is_resume_only(rel)}
                marker = {**found.marker, "files": files, "weights_only": True,
                          "total_bytes": sum(entry["size"] for entry in files.values())}
                write_marker(found.path, marker)
            for name in present:
                target = found.path / name
                shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
            logger.info("Checkpoint %s keeps its weights only (%s removed: only the newest %d checkpoints keep what "
                        "a resume needs).", found.path.name, ", ".join(present), self.keep_resumable_n)

    def is_resume_only(self, rel: str) -> bool:
        """True for a file of a checkpoint (its path in the marker) that only a resume reads."""
        return any(rel == name or rel.startswith(f"{name}/") for name in self.resume_only)

    def report_sizes(self, final: Path, marker: dict[str, Any]) -> None:
        """Once per run, at its first save: the checkpoint's size, what the kept ones will take, the space left."""
        if self._sizes_reported:
            return
        self._sizes_reported = True
        total = int(marker["total_bytes"])
        resume_part = sum(entry["size"] for rel, entry in marker["files"].items() if self.is_resume_only(rel))
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
