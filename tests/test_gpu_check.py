"""`lowmem gpu_check` tested where there is no GPU: `--device=cpu` runs every stage, reduced; a stage that
fails is reported with its reason and the next stages still run; `lowmem gpu_bundle` builds wheels that
install without network over the machine's own packages and run the check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from lowmem.gpucheck import check, stages
from lowmem.gpucheck.check import run_check
from lowmem.gpucheck.runs import StageFailed
from lowmem.gpucheck.stages import CheckSettings, parse_bench_table

STAGE_NAMES = ["environment", "train", "bench", "parallel", "memory_log"]


def gpu_check(folder: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowmem", "gpu_check", "--device=cpu", f"--folder={folder / 'check'}",
                           *flags], cwd=folder, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, **(env or {})})


def results(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "check" / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_every_stage_passes_on_the_cpu(tmp_path):
    done = gpu_check(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("gpu_check [")]
    assert [line.split("] ", 1)[1].split(":")[0] for line in lines] == STAGE_NAMES
    assert all(": PASS (" in line for line in lines), lines
    by_stage = {record["stage"]: record for record in results(tmp_path)}
    assert all(record["verdict"] == "PASS" and record["device"] == "cpu" for record in by_stage.values())
    train = by_stage["train"]["figures"]
    assert train["precision"] == "bf16" and train["resumed_from"] == 50 and train["killed_at_step"] == 51
    assert train["largest_relative_difference"] <= 1e-6
    bench = by_stage["bench"]["figures"]
    assert {"eager", "compiled"} <= bench.keys() and "(a) batches in memory (ceiling)" in bench["eager"]["phases"]
    parallel = by_stage["parallel"]["figures"]
    assert parallel["ddp"]["resumed_from"] == 3 and "DDP" in parallel["ddp"]["strategy"]
    assert parallel["fsdp"]["resumed_from"] == 3 and "FSDP2" in parallel["fsdp"]["strategy"]
    assert parallel["deepspeed"].startswith("skipped: ")
    assert by_stage["memory_log"]["figures"]["rank0"]["verdict"] == "FLAT"
    assert by_stage["environment"]["figures"]["torch"]


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


def test_unknown_stages_and_foreign_folders_are_refused_in_one_line(tmp_path):
    done = gpu_check(tmp_path, "--stages=train,warp")
    assert done.returncode == 2 and "Unknown stage warp" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "check").mkdir()
    (tmp_path / "check" / "notes.txt").write_text("mine")
    done = gpu_check(tmp_path, "--stages=environment")
    assert done.returncode == 2 and "not a gpu_check's" in done.stderr
    assert (tmp_path / "check" / "notes.txt").read_text() == "mine"


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


@pytest.mark.slow
def test_the_bundle_installs_without_network_over_the_machine_packages_and_runs(tmp_path):
    built = subprocess.run([sys.executable, "-m", "lowmem", "gpu_bundle", f"--out={tmp_path / 'bundle'}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheels = sorted(path.name.split("-")[0] for path in (tmp_path / "bundle").glob("*.whl"))
    assert wheels == ["fire", "lowmem", "termcolor"]
    assert sum(path.stat().st_size for path in (tmp_path / "bundle").iterdir()) < 30e6  # it has to be carried

    # A fresh environment that sees this one's packages (torch, pyarrow, ...) as a GPU machine sees its image's.
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=300)
    python = fresh / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "machine_image.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run(["bash", str(tmp_path / "bundle" / "install_and_check.sh"), "--device=cpu",
                           "--stages=environment", f"--folder={tmp_path / 'check'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": str(python), "PIP_NO_INDEX": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "environment: PASS" in done.stdout
    where = subprocess.run([python, "-c", "import fire, lowmem; print(lowmem.__file__); print(fire.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert all(path.startswith(str(fresh)) for path in where), where  # the bundle's copies, not this machine's
    helped = subprocess.run([fresh / "bin" / "lowmem", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert helped.returncode == 0 and "gpu_check" in helped.stdout + helped.stderr
