"""Running the check's stages in order: a failed or skipped stage is reported and the next one runs; each
stage ends with one verdict line on the terminal and one JSON line in the results file."""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

from lowmem.errors import ConfigError
from lowmem.gpucheck.runs import StageFailed, StageSkipped
from lowmem.gpucheck.stages import STAGES, CheckSettings, describe

MARKER = ".lowmem-gpu-check"  # marks a folder as the check's own, so that a new check may clear its runs


@dataclass
class StageResult:
    """One stage's verdict ("PASS", "FAIL" or "SKIP"), the reason for a FAIL or SKIP, its figures and time."""

    stage: str
    verdict: str
    reason: str
    figures: dict[str, Any]
    seconds: float

    def line(self, index: int, total: int) -> str:
        """The stage's verdict line."""
        detail = self.reason if self.verdict != "PASS" else describe(self.figures)
        return f"gpu_check [{index}/{total}] {self.stage}: {self.verdict} ({self.seconds:.0f} s) {detail}"

    def record(self, device: str) -> dict[str, Any]:
        """The JSON line of the results file."""
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": device, "stage": self.stage,
                "verdict": self.verdict, "reason": self.reason, "seconds": round(self.seconds, 1),
                "figures": self.figures}


def prepare_folder(folder: Path) -> None:
    """Make `folder` the check's own: new or empty, or left by an earlier check. Anything else is refused, as
    the check clears its earlier runs there."""
    if folder.exists() and any(folder.iterdir()) and not (folder / MARKER).exists():
        raise ConfigError(f"{folder} holds files that are not a gpu_check's: pass --folder=<a new folder> "
                          "(the check writes its runs there, and clears them when it runs again).")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).touch()


def run_stage(name: str, settings: CheckSettings) -> StageResult:
    """Run one stage; whatever it raises becomes its FAIL (or SKIP) with the reason."""
    started = time.monotonic()
    figures: dict[str, Any] = {}
    try:
        figures = STAGES[name](settings)
        verdict, reason = "PASS", ""
    except StageSkipped as skipped:
        verdict, reason = "SKIP", str(skipped)
    except StageFailed as failed:
        verdict, reason = "FAIL", str(failed)
    except Exception as error:  # noqa: BLE001 - a fault of the check itself is one more FAIL, not the end
        verdict = "FAIL"
        reason = f"{type(error).__name__}: {error} ({traceback.format_exc(limit=-2).strip().splitlines()[-3]})"
    return StageResult(name, verdict, reason, figures, time.monotonic() - started)


def run_check(settings: CheckSettings, results: Path, stages: Sequence[str], out: TextIO) -> list[StageResult]:
    """Run `stages` in order, print each verdict line to `out` and append each result to `results`."""
    unknown = [name for name in stages if name not in STAGES]
    if unknown:
        raise ConfigError(f"Unknown stage {', '.join(unknown)}: choose among {', '.join(STAGES)} (comma-separated).")
    prepare_folder(settings.folder)
    results.parent.mkdir(parents=True, exist_ok=True)
    outcome = []
    print(f"gpu_check on {settings.device}: {len(stages)} stage(s), results in {results}", file=out, flush=True)
    for index, name in enumerate(stages, start=1):
        result = run_stage(name, settings)
        outcome.append(result)
        with results.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(result.record(settings.device), ensure_ascii=False, default=str) + "\n")
        print(result.line(index, len(stages)), file=out, flush=True)
    counts = {verdict: sum(result.verdict == verdict for result in outcome) for verdict in ("PASS", "FAIL", "SKIP")}
    print(f"gpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP", file=out, flush=True)
    return outcome
