"""Memory during training: per-rank memory logs, memlog's verdicts, the watchdog, rank 0's settings everywhere."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from training_helpers import rank_matches, run_command, three_cpu_processes, tiny_overrides, write_chat_rows

# The tests that read what memory a process reached (memlog's verdicts, the watchdog) run their commands in processes
# of their own; the others check what the commands write.
OWN_MEMORY = pytest.mark.own_process


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    return write_chat_rows(folder / "train.parquet", 900, seed=1), write_chat_rows(folder / "valid.parquet", 60, seed=2)


def memlog_json(folder) -> dict:
    done = run_command(["memlog", "--json"], cwd=folder)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _verdicts(report: dict) -> dict[int, dict]:
    return {rank["rank"]: rank for rank in report["ranks"]}


def test_three_processes_write_one_memory_log_each_and_use_rank_0s_settings(tmp_path, chat_data):
    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate launcher is not on PATH")
    done = run_command(
        ["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=30", "--memory_log_steps=10"], cwd=tmp_path,
        # Rank 0 sees 8 GB (below the 15 GB threshold), the others 32 GB: all must follow rank 0.
        env={"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "LOWMEM_MEMORY_BUDGET_GB": "8,32,32"},
        launcher=three_cpu_processes(tmp_path / "ranks"),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    logs = sorted((tmp_path / "logs").glob("memory_*_rank*.jsonl"))
    assert [re.search(r"rank(\d)", p.name).group(1) for p in logs] == ["0", "1", "2"]
    assert len({p.name.split("_rank")[0] for p in logs}) == 1, "one run id for all ranks"
    # Each rank's line is read from its own stderr file: three processes writing to one pipe can interleave.
    settings_lines = rank_matches(tmp_path / "ranks", r"\[rank (\d)\] Memory settings \(decided by rank 0\): memory "
                                                      r"budget 8\.0 GiB.*ultra_low_mem=True \(auto\)")
    assert sorted(settings_lines) == ["0", "1", "2"]
    report = memlog_json(tmp_path)
    assert sorted(_verdicts(report)) == [0, 1, 2]
    plot = tmp_path / "memory.png"
    plotted = run_command(["memlog", f"--plot={plot}"], cwd=tmp_path)
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@OWN_MEMORY
@pytest.mark.parametrize("leak_mb", [1, 0])
def test_planted_leak_is_growing_and_a_clean_run_is_flat(tmp_path, chat_data, leak_mb):
    done = run_command(["train", *tiny_overrides(tmp_path, *chat_data), "--epochs=3", "--memory_log_steps=10",
                        "--cleanup_steps=5", "--logging_steps=50"], cwd=tmp_path,
                       env={"LOWMEM_TEST_LEAK_MB_PER_STEP": str(leak_mb)})
    assert done.returncode == 0, done.stderr[-3000:]
    [rank] = memlog_json(tmp_path)["ranks"]
    if leak_mb:
        assert rank["verdict"] == "GROWING"
        assert rank["slope_mb_per_1k_steps"] == pytest.approx(1000 * 1.048576, rel=0.2)  # 1 MiB per step
    else:
        assert rank["verdict"] == "FLAT", rank


@OWN_MEMORY
def test_watchdog_fires_on_a_small_budget_and_names_the_settings(tmp_path, chat_data):
    # Memory savers off: with them on, a plan this far over the budget stops the run before it starts
    # (tests/integration/test_memory_fit.py); the watchdog is for the runs that go ahead anyway.
    done = run_command(["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=20", "--cleanup_steps=5",
                        "--memory_budget_gb=0.1", "--memory_savers=off"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    warning = [line for line in done.stderr.splitlines() if "WARNING" in line and "--batch_size_per_gpu" in line]
    assert warning, done.stderr[-3000:]
    assert "--dataloader_buffer_size" in warning[0] and "--max_seq_len" in warning[0]
    records = [json.loads(line) for line in next((tmp_path / "logs").glob("memory_*.jsonl")).read_text().splitlines()]
    assert any(record["event"] == "watchdog" for record in records)


def test_memlog_on_a_path_without_logs_says_so_in_one_line(tmp_path):
    done = run_command(["memlog", str(tmp_path / "nothing-here")], cwd=tmp_path)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
