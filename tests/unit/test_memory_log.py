"""Memory observability: snapshots, the JSON-lines memory log, the watchdog, and reading logs back (memlog)."""

from __future__ import annotations

import json
import re
import logging
import multiprocessing
import sys
import types
from pathlib import Path

import numpy as np
import psutil
import pytest

from lowmem.errors import DataError
from lowmem.memory.log_files import find_run, find_segments, read_log, read_run
from lowmem.memory.report import FLAT_FLOOR_MB_PER_1K, TABLE_COLUMNS, memlog_command, summarize
from lowmem.memory import (SETTINGS_TO_LOWER, MemoryLogger, MemoryMonitor, MemorySnapshot, MemoryWatchdog,
                           cleanup_memory, format_line, new_run_id, take_snapshot)
from lowmem.memory.cleanup import _find_malloc_trim
from lowmem.memory.log import RECORD_FIELDS

MB = 1024**2
RUN = "20260101-120000"


def snapshot(rss: int, **figures) -> MemorySnapshot:
    """A made-up snapshot: RSS as given, small plausible figures elsewhere."""
    values = dict(uss=None, workers=0, workers_rss=0, workers_uss=None, sys_available=8000 * MB, arrow_bytes=0)
    values.update(figures)
    return MemorySnapshot(rss=rss, **values)


def record(step: int, rss_mb: float, rank: int = 0, world_size: int = 1, event: str = "record", **extra) -> dict:
    """A made-up log record."""
    base = {field: None for field in RECORD_FIELDS}
    base.update(time=1.0e9 + step, run=RUN, rank=rank, world_size=world_size, epoch=0, step=step, event=event,
                rss=int(rss_mb * MB), workers=0, workers_rss=0, sys_available=8000 * MB, budget=4096 * MB,
                arrow_bytes=0, freed=MB)
    base.update(extra)
    return base


def write_log(folder: Path, rank: int, records: list[dict], run: str = RUN, tail: str = "") -> Path:
    path = folder / f"memory_{run}_rank{rank}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


# ----- snapshot and cleanup -------------------------------------------------------------------------------
def test_snapshot_has_sane_numbers():
    snap = take_snapshot()
    total = psutil.virtual_memory().total
    assert 10 * MB < snap.rss < total
    assert snap.uss is None or 0 < snap.uss <= snap.rss
    assert 0 < snap.sys_available <= total
    assert snap.arrow_bytes >= 0
    assert snap.cuda_allocated is None and snap.cuda_reserved is None and snap.cuda_peak is None
    cheap = take_snapshot(include_children=False, include_uss=False)
    assert cheap.uss is None and cheap.workers_rss is None and cheap.footprint == cheap.rss


def test_snapshot_reads_cuda_figures_where_cuda_is_in_use(monkeypatch):
    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                 memory_allocated=lambda: 300 * MB, memory_reserved=lambda: 512 * MB,
                                 max_memory_allocated=lambda: 400 * MB)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    snap = take_snapshot(include_children=False, include_uss=False)
    assert (snap.cuda_allocated, snap.cuda_reserved, snap.cuda_peak) == (300 * MB, 512 * MB, 400 * MB)


@pytest.mark.skipif(_find_malloc_trim() is None, reason="malloc_trim is glibc's")
def test_cleanup_gives_freed_heap_back():
    cleanup_memory(on_gpu=False)
    garbage = [bytearray(1000) for _ in range(100_000)]  # ~100 MB in malloc'd chunks
    del garbage
    assert cleanup_memory(on_gpu=False) > 50 * MB


# ----- the memory log -------------------------------------------------------------------------------------
def test_logger_writes_one_flushed_json_line_per_record(tmp_path):
    run = new_run_id()
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", run)
    # Runs started in the same second still get ids of their own, and memory logs of their own.
    assert len({new_run_id(now=1e9) for _ in range(20)}) == 20
    with MemoryLogger(tmp_path, run, rank=1, world_size=3, budget_bytes=4096 * MB) as log:
        log.log(take_snapshot(), epoch=0, step=0, event="start")
        log.log(take_snapshot(), epoch=0, step=200, freed=5 * MB)
        lines = log.path.read_text().splitlines()  # before closing: each record is flushed
    assert log.path == tmp_path / f"memory_{run}_rank1.jsonl"
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert all(list(r) == list(RECORD_FIELDS) for r in records)
    assert [r["event"] for r in records] == ["start", "record"]
    second = records[1]
    assert (second["run"], second["rank"], second["world_size"], second["step"]) == (run, 1, 3, 200)
    assert second["budget"] == 4096 * MB and second["freed"] == 5 * MB and second["rss"] > 0
    with pytest.raises(ValueError):
        MemoryLogger(tmp_path, run, 0, 1, MB).log(take_snapshot(), 0, 0, event="oops")


