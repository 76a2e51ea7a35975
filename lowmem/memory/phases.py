"""The high-water of each phase of a run, measured as the memory plan predicts it (`lowmem.memory.plan.PHASES`).

A run goes through its phases one after another: it loads (builds the model, fills it from a source), steps,
validates, saves, steps again, ..., and at its end exports final/ and best/. The kernel keeps one high-water mark of a
process's RSS (VmHWM); resetting it as each phase begins (`lowmem.memory.probe.reset_high_water`) and reading it as
the phase ends gives that phase's own peak, which the memory log records beside the plan's figure for the phase. The
process's peak over its whole life is still known (`own_high_water`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowmem.memory.cleanup import return_free_heap
from lowmem.memory.probe import high_water_since_reset, reset_high_water
from lowmem.units import MB


@dataclass(frozen=True)
class PhasePeak:
    """The peak RSS of one occurrence of a phase, and the plan's high-water for that phase (None: no plan)."""

    phase: str
    peak: int
    planned: int | None


@dataclass
class PhaseMeter:
    """Which phase this process is in, and the peak of the one that just ended.

    Args:
        planned: the memory plan's high-water of this process for each phase (empty without a plan).
    """

    planned: dict[str, int] = field(default_factory=dict)
    current: str | None = None
    peaks: dict[str, int] = field(default_factory=dict)  # each phase's highest peak so far, in the order first seen

    def enter(self, phase: str | None) -> PhasePeak | None:
        """End the current phase (its peak returned) and begin `phase` (None: none): what the heap keeps free is handed
        back first (without a fixed mmap threshold glibc keeps what a training step freed, which the phase would
        otherwise hold), then the kernel's mark is reset."""
        ended = None
        if self.current is not None:
            ended = PhasePeak(self.current, high_water_since_reset(), self.planned.get(self.current))
            self.peaks[ended.phase] = max(self.peaks.get(ended.phase, 0), ended.peak)
        return_free_heap()
        reset_high_water()
        self.current = phase
        return ended

    def describe(self) -> str:
        """Each phase's highest peak and the plan's figure, in one line."""
        texts = []
        for phase, peak in self.peaks.items():
            planned = self.planned.get(phase)
            text = f"{phase} {peak / 2**20:,.0f} MB"
            if planned:
                text += f" (plan {planned / 2**20:,.0f} MB, {(peak - planned) / planned:+.0%})"
            texts.append(text)
        return ", ".join(texts)


def phase_peaks(records: list[dict[str, Any]]) -> dict[str, list[int | None]]:
    """Phase → [its highest peak, the plan's figure for it] from one rank's memory records (its phase records), in the
    order first seen."""
    phases: dict[str, list[int | None]] = {}
    for record in records:
        if record.get("event") != "phase" or record.get("phase") is None:
            continue
        peak, planned = phases.get(record["phase"], [0, None])
        phases[record["phase"]] = [max(peak or 0, record.get("phase_high_water") or 0),
                                   record.get("phase_planned") or planned]
    return phases


def phase_cell(figures: list[int | None] | None) -> str:
    """A phase's peak and how far it is from the plan's figure ("1,102 MB (+2%)"), or "n/a"."""
    if not figures:
        return "n/a"
    peak, planned = figures
    text = f"{(peak or 0) / MB:,.0f} MB"
    return text + (f" ({((peak or 0) - planned) / planned:+.0%})" if planned else "")
