"""`lowmem gpu_check` in-process: a stage that fails is reported with its reason and the next stages still run,
a fault of the check itself is one more FAIL, and the bench table is read into figures (the commands:
tests/integration/test_gpu_check_command.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lowmem.gpucheck import check, stages
from lowmem.gpucheck.check import run_check
from lowmem.gpucheck.runs import StageFailed
from lowmem.gpucheck.stages import CheckSettings, parse_bench_table


def results(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "check" / "results.jsonl").read_text().splitlines()]


def test_a_failed_stage_says_why_and_the_next_stages_still_run(tmp_path, monkeypatch, capsys):
    def failing_train(settings):
        raise StageFailed("the resumed run's loss at step 51 is 6.7 against 6.6 uninterrupted")

    monkeypatch.setitem(stages.STAGES, "train", failing_train)
    monkeypatch.setitem(check.STAGES, "train", failing_train)
    settings = CheckSettings(device="cpu", folder=tmp_path / "check", gpus=0)
    outcome = run_check(settings, tmp_path / "check" / "results.jsonl", ["train", "environment"], sys.stdout)
    assert [result.verdict for result in outcome] == ["FAIL", "PASS"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("gpu_check")]
    assert "train: FAIL" in lines[1] and "loss at step 51 is 6.7 against 6.6" in lines[1]
    assert "environment: PASS" in lines[2] and "1 PASS, 1 FAIL, 0 SKIP" in lines[3]
    assert [(record["stage"], record["verdict"], record["reason"][:8]) for record in results(tmp_path)] == [
        ("train", "FAIL", "the resu"), ("environment", "PASS", "")]


def test_a_fault_of_the_check_itself_is_one_more_fail(tmp_path, monkeypatch):
    def broken(settings):
        raise KeyError("no such figure")

    monkeypatch.setitem(stages.STAGES, "bench", broken)
    monkeypatch.setitem(check.STAGES, "bench", broken)
    settings = CheckSettings(device="cpu", folder=tmp_path / "check", gpus=0)
    outcome = run_check(settings, tmp_path / "results.jsonl", ["bench", "environment"], sys.stdout)
    assert [result.verdict for result in outcome] == ["FAIL", "PASS"]
    assert outcome[0].reason.startswith("KeyError: 'no such figure'")


def test_the_bench_table_is_read_into_figures():
    table = ("| phase | tokens/s | vs ceiling | data wait | peak RSS per process MB | peak GPU MB | MFU |\n"
             "|---|---:|---:|---:|---:|---:|---:|\n"
             "| data pipeline alone | 90,000 | 12.00 | - | 400 | - | - |\n"
             "| (a) batches in memory (ceiling) | 7,500 | 1.00 | 0.00% | 800 | 1,200 | 31.0% |\n"
             "\nRSS the data pipeline adds per process: 20 MB; process high-water RSS: 900 MB (sum 900 MB)")
    figures = parse_bench_table(table)
    assert figures["phases"]["(a) batches in memory (ceiling)"]["mfu"] == "31.0%"
    assert figures["phases"]["data pipeline alone"]["tokens_per_s"] == "90,000"
    assert "900 MB" in figures["memory"]