def test_format_line_reads_in_mb():
    line = format_line(record(400, 812.4, cuda_allocated=300 * MB, cuda_reserved=512 * MB, cuda_peak=400 * MB,
                              uss=790 * MB, freed=3 * MB))
    for part in ("step 400", "rss 812 MB (uss 790 MB)", "budget share 4,096 MB (20% used)",
                 "system available 8,000 MB", "cuda allocated 300 MB reserved 512 MB peak 400 MB",
                 "cleanup freed 3 MB"):
        assert part in line, (part, line)
    assert "\n" not in line


# ----- leak verdict ---------------------------------------------------------------------------------------
def simulate_training(folder: Path, leak: bool, steps: int = 300, every: int = 10, on_gpu: bool = False) -> Path:
    """Allocate 1 MB per step (kept when `leak`), with a cleanup and a memory record every `every` steps (the
    cleanup of a GPU process with `on_gpu`: no full garbage collection)."""
    kept = []
    cleanup_memory(on_gpu=False)
    budget = psutil.Process().memory_info().rss + 2048 * MB
    with MemoryLogger(folder, RUN, rank=0, world_size=1, budget_bytes=budget) as log:
        for step in range(1, steps + 1):
            activations = np.ones(MB, dtype=np.uint8)  # touched, so resident
            if leak:
                kept.append(activations)
            del activations
            if step % every == 0:
                freed = cleanup_memory(on_gpu=on_gpu)
                log.log(take_snapshot(), epoch=0, step=step, freed=freed)
    return log.path


