"""The manifest `checkpoints.json`: which checkpoints are kept and why, and the scores that survive a resume.

It is bookkeeping, rebuilt from the checkpoints' markers when it is missing or unreadable: a checkpoint's
completeness is proved by its own marker, never by the manifest.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from lowmem.atomic_files import write_json_atomic
from lowmem.checkpoint.layout import FORMAT_VERSION, MANIFEST_NAME
from lowmem.checkpoint.listing import Found
from lowmem.checkpoint.marker import now
from lowmem.checkpoint.retention import Retention, clean_score
from lowmem.errors import ConfigError

logger = logging.getLogger(__name__)


def _listed_scores(run_dir: Path, metric: str, mode: str) -> dict[int, float | None]:
    """The scores the manifest records, by step (empty when it is missing or unreadable).

    Raises:
        ConfigError: the manifest ranks checkpoints by another metric or mode than this run.
    """
    manifest_path = run_dir / MANIFEST_NAME
    if not manifest_path.exists():
        return {}
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))
        entries = data["checkpoints"]
        listed = {int(e["step"]): e.get("score") for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("Could not read %s (%s); rebuilding it from the checkpoint markers. Scores recorded "
                       "after a save are lost.", manifest_path, exc)
        return {}
    if listed and (data.get("metric"), data.get("mode")) != (metric, mode):
        raise ConfigError(
            f"{manifest_path} ranks checkpoints by {data.get('metric')} ({data.get('mode')}), but this run "
            f"ranks them by {metric} ({mode}). Use the same metric and mode to continue this run, "
            f"or another output folder; to re-rank, delete {manifest_path} (scores recorded after saving "
            "are then lost)."
        )
    return listed


def read_scores(run_dir: Path, metric: str, mode: str, complete: list[Found]) -> dict[int, float | None]:
    """The score of each of the `complete` checkpoints: from the manifest where it has them (a score recorded
    after the save is only there), else from the marker (the score given to save), else None."""
    listed = _listed_scores(run_dir, metric, mode)
    scores: dict[int, float | None] = {}
    for found in complete:
        assert found.marker is not None  # complete checkpoints all have a readable marker
        if found.step in listed:
            scores[found.step] = clean_score(listed[found.step], found.step)
        elif found.marker.get("metric") == metric:
            scores[found.step] = clean_score(found.marker.get("score"), found.step)
        else:
            scores[found.step] = None
    return scores


def build_manifest(retention: Retention, complete: list[Found], plan: dict[int, list[str]]) -> dict[str, Any]:
    """The manifest of the `complete` checkpoints: metric, mode, latest, best (in rank order) and each
    checkpoint with the reasons `plan` keeps it for."""
    return {
        "format": FORMAT_VERSION,
        "metric": retention.metric,
        "mode": retention.mode,
        "keep_best_n": retention.keep_best_n,
        "latest": complete[-1].path.name if complete else None,
        "best": [f"checkpoint-{step}" for step in retention.best(complete)],
        "updated": now(),
        # an entry with no reasons (keep_best_n was lowered on resume) is removed at the next save
        "checkpoints": [
            {"name": f.path.name, "step": f.step, "score": retention.scores.get(f.step),
             "kept_because": plan.get(f.step, [])}
            for f in complete
        ],
    }


def _parsed(path: Path) -> Any:
    """The manifest file's JSON, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest atomically."""
    write_json_atomic(run_dir / MANIFEST_NAME, manifest)


def refresh_manifest(run_dir: Path, wanted: dict[str, Any]) -> None:
    """At start: rewrite the manifest if it no longer matches `wanted` (a crash between rename and manifest, a
    checkpoint deleted by hand). A read-only run folder only gets a warning."""
    path = run_dir / MANIFEST_NAME
    current = _parsed(path)
    if current is None and not wanted["checkpoints"]:
        return
    if isinstance(current, dict) and {**current, "updated": None} == {**wanted, "updated": None}:
        return
    try:
        write_manifest(run_dir, wanted)
    except OSError as exc:
        logger.warning("Could not update %s: %s", path, exc)


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """The manifest as written on disk; empty if it is missing or unreadable."""
    return _parsed(run_dir / MANIFEST_NAME) or {}
