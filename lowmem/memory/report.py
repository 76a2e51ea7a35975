"""What memory logs say: per-rank summaries, a leak verdict, a table, JSON and a plot (`lowmem memlog`). The files
are found and read by `lowmem.memory.log_files`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from lowmem.errors import LowmemError
from lowmem.memory.log import parse_log_name
from lowmem.memory.log_files import find_run, find_segments, join_segments, read_run, run_folder_log_dir
from lowmem.memory.phases import phase_cell, phase_peaks
from lowmem.units import MB

# A trend is GROWING when three things hold (slopes in MB per 1,000 steps):
# - its slope is above the floor, below which a leak is too slow to matter (2 MB per 1,000 steps is 0.3 GB
#   over the ~150,000 steps of three epochs of a large run, under a tenth of a rank's 4 GB share on the
#   reference host), and above three standard errors of the fitted slope;
# - the rise outgrows the noise of the log itself: read as a random walk, the record-to-record changes would
#   add up to about their standard deviation times the square root of their number, and the rise must be
#   three times that. A leak rises at every record; a few steps up (the first saves fill allocator arenas, a
#   cache fills once) are the noise of a short log, however steep a straight line through them looks: k equal
#   steps among the changes give a ratio of about sqrt(k);
# - the growth goes on: the later half of the fitted records must still grow faster than the floor, or it was
#   a one-off rise that stopped.
# The end record is left out of the fit: it is taken after the last save and validation, which allocate once.
FLAT_FLOOR_MB_PER_1K = 2.0
SIGNIFICANCE = 3.0
MIN_FIT_RECORDS = 3


# ----- finding and reading logs ---------------------------------------------------------------------------
# ----- summaries ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankSummary:
    """One rank's memory over a run. Bytes unless the name says MB; None where the log has no such figure."""

    run: str | None
    rank: int | None
    world_size: int | None
    records: int
    first_step: int
    last_step: int
    start_rss: int
    peak_rss: int
    peak_rss_step: int
    predicted_peak: int | None  # the memory plan's high-water for this rank (None in logs without a plan)
    end_rss: int
    fit_from_step: int | None  # first step of the trend fit (after warm-up)
    fit_records: int
    slope_mb_per_1k_steps: float | None  # least-squares RSS growth after warm-up
    slope_stderr_mb_per_1k_steps: float | None
    recent_slope_mb_per_1k_steps: float | None  # the same over the later half of the fitted records
    rise_mb: float | None  # RSS of the last fitted record less the first's
    noise_mb: float | None  # what the fitted records' changes add up to by chance (`_rise_and_noise`)
    peak_gpu: int | None  # the highest CUDA peak allocated (reserved where no peak was logged)
    min_sys_available: int | None
    freed_total: int
    budget: int | None  # this rank's share of the budget
    watchdog_events: int
    verdict: str  # FLAT, GROWING or UNKNOWN
    projected_step: int | None  # GROWING: the step at which RSS reaches the budget share at this rate
    explanation: str
    # Each phase's highest peak RSS and the plan's figure for it (None: no plan), from the phase records, in the order
    # first seen; empty in logs written before them.
    phases: dict[str, list[int | None]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_slope(steps: Sequence[float], values: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares line through (step, value): (slope per step, its standard error, intercept)."""
    x = np.asarray(steps, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    x_centered = x - x.mean()
    sxx = float(np.dot(x_centered, x_centered))
    slope = float(np.dot(x_centered, y - y.mean()) / sxx)
    intercept = float(y.mean() - slope * x.mean())
    residuals = y - (intercept + slope * x)
    # With two points the line is exact and has no error estimate; the callers need three.
    stderr = math.sqrt(float(np.dot(residuals, residuals)) / (len(x) - 2) / sxx) if len(x) > 2 else math.inf
    return slope, stderr, intercept


def _values(records: list[dict[str, Any]], field: str) -> list[int]:
    return [record[field] for record in records if isinstance(record.get(field), (int, float))]


def _peak_gpu(records: list[dict[str, Any]]) -> int | None:
    peaks = _values(records, "cuda_peak") or _values(records, "cuda_reserved")
    return max(peaks) if peaks else None


def _slope_mb_per_1k(fit: list[tuple[int, int]]) -> tuple[float, float] | None:
    """(slope, standard error) in MB per 1,000 steps of (step, rss) pairs; None with too few to fit."""
    if len(fit) < MIN_FIT_RECORDS or len({step for step, _ in fit}) < 2:
        return None
    per_step, per_step_error, _ = fit_slope([step for step, _ in fit], [rss / MB for _, rss in fit])
    return per_step * 1000, per_step_error * 1000


def _rise_and_noise(fit: list[tuple[int, int]]) -> tuple[float, float]:
    """(rise, noise) in MB of fitted (step, rss) pairs: the rise from the first to the last, and what the
    record-to-record changes would add up to by chance (their standard deviation times the square root of their
    number: a random walk's spread)."""
    changes = np.diff(np.asarray([rss for _, rss in fit], dtype=np.float64)) / MB
    rise = float(changes.sum())
    noise = float(changes.std(ddof=1)) * math.sqrt(len(changes)) if len(changes) > 1 else math.inf
    return rise, noise


def _verdict(slope: float | None, stderr: float | None, recent: float | None, fit_records: int,
             rise_noise: tuple[float, float], end_step: int, end_rss: int,
             budget: int | None) -> tuple[str, int | None, str]:
    """(verdict, projected step, explanation) from the fitted slopes in MB per 1,000 steps and the fit's rise
    and noise in MB (`_rise_and_noise`)."""
    if slope is None or stderr is None:
        return "UNKNOWN", None, (f"too few records after the warm-up to fit a trend ({fit_records}; "
                                 f"{MIN_FIT_RECORDS} needed)")
    threshold = max(FLAT_FLOOR_MB_PER_1K, SIGNIFICANCE * stderr)
    trend = f"{slope:+,.1f} ± {stderr:,.1f} MB per 1,000 steps"
    if slope < threshold:
        return "FLAT", None, f"{trend}, below the {threshold:,.1f} MB threshold"
    rise, noise = rise_noise
    if rise < SIGNIFICANCE * noise:
        return "FLAT", None, (f"{trend}, but the rise of {rise:,.1f} MB is within {SIGNIFICANCE:g} x the "
                              f"{noise:,.1f} MB that the log's record-to-record changes add up to by chance: "
                              "a few steps up, not a leak")
    if recent is not None and recent < FLAT_FLOOR_MB_PER_1K:
        return "FLAT", None, (f"{trend}, but {recent:+,.1f} over the later half: a one-off rise that stopped, "
                              "not a leak")
    if budget is None:
        return "GROWING", None, f"{trend}; no budget logged, so no projection"
    if end_rss >= budget:
        return "GROWING", end_step, f"{trend}; RSS is already over the {budget / MB:,.0f} MB budget share"
    projected = end_step + math.ceil((budget - end_rss) / MB / slope * 1000)
    return "GROWING", projected, (f"{trend}; at this rate RSS reaches the {budget / MB:,.0f} MB budget share "
                                  f"at step ~{projected:,}")


def summarize(records: list[dict[str, Any]], budget_bytes: int | None = None, warmup_fraction: float = 0.1,
              warmup_steps: int | None = None) -> RankSummary:
    """Start, peak and end RSS of one rank, its growth after warm-up, and the FLAT/GROWING verdict.

    The trend is fitted on the records after the warm-up, less the end record (taken after the last save and
    validation); the rules are those written above FLAT_FLOOR_MB_PER_1K.

    Args:
        records: one rank's records in the order written (at least one).
        budget_bytes: the rank's share of the budget; default: the `budget` field of the records.
        warmup_fraction: the share of the logged steps left out of the fit (allocators and caches fill
            up first, which is growth but not a leak).
        warmup_steps: leave out this many steps from the first record instead.
    """
    if not records:
        raise ValueError("summarize needs at least one record")
    steps = [record["step"] for record in records]
    rss = [record["rss"] for record in records]
    first_step, last_step = min(steps), max(steps)
    warmup = warmup_steps if warmup_steps is not None else warmup_fraction * (last_step - first_step)
    # The phase records are for each phase's peak (`_phases`): the trend is the regular records'.
    fit = [(step, value) for step, value, record in zip(steps, rss, records)
           if step >= first_step + warmup and record.get("event") not in ("end", "phase")]
    slope, stderr = _slope_mb_per_1k(fit) or (None, None)
    recent = _slope_mb_per_1k(fit[len(fit) // 2:])
    recent_slope = recent[0] if recent else None
    budgets = _values(records, "budget")
    budget = budget_bytes if budget_bytes is not None else (budgets[-1] if budgets else None)
    rise_noise = _rise_and_noise(fit) if fit else (0.0, math.inf)
    verdict, projected, explanation = _verdict(slope, stderr, recent_slope, len(fit), rise_noise, steps[-1],
                                               rss[-1], budget)
    # The peak is the highest RSS a record saw, or, where logged, the kernel's high-water mark, which
    # also catches the peaks between records (they are taken right after a cleanup).
    highest = [max(record["rss"], record.get("rss_high_water") or 0) for record in records]
    peak_index = max(range(len(highest)), key=highest.__getitem__)
    available = _values(records, "sys_available")
    return RankSummary(
        run=records[0].get("run"), rank=records[0].get("rank"), world_size=records[0].get("world_size"),
        records=len(records), first_step=first_step, last_step=last_step, start_rss=rss[0],
        peak_rss=highest[peak_index],
        peak_rss_step=steps[peak_index], predicted_peak=(_values(records, "predicted_high_water") or (None,))[-1],
        end_rss=rss[-1], fit_from_step=fit[0][0] if fit else None,
        fit_records=len(fit), slope_mb_per_1k_steps=slope, slope_stderr_mb_per_1k_steps=stderr,
        recent_slope_mb_per_1k_steps=recent_slope,
        rise_mb=rise_noise[0] if fit else None, noise_mb=rise_noise[1] if len(fit) > 2 else None,
        peak_gpu=_peak_gpu(records), min_sys_available=min(available) if available else None,
        freed_total=sum(_values(records, "freed")), budget=budget,
        watchdog_events=sum(record.get("event") == "watchdog" for record in records),
        verdict=verdict, projected_step=projected, explanation=explanation, phases=phase_peaks(records),
    )


# ----- output ---------------------------------------------------------------------------------------------
TABLE_COLUMNS = ("rank", "records", "steps", "start RSS", "peak RSS", "planned peak", "end RSS",
                 "growth MB/1k steps", "peak GPU", "min sys available", "cleanup freed")


def _mb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MB:,.0f} MB"


def _planned(summary: RankSummary) -> str:
    """The plan's high-water and how far the measured peak is from it ("930 MB (-2%)")."""
    if not summary.predicted_peak:
        return "n/a"
    error = (summary.peak_rss - summary.predicted_peak) / summary.predicted_peak
    return f"{_mb(summary.predicted_peak)} ({error:+.0%})"


def _row(summary: RankSummary) -> list[str]:
    slope = "n/a" if summary.slope_mb_per_1k_steps is None else f"{summary.slope_mb_per_1k_steps:+,.1f}"
    return [str(summary.rank), str(summary.records), f"{summary.first_step:,}-{summary.last_step:,}",
            _mb(summary.start_rss), _mb(summary.peak_rss), _planned(summary), _mb(summary.end_rss), slope,
            _mb(summary.peak_gpu),
            _mb(summary.min_sys_available), _mb(summary.freed_total)]


def _format_table(headers: Sequence[str], rows: list[list[str]]) -> str:
    """Columns right-aligned to their widest cell."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    lines = [list(headers), *rows]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in lines)


def render_table(summaries: Sequence[RankSummary], notes: Sequence[str]) -> str:
    """The per-rank table, a verdict line per rank, and the notes."""
    run = next((summary.run for summary in summaries if summary.run), "?")
    lines = [f"Memory log of run {run}: {len(summaries)} rank(s)"]
    if summaries:
        lines += ["", _format_table(TABLE_COLUMNS, [_row(summary) for summary in summaries]), ""]
        for summary in summaries:
            watchdog = f"; the watchdog fired {summary.watchdog_events} time(s)" if summary.watchdog_events else ""
            since = f" after step {summary.fit_from_step:,}" if summary.fit_from_step is not None else ""
            lines.append(f"rank {summary.rank}: {summary.verdict}{since}: {summary.explanation}{watchdog}")
    phases = list(dict.fromkeys(phase for summary in summaries for phase in summary.phases))
    if phases:
        lines += ["", "By phase: each phase's peak RSS, against the plan's figure for it", "",
                  _format_table(("rank", *phases), [[str(summary.rank), *(phase_cell(summary.phases.get(phase))
                                                                          for phase in phases)]
                                                    for summary in summaries])]
    if notes:
        lines += ["", "Notes:", *(f"  - {note}" for note in notes)]
    return "\n".join(lines)


def to_json(summaries: Sequence[RankSummary], notes: Sequence[str], plot_path: str | Path | None = None) -> str:
    """The summaries, notes and thresholds as a JSON document."""
    document = {
        "run": next((summary.run for summary in summaries if summary.run), None),
        "ranks": [summary.as_dict() for summary in summaries],
        "notes": list(notes),
        "thresholds": {"flat_floor_mb_per_1k_steps": FLAT_FLOOR_MB_PER_1K, "significance_stderrs": SIGNIFICANCE,
                       "rise_over_noise": SIGNIFICANCE},
        "plot": None if plot_path is None else str(plot_path),
    }
    return json.dumps(document, indent=2)


def plot_memory(records_by_rank: Mapping[int, list[dict[str, Any]]], summaries: Sequence[RankSummary],
                out_png: str | Path) -> Path:
    """Draw RSS per rank against the step with each budget share, GPU memory below when logged; save a PNG."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no display needed
    except ImportError as error:
        raise LowmemError('Plotting needs matplotlib: pip install "matplotlib>=3.6" (or pip install ".[plot]" in '
                          "lowmem's folder).") from error
    has_gpu = any(record.get("cuda_allocated") is not None
                  for records in records_by_rank.values() for record in records)
    figure = Figure(figsize=(10, 7 if has_gpu else 4.5), layout="constrained")
    axes = figure.subplots(2 if has_gpu else 1, 1, sharex=True, squeeze=False)[:, 0]
    fits = {summary.rank: summary for summary in summaries}
    for index, (rank, records) in enumerate(sorted(records_by_rank.items())):
        if not records:
            continue
        color = f"C{index % 10}"
        steps = [record["step"] for record in records]
        axes[0].plot(steps, [record["rss"] / MB for record in records], color=color, label=f"rank {rank} RSS")
        summary = fits.get(rank)
        if summary and summary.verdict == "GROWING" and summary.fit_from_step is not None:
            _draw_trend(axes[0], records, summary, color)
        if has_gpu:
            gpu: list[tuple[Any, Any, Any]] = [
                (record["step"], record.get("cuda_allocated"), record.get("cuda_reserved")) for record in records
                if record.get("cuda_allocated") is not None]
            if not gpu:
                continue
            axes[1].plot([g[0] for g in gpu], [g[1] / MB for g in gpu], color=color, label=f"rank {rank} allocated")
            axes[1].plot([g[0] for g in gpu], [(g[2] or 0) / MB for g in gpu], color=color, linestyle=":",
                         label=f"rank {rank} reserved")
    # One line per distinct share: ranks on one host share the budget equally.
    budgets = sorted({summary.budget for summary in summaries if summary.budget})
    for budget in budgets:
        ranks = ",".join(str(s.rank) for s in summaries if s.budget == budget)
        label = "budget share" if len(budgets) == 1 else f"budget share, rank(s) {ranks}"
        axes[0].axhline(budget / MB, color="red", linestyle="--", linewidth=1, label=label)
    axes[0].set_ylim(bottom=0)
    run = next((summary.run for summary in summaries if summary.run), "?")
    axes[0].set_title(f"Host memory per rank, run {run}")
    axes[0].set_ylabel("RSS (MB)")
    axes[0].legend(fontsize="small")
    if has_gpu:
        axes[1].set_title("GPU memory per rank")
        axes[1].set_ylabel("CUDA memory (MB)")
        axes[1].set_ylim(bottom=0)
        axes[1].legend(fontsize="small")
    axes[-1].set_xlabel("step")
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def _draw_trend(axis: Any, records: list[dict[str, Any]], summary: RankSummary, color: str) -> None:
    """The fitted growth line over the steps it was fitted on."""
    fit = [(record["step"], record["rss"] / MB) for record in records if record["step"] >= summary.fit_from_step]
    slope, _, intercept = fit_slope([s for s, _ in fit], [v for _, v in fit])
    ends = [fit[0][0], fit[-1][0]]
    axis.plot(ends, [intercept + slope * step for step in ends], color=color, linestyle="-.", linewidth=1,
              label=f"rank {summary.rank} trend")


def read_run_folder(run_logs: Path) -> tuple[dict[int, list[dict[str, Any]]], list[str], int | None]:
    """A run folder's memory records per rank, every segment of a resumed run joined; notes; and, for a resumed
    run, the step its last segment started at (None for one segment)."""
    segments, notes = find_segments(run_logs)
    read = [read_run(files) for files in segments]
    notes += [note for _, segment_notes in read for note in segment_notes]
    records_by_rank, last_start = join_segments([records for records, _ in read])
    if len(segments) == 1:
        return records_by_rank, notes, None
    runs = [parse_log_name(files[0])[0] for files in segments]  # type: ignore[index]
    notes.append(f"{len(segments)} segments joined (runs {', '.join(runs)}); the growth is fitted on the last, "
                 f"from step {last_start}, since a restart starts the memory afresh")
    return records_by_rank, notes, last_start


def _summary(records: list[dict[str, Any]], fit_from: int | None) -> RankSummary:
    """`summarize`, with the trend fitted from step `fit_from` on (plus the usual warm-up share) when given."""
    if fit_from is None:
        return summarize(records)
    first, last = records[0]["step"], records[-1]["step"]
    return summarize(records, warmup_steps=max(0, fit_from - first) + int(0.1 * max(0, last - fit_from)))


def memlog_command(path: str | None = None, plot: str | None = None, json_output: bool = False,
                   log_dir: str = "logs") -> str:
    """Summarise a run's memory logs: a table per rank and a FLAT/GROWING verdict (or JSON), and a plot.

    Args:
        path: a run folder (output_dir: its logs/, every segment of a resumed run joined), a run id, one
            rank's log file or a folder of logs; default: the newest run in `log_dir`.
        plot: write a PNG of RSS (and GPU memory) per rank against the step to this file.
        json_output: return the summaries as JSON instead of the table.
        log_dir: where training writes its logs.
    """
    run_logs = run_folder_log_dir(path)
    if run_logs is not None:
        records_by_rank, notes, fit_from = read_run_folder(run_logs)
    else:
        files = find_run(path, log_dir)
        single_file = path is not None and Path(path).is_file()
        records_by_rank, notes = read_run(files, expect_all_ranks=not single_file)
        fit_from = None
    summaries = [_summary(records, fit_from) for _, records in sorted(records_by_rank.items()) if records]
    plot_path = plot_memory(records_by_rank, summaries, plot) if plot else None
    if json_output:
        return to_json(summaries, notes, plot_path)
    text = render_table(summaries, notes)
    return text + (f"\n\nPlot written to {plot_path}" if plot_path else "")