def simulate_in_a_fresh_process(folder: Path, leak: bool, on_gpu: bool = False) -> Path:
    """`simulate_training` in a new interpreter: its RSS is that loop's alone, not that of whatever the tests run
    before it in this process left behind (threads, heap fragments)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(simulate_training, (folder, leak), {"on_gpu": on_gpu})


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu-cleanup", "gpu-cleanup"])
def test_planted_leak_is_growing_at_its_true_rate(tmp_path, on_gpu):
    records, notes = read_log(simulate_in_a_fresh_process(tmp_path, leak=True, on_gpu=on_gpu))
    assert notes == [] and len(records) == 30
    summary = summarize(records)
    assert summary.verdict == "GROWING", summary.explanation
    assert 800 <= summary.slope_mb_per_1k_steps <= 1200, summary.slope_mb_per_1k_steps
    # ~2 GB of headroom at 1 MB per step: the budget share runs out about 2,000 steps after the end.
    assert 300 + 1500 < summary.projected_step < 300 + 2500, summary.projected_step


def test_run_without_leak_is_flat(tmp_path):
    records, _ = read_log(simulate_in_a_fresh_process(tmp_path, leak=False))
    summary = summarize(records)
    assert summary.verdict == "FLAT", summary.explanation
    assert summary.slope_mb_per_1k_steps < FLAT_FLOOR_MB_PER_1K
    assert summary.projected_step is None


def test_noise_and_one_off_jumps_are_not_leaks():
    rng = np.random.default_rng(0)
    noisy = [record(step, 800 + rng.normal(0, 3)) for step in range(200, 10_001, 200)]
    assert summarize(noisy).verdict == "FLAT"
    # A cache that fills once, mid-log: a straight line through it slopes, but the growth has stopped.
    jump = [record(step, 800 if step < 1000 else 900) for step in range(200, 2001, 200)]
    summary = summarize(jump, warmup_steps=0)
    assert summary.slope_mb_per_1k_steps > 50 and summary.verdict == "FLAT", summary.explanation
    # A leak that starts late is still one.
    late = [record(step, 800 + max(0, step - 5000) / 10) for step in range(200, 10_001, 200)]
    assert summarize(late).verdict == "GROWING"
    short = [record(200, 800), record(400, 900)]
    assert summarize(short).verdict == "UNKNOWN"


def gpu_check_log_of_the_h200() -> list[dict]:
    """The memory log of gpu_check's train stage on the H200 that memlog called GROWING (+14.7 MB per 1,000
    steps), rebuilt from its figures on docs/gpu.md: 200 steps, a record every 10, saves at 50, 100 and 150, a
    warm-up to step 60; 1.3 MB in all over the 140 steps after it, 0.7 MB after the save at 100 and 0.2 MB after
    the one at 150, the rest in steps of 0.1 MB; the end record after the last save and validation."""
    rises = {110: 0.7, 160: 0.2, 80: 0.1, 130: 0.1, 180: 0.1, 200: 0.1}
    records, rss = [record(0, 1700.0, event="start")], 1764.0
    for step in range(10, 201, 10):
        rss += rises.get(step, 0.0) + (0.01 if step % 20 else -0.01)  # the last MB's jitter
        records.append(record(step, rss))
    return records + [record(200, rss + 1.5, event="end")]


def gpu_check_log_of_the_cpu() -> list[dict]:
    """The CPU's memory log that memlog called GROWING (+66 MB per 1,000 steps), rebuilt from its figures on
    docs/gpu.md: 100 steps, a record every 4, saves at 25, 50 and 75 and a warm-up to step 29; 11 MB in all, in
    steps after the saves at 50 and 75, with the end record after the last save."""
    rises = {52: 7.0, 76: 4.0}
    records, rss = [record(0, 420.0, event="start")], 512.0
    for step in range(4, 101, 4):
        rss += rises.get(step, 0.0) + (0.05 if step % 8 else -0.05)
        records.append(record(step, rss))
    return records + [record(100, rss + 3.0, event="end")]


@pytest.mark.parametrize("log", [gpu_check_log_of_the_h200, gpu_check_log_of_the_cpu])
def test_a_few_steps_up_in_a_short_log_are_not_a_leak(log):
    records = log()
    save_steps, memory_log_steps = (50, 10) if log is gpu_check_log_of_the_h200 else (25, 4)
    summary = summarize(records, warmup_steps=save_steps + memory_log_steps)  # as gpu_check's memory_log stage
    assert summary.slope_mb_per_1k_steps > 3 * FLAT_FLOOR_MB_PER_1K  # steep enough to have been called GROWING
    assert summary.verdict == "FLAT", summary.explanation
    assert "a few steps up" in summary.explanation
    assert summary.rise_mb < 3 * summary.noise_mb


def test_a_leak_in_a_short_log_is_growing():
    # The same length and spacing as the H200's log, 0.1 MB more at every record: 1.4 MB over the fit, a
    # rise no larger than that log's, but at every record.
    records = [record(step, 1764.0 + step / 100) for step in range(10, 201, 10)]
    summary = summarize(records, warmup_steps=60)
    assert summary.verdict == "GROWING", summary.explanation
    # With the steps up of the H200's log on top, still growing.
    bumped = [dict(item, rss=item["rss"] + other["rss"] - gpu_check_log_of_the_h200()[1]["rss"])
              for item, other in zip(records, gpu_check_log_of_the_h200()[1:])]
    assert summarize(bumped, warmup_steps=60).verdict == "GROWING"


def test_the_end_record_is_left_out_of_the_fit():
    # Flat to the last record; the end record, after the final save and validation, 40 MB up.
    records = [record(step, 800.0 + (0.2 if step % 20 else 0)) for step in range(10, 301, 10)]
    records.append(record(300, 840.0, event="end"))
    summary = summarize(records, warmup_steps=0)
    assert summary.verdict == "FLAT", summary.explanation
    assert summary.end_rss == 840 * MB and summary.fit_records == 30


def test_warmup_is_left_out_of_the_fit():
    records = [record(step, 500 + (step if step < 1000 else 1000)) for step in range(100, 10_001, 100)]
    assert summarize(records, warmup_steps=0).slope_mb_per_1k_steps > 20
    summary = summarize(records, warmup_fraction=0.1)
    assert summary.fit_from_step >= 1090 and abs(summary.slope_mb_per_1k_steps) < 0.1
    assert summary.verdict == "FLAT"
    assert (summary.start_rss, summary.peak_rss, summary.end_rss) == (600 * MB, 1500 * MB, 1500 * MB)


# ----- damaged and missing logs ---------------------------------------------------------------------------
def test_truncated_last_line_is_read_up_to_the_damage(tmp_path):
    path = write_log(tmp_path, 0, [record(s, 800) for s in (200, 400, 600)], tail='{"time": 1.0, "run": "x", "ra')
    records, notes = read_log(path)
    assert [r["step"] for r in records] == [200, 400, 600]
    assert len(notes) == 1 and "line 4 is cut off" in notes[0]


def test_garbled_middle_line_is_skipped_with_a_note(tmp_path):
    path = tmp_path / f"memory_{RUN}_rank0.jsonl"
    lines = [json.dumps(record(200, 800)), "\x00\x00garbage", json.dumps(record(400, 800)), '{"step": "x"}',
             json.dumps(record(600, 800))]
    path.write_text("\n".join(lines) + "\n")
    records, notes = read_log(path)
    assert [r["step"] for r in records] == [200, 400, 600]
    assert notes == [f"{path.name}: line(s) 2, 4 damaged (not a memory record), skipped"]
    empty = tmp_path / "memory_x_rank0.jsonl"
    empty.write_text("")
    assert read_log(empty) == ([], [f"{empty.name}: empty (no record was written)"])


def test_missing_rank_and_early_stop_are_noted(tmp_path):
    write_log(tmp_path, 0, [record(s, 800, 0, 3) for s in (200, 400)] + [record(400, 800, 0, 3, event="end")])
    write_log(tmp_path, 1, [record(s, 800, 1, 3) for s in (200, 400)])
    records_by_rank, notes = read_run(find_run(None, tmp_path))
    assert sorted(records_by_rank) == [0, 1]
    assert any(note.startswith("rank 2: no log") for note in notes), notes
    assert any(note.startswith("rank 1: no end record") for note in notes), notes
    # One rank's file asked for on purpose: the other ranks are not missing.
    _, single_notes = read_run([tmp_path / f"memory_{RUN}_rank1.jsonl"], expect_all_ranks=False)
    assert not any("no log" in note for note in single_notes)


def test_find_run_picks_the_newest_run(tmp_path):
    write_log(tmp_path, 0, [record(200, 800)], run="20260101-120000")
    write_log(tmp_path, 0, [record(200, 800)], run="20260102-090000")
    write_log(tmp_path, 1, [record(200, 800)], run="20260102-090000")
    newest = find_run(None, tmp_path)
    assert [p.name for p in newest] == ["memory_20260102-090000_rank0.jsonl", "memory_20260102-090000_rank1.jsonl"]
    assert find_run("20260101-120000", tmp_path) == [tmp_path / "memory_20260101-120000_rank0.jsonl"]
    assert find_run(str(newest[1])) == [newest[1]]
    with pytest.raises(DataError, match="20260102-090000"):
        find_run("nope", tmp_path)
    with pytest.raises(DataError, match="No memory logs"):
        find_run(None, tmp_path / "empty")


def test_a_resume_started_in_its_runs_second_is_the_newest_and_joins_it(tmp_path):
    """Run ids are to the second: a run and its resume started within one (a short run, a quick resume) are
    ordered by which continues which, and other runs of that second by their start records' times, not by the
    ids' random endings."""
    first, resumed = "20260102-090000-ffffff", "20260102-090000-000000"  # the first's ending sorts after
    write_log(tmp_path, 0, [record(0, 800, event="start", run=first, time=100.2), record(4, 800, run=first)],
              run=first)
    write_log(tmp_path, 0, [record(2, 800, event="start", run=resumed, time=100.7, continues=[first]),
                            record(4, 800, run=resumed)], run=resumed)
    assert [p.name for p in find_run(None, tmp_path)] == [f"memory_{resumed}_rank0.jsonl"]
    segments, notes = find_segments(tmp_path)
    assert [[p.name for p in files] for files in segments] == [[f"memory_{first}_rank0.jsonl"],
                                                               [f"memory_{resumed}_rank0.jsonl"]] and not notes
    # Two unrelated runs of one second: the one that started later.
    other = tmp_path / "other"
    other.mkdir()
    write_log(other, 0, [record(0, 800, event="start", run=first, time=100.9)], run=first)
    write_log(other, 0, [record(0, 800, event="start", run=resumed, time=100.1)], run=resumed)
    assert [p.name for p in find_run(None, other)] == [f"memory_{first}_rank0.jsonl"]
    write_log(other, 0, [record(0, 800, event="start", run=first, time=99.9)], run=first)
    assert [p.name for p in find_run(None, other)] == [f"memory_{resumed}_rank0.jsonl"]


# ----- the memlog command ---------------------------------------------------------------------------------
def _damaged_run(folder: Path) -> None:
    """Rank 0 flat, rank 1 leaking and cut off mid-line, rank 2 missing."""
    steps = range(200, 6001, 200)
    write_log(folder, 0, [record(s, 800, 0, 3, cuda_peak=900 * MB, cuda_allocated=500 * MB, cuda_reserved=1000 * MB)
                          for s in steps])
    write_log(folder, 1, [record(s, 800 + s / 10, 1, 3) for s in steps], tail='{"step": 62')


def test_memlog_command_table(tmp_path):
    _damaged_run(tmp_path)
    text = memlog_command(log_dir=str(tmp_path))
    for column in TABLE_COLUMNS:
        assert column in text
    assert "900 MB" in text  # rank 0's peak GPU memory
    assert "rank 0: FLAT" in text
    assert "rank 1: GROWING" in text and "+100.0" in text and "budget share at step ~" in text
    assert "rank 2: no log" in text and "line 31 is cut off" in text


def test_memlog_command_json(tmp_path):
    _damaged_run(tmp_path)
    document = json.loads(memlog_command(str(tmp_path), json_output=True))
    ranks = {entry["rank"]: entry for entry in document["ranks"]}
    assert ranks[0]["verdict"] == "FLAT" and ranks[1]["verdict"] == "GROWING"
    assert abs(ranks[1]["slope_mb_per_1k_steps"] - 100) < 1
    assert ranks[1]["projected_step"] == 6000 + (4096 - 1400) * 10
    assert ranks[0]["peak_gpu"] == 900 * MB
    assert len(document["notes"]) == 2


def test_memlog_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    _damaged_run(tmp_path)
    out = tmp_path / "plots" / "memory.png"
    text = memlog_command(RUN, plot=str(out), log_dir=str(tmp_path))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out) in text


# ----- watchdog -------------------------------------------------------------------------------------------
def test_watchdog_fires_and_names_the_settings_to_lower(caplog):
    watchdog = MemoryWatchdog(budget_share_bytes=10 * MB, fraction=0.9)
    with caplog.at_level(logging.WARNING, logger="lowmem.memory.watchdog"):
        result = watchdog.check(take_snapshot(), on_gpu=False, step=1200)
    assert result is not None and result.still_over and result.logged
    assert result.limit == 9 * MB and result.freed >= 0
    assert "at step 1200" in result.message
    for setting in SETTINGS_TO_LOWER:
        assert f"--{setting}" in result.message
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [result.message]


def test_watchdog_is_quiet_under_the_limit_and_rate_limited_over_it(caplog):
    calls = []

    def cleanup(on_gpu: bool) -> int:
        calls.append(on_gpu)
        return MB

    watchdog = MemoryWatchdog(1000 * MB, fraction=0.9, repeat_every=5, probe=lambda **_: snapshot(950 * MB))
    assert watchdog.check(snapshot(800 * MB), on_gpu=True, cleanup=cleanup) is None
    with caplog.at_level(logging.WARNING, logger="lowmem.memory.watchdog"):
        results = [watchdog.check(snapshot(950 * MB), on_gpu=True, cleanup=cleanup) for _ in range(11)]
    fired = [index for index, result in enumerate(results) if result is not None]
    assert fired == [0, 5, 10]  # one cleanup and one warning per 5 checks while it stays over
    assert calls == [True, True, True]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3


def test_watchdog_cleanup_that_helps_says_so():
    watchdog = MemoryWatchdog(1000 * MB, probe=lambda **_: snapshot(700 * MB))
    result = watchdog.check(snapshot(950 * MB), on_gpu=False, cleanup=lambda on_gpu: 250 * MB)
    assert result is not None and not result.still_over
    assert "Back under the limit" in result.message and "batch_size_per_gpu" not in result.message
    assert "freed 250 MB" in result.message


# ----- the schedule ---------------------------------------------------------------------------------------
def test_monitor_cleans_up_and_records_on_schedule(tmp_path, caplog):
    cleanups = []
    log = MemoryLogger(tmp_path, RUN, 0, 1, budget_bytes=64 * 1024 * MB)
    monitor = MemoryMonitor(log, MemoryWatchdog(64 * 1024 * MB), on_gpu=False, cleanup_steps=50, memory_log_steps=200,
                            cleanup=lambda on_gpu: cleanups.append(on_gpu) or 0)
    with caplog.at_level(logging.INFO, logger="lowmem.memory.monitor"):
        monitor.start(0, 0)
        written = [step for step in range(1, 401) if monitor.after_step(0, step) is not None]
        monitor.end(0, 400)
    assert written == [200, 400]
    assert len(cleanups) == 8 + 1  # every 50 steps, and at the end
    records, notes = read_log(log.path)
    assert [r["event"] for r in records] == ["start", "record", "record", "end"] and notes == []
    assert sum("memory record rank 0" in r.getMessage() for r in caplog.records) == 2


def test_peak_includes_the_high_water_mark_between_records():
    from lowmem.memory.report import summarize
    from lowmem.memory.probe import take_snapshot

    snapshot = take_snapshot(include_uss=False)
    assert snapshot.rss_high_water is not None and snapshot.rss_high_water >= snapshot.rss * 0.99
    mb = 1024**2
    records = [{"step": step, "rss": 500 * mb, "rss_high_water": (800 if step >= 200 else 600) * mb,
                "budget": 4096 * mb, "event": "record", "run": "r", "rank": 0, "world_size": 1}
               for step in range(0, 1000, 100)]
    summary = summarize(records)
    assert summary.peak_rss == 800 * mb and summary.peak_rss_step == 200
    assert summary.end_rss == 500 * mb and summary.verdict == "FLAT"
    old_logs = [{key: value for key, value in record.items() if key != "rss_high_water"} for record in records]
    assert summarize(old_logs).peak_rss == 500 * mb


# ----- full garbage collections ------------------------------------------------------------------------------
@pytest.fixture
def full_collections(monkeypatch) -> list[int]:
    """Count the full garbage collections (gc.collect() with no generation, or generation 2)."""
    import gc

    calls: list[int] = []
    collect = gc.collect

    def counting(generation: int = 2) -> int:
        if generation == 2:
            calls.append(1)
        return collect(generation)

    monkeypatch.setattr(gc, "collect", counting)
    return calls


def test_the_step_loop_makes_no_full_collection_on_a_gpu_until_python_objects_grow(tmp_path, full_collections):
    log = MemoryLogger(tmp_path, RUN, 0, 1, budget_bytes=64 * 1024 * MB)
    monitor = MemoryMonitor(log, MemoryWatchdog(64 * 1024 * MB), on_gpu=True, cleanup_steps=10, memory_log_steps=50)
    monitor.start(0, 0)
    for step in range(1, 201):  # 16 cleanups and 4 records
        monitor.after_step(0, step)
    assert full_collections == []
    # Tracked objects that pile up: the next record collects once. A fifth of what the process tracks already (what
    # earlier tests in this process left counts too), and at least 60,000: over both of the collector's thresholds.
    from lowmem.memory.collector import tracked_objects

    planted = [[n] for n in range(max(60_000, tracked_objects() // 5))]
    for step in range(201, 301):
        monitor.after_step(0, step)
    assert len(full_collections) == 1 and monitor.collector.collections == 1
    objects = {record["step"]: record["python_objects"] for record in read_log(log.path)[0]}
    assert objects[250] - objects[200] > 0.9 * len(planted)  # the record that collected saw the growth
    del planted

    cpu = MemoryMonitor(MemoryLogger(tmp_path, "20260101-120009", 0, 1, budget_bytes=64 * 1024 * MB),
                        MemoryWatchdog(64 * 1024 * MB), on_gpu=False, cleanup_steps=10, memory_log_steps=50)
    full_collections.clear()
    for step in range(1, 101):
        cpu.after_step(0, step)
    assert len(full_collections) == 10  # on the CPU every routine cleanup collects, as it always did


def test_the_set_up_is_frozen_out_of_later_collections():
    import gc

    from lowmem.memory.collector import freeze_set_up_objects, tracked_objects

    before = tracked_objects()
    try:
        frozen = freeze_set_up_objects()
        assert frozen >= before * 0.5 and tracked_objects() < before * 0.1
    finally:
        gc.unfreeze()


# ----- the CUDA cache, the CUDA peak and torch.compile's helper processes ----------------------------------
@pytest.fixture
def empty_cache_calls(monkeypatch) -> list[int]:
    """Count calls of torch.cuda.empty_cache (a no-op here: this machine has no GPU)."""
    import torch

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    return calls


def test_routine_cleanups_keep_the_cuda_cache_and_the_watchdog_empties_it(tmp_path, empty_cache_calls):
    from lowmem.memory import forced_cleanup, release_cuda_cache

    cleanup_memory(on_gpu=True)
    assert empty_cache_calls == []  # it frees no host RAM, synchronizes, and the next step allocates again
    forced_cleanup(on_gpu=True)
    release_cuda_cache(on_gpu=False)
    assert len(empty_cache_calls) == 1

    empty_cache_calls.clear()
    log = MemoryLogger(tmp_path, RUN, 0, 1, budget_bytes=64 * 1024 * MB)
    quiet = MemoryMonitor(log, MemoryWatchdog(64 * 1024 * MB), on_gpu=True, cleanup_steps=50, memory_log_steps=100)
    quiet.start(0, 0)
    for step in range(1, 201):
        quiet.after_step(0, step)
    quiet.end(0, 200)
    assert empty_cache_calls == []  # 2 cleanups, 2 records and the end, the watchdog never over its limit

    log = MemoryLogger(tmp_path, "20260101-120001", 0, 1, budget_bytes=10 * MB)
    firing = MemoryMonitor(log, MemoryWatchdog(10 * MB, repeat_every=10), on_gpu=True, cleanup_steps=50,
                           memory_log_steps=0)
    for step in range(1, 101):
        firing.after_step(0, step)
    assert len(empty_cache_calls) == 1  # fired at step 50; at step 100 it is quiet (rate limit)
    watchdog = MemoryWatchdog(10 * MB)
    assert watchdog.check(take_snapshot(include_uss=False), on_gpu=True) is not None  # its default cleanup
    assert len(empty_cache_calls) == 2


def test_each_record_has_the_cuda_peak_of_its_interval(tmp_path, monkeypatch):
    gpu = {"allocated": 300 * MB, "peak": 900 * MB, "resets": 0}

    def reset_peak_memory_stats():
        gpu["peak"], gpu["resets"] = gpu["allocated"], gpu["resets"] + 1

    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                 memory_allocated=lambda: gpu["allocated"], memory_reserved=lambda: 1024 * MB,
                                 max_memory_allocated=lambda: gpu["peak"],
                                 reset_peak_memory_stats=reset_peak_memory_stats)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    with MemoryLogger(tmp_path, RUN, 0, 1, budget_bytes=4096 * MB) as log:
        log.log(take_snapshot(include_children=False, include_uss=False), epoch=0, step=200)
        gpu["peak"] = 500 * MB  # the steps after the first record went up to 500 MB
        log.log(take_snapshot(include_children=False, include_uss=False), epoch=0, step=400)
        log.log(snapshot(800 * MB), epoch=0, step=600)  # no CUDA figures: nothing to reset
    assert gpu["resets"] == 2
    records, _ = read_log(log.path)
    assert [r["cuda_peak"] for r in records] == [900 * MB, 500 * MB, None]
    assert summarize(records).peak_gpu == 900 * MB  # memlog's peak column: still the highest of all


def test_each_phase_shows_its_peak_against_the_plan_and_stays_out_of_the_trend(tmp_path):
    """The phase records' peaks become memlog's table by phase (the highest of each, against the plan's figure);
    their snapshots, taken at phase ends, do not count in the FLAT/GROWING trend."""
    regular = [record(step, 500 + (0.1 if step % 200 else 0)) for step in range(0, 2001, 100)]
    phases = [record(step, 9000, event="phase", phase=phase, phase_high_water=int(peak * MB),
                     phase_planned=int(planned * MB))
              for step, phase, peak, planned in ((0, "load", 1102, 1077), (0, "validation", 2500, 2600),
                                                 (1000, "validation", 2700, 2600), (2000, "save", 900, 1000))]
    write_log(tmp_path, 0, sorted(regular + phases, key=lambda item: item["step"]))
    summary = summarize(read_log(tmp_path / f"memory_{RUN}_rank0.jsonl")[0])
    assert summary.verdict == "FLAT", "a phase record's RSS (9,000 MB here) is not part of the trend"
    assert summary.phases == {"load": [1102 * MB, 1077 * MB], "validation": [2700 * MB, 2600 * MB],
                              "save": [900 * MB, 1000 * MB]}
    table = memlog_command(str(tmp_path / f"memory_{RUN}_rank0.jsonl"))
    assert re.search(r"rank +load +validation +save\n +0 +1,102 MB \(\+2%\) +2,700 MB \(\+4%\) +900 MB \(-10%\)", table)
