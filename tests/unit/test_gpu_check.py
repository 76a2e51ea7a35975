"""`lowmem gpu_check` in-process: a stage that fails is reported with its reason and the next stages still run,
a fault of the check itself is one more FAIL, and the bench table is read into figures, lowmem's step against the
plain PyTorch loop's on the verdict line (the commands: tests/integration/test_gpu_check_command.py)."""

from __future__ import annotations

import io
import sys

from run_outputs import check_results

from lowmem.gpucheck import check, stages
from lowmem.gpucheck.check import run_check
from lowmem.gpucheck.runs import Finished, StageFailed
from lowmem.gpucheck.stages import CheckSettings, parse_bench_table


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
    assert [(record["stage"], record["verdict"], record["reason"][:8]) for record in check_results(tmp_path)] == [
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


BENCH_TABLE = ("bench_train: 0.1 M parameters, 1 process(es) on cuda (NVIDIA H100 80GB HBM3), ...\n"
               "| phase | tokens/s | vs ceiling | data wait | peak RSS per process MB | peak GPU MB | MFU |\n"
               "|---|---:|---:|---:|---:|---:|---:|\n"
               "| data pipeline alone | 90,000 | 12.00 | - | 400 | - | - |\n"
               "| (a) batches in memory (ceiling) | 7,500 | 1.00 | 0.00% | 800 | 1,200 | 31.0% |\n"
               "| (b) real pipeline | 7,400 | 0.99 | 0.50% | 820 | 1,200 | 30.6% |\n"
               "| (t) the training loop (Trainer.fit) | 7,200 | 0.96 | - | 830 | 1,200 | 29.8% |\n"
               "| (r) plain PyTorch loop (reference) | 8,000 | 1.07 | 0.00% | 850 | 2,400 | 33.0% |\n"
               "\nlowmem's step / plain loop: (a)/(r) = 0.94 (same batches, same model, same attention)\n"
               "the training loop / plain loop: (t)/(r) = 0.90 (what the users' command pays, ...)\n"
               "(b)/(a) = 0.987; RSS the data pipeline adds per process: 20 MB; process high-water RSS: 900 MB "
               "(sum 900 MB)")


def test_the_plain_loop_row_and_ratio_are_read_into_figures():
    figures = parse_bench_table(BENCH_TABLE)
    assert figures["ratio_to_plain_loop"] == 0.94 and figures["loop_ratio_to_plain_loop"] == 0.90
    assert (figures["mfu_ceiling"], figures["mfu_plain_loop"]) == ("31.0%", "33.0%")
    reference = figures["phases"]["(r) plain PyTorch loop (reference)"]
    assert reference["tokens_per_s"] == "8,000" and reference["peak_gpu_mb"] == "2,400"
    assert set(figures["phases"]) == {"data pipeline alone", "(a) batches in memory (ceiling)", "(b) real pipeline",
                                      "(t) the training loop (Trainer.fit)", "(r) plain PyTorch loop (reference)"}
    assert "900 MB" in figures["memory"]


def test_a_table_without_the_plain_loop_has_no_ratio():
    figures = parse_bench_table(BENCH_TABLE.replace("(a)/(r) = 0.94", "").replace(
        "| (r) plain PyTorch loop (reference) | 8,000 | 1.07 | 0.00% | 850 | 2,400 | 33.0% |\n", ""))
    assert figures["ratio_to_plain_loop"] is None and figures["mfu_plain_loop"] is None
    assert figures["mfu_ceiling"] == "31.0%"


def test_the_parser_reads_what_bench_train_prints():
    from lowmem.bench.train_bench import PhaseResult, format_table

    def phase(name, tokens):
        return PhaseResult(name, 3, 1.0, tokens, peak_rss=800_000_000)

    rank = {"data": phase("data", 90_000), "data_rss": 20_000_000, "ceiling": phase("ceiling", 7_500),
            "pipeline": phase("pipeline", 7_400), "reference": phase("reference", 8_000), "reference_ran": True,
            "high_water": 900_000_000, "predicted": None}
    figures = parse_bench_table(format_table([rank], flops_per_token=6_000_000_000, peak_tflops=100.0))
    assert figures["ratio_to_plain_loop"] == 0.94
    assert (figures["mfu_ceiling"], figures["mfu_plain_loop"]) == ("45.0%", "48.0%")


def test_the_bench_verdict_line_shows_the_ratio_and_mfu_of_each_case(tmp_path, monkeypatch):
    monkeypatch.setattr(stages, "run", lambda command, cwd, env, deadline: Finished(0, BENCH_TABLE, "", {}))
    settings = CheckSettings(device="cpu", folder=tmp_path / "check", gpus=0)
    [result] = run_check(settings, tmp_path / "check" / "results.jsonl", ["bench"], io.StringIO())
    assert result.verdict == "PASS", result.reason
    line = result.line(1, 1)
    for case in ("eager", "compiled"):
        assert f"{case}_ratio_to_plain_loop=0.94 {case}_mfu=(a) 31.0%, (r) 33.0% {case}_loop_ratio_to_plain_loop=0.9" \
            in line
    [record] = check_results(tmp_path)
    assert record["figures"]["compiled"]["ratio_to_plain_loop"] == 0.94
    assert record["figures"]["eager"]["phases"]["(r) plain PyTorch loop (reference)"]["mfu"] == "33.0%"


def test_the_bench_stage_fails_when_the_plain_loop_did_not_run(tmp_path, monkeypatch):
    without = BENCH_TABLE.replace(
        "lowmem's step / plain loop: (a)/(r) = 0.94 (same batches, same model, same attention)",
        "(r) plain PyTorch loop: out of GPU memory on rank(s) 0")
    monkeypatch.setattr(stages, "run", lambda command, cwd, env, deadline: Finished(0, without, "", {}))
    settings = CheckSettings(device="cpu", folder=tmp_path / "check", gpus=0)
    [result] = run_check(settings, tmp_path / "check" / "results.jsonl", ["bench"], io.StringIO())
    assert result.verdict == "FAIL" and "printed no (a)/(r) line" in result.reason


# Two log lines of the users' command as an H200 printed them: the MFU with its second reading in brackets.
SPEED_LOG = "\n".join([
    "2026-11-30 18:08:40 INFO [rank 0] GPU micro-batches: one micro-batch of 64 rows per step instead of 32 x 2 (fits)",
    "2026-11-30 18:08:40 INFO [rank 0] Batch shapes: 23 x 192, 26 x 192, or 64 x 192 for a micro-batch that needs "
    "more (sequences x tokens), fixed for the run",
    "2026-11-30 18:09:05 INFO [rank 0] step 100/600 | epoch 0 | loss 8.5115 | lr 9.77e-06 | grad_norm 3.338 | "
    "tokens/s 251,399 | mfu 16.9% (17.2% with attention over max_seq_len) | gpu peak 5,861 MB | rss 1744 MB "
    "(max over ranks 1744 MB)",
    "2026-11-30 18:09:18 INFO [rank 0] step 600/600 | epoch 1 | loss 7.1724 | lr 5.86e-05 | grad_norm 2.742 | "
    "tokens/s 205,511 | mfu 13.8% (14.1% with attention over max_seq_len) | gpu peak 6,701 MB | rss 1742 MB "
    "(max over ranks 1742 MB)",
    "2026-11-30 18:09:20 INFO [rank 0] step 650/700 | epoch 1 | loss 7.1 | lr 5.86e-05 | grad_norm 2.742 | "
    "tokens/s 200,000 | mfu 13.0% | gpu peak 6,000 MB | rss 1742 MB (max over ranks 1742 MB)"])


def test_the_speed_stage_reads_the_mfu_and_gpu_peak_of_each_log_line(tmp_path, monkeypatch):
    """The users' command's log lines: the MFU with or without its reading over max_seq_len in brackets, and the
    GPU's peak after it (it read None on an H200 while the brackets were there)."""
    outputs = iter([Finished(0, "", SPEED_LOG, {}), Finished(0, "| causal (the floor) | 1.00 | 1.00 |", "", {})])
    monkeypatch.setattr(stages, "run", lambda command, cwd, env, deadline: next(outputs))
    settings = CheckSettings(device="cpu", folder=tmp_path / "check", gpus=0)
    [result] = run_check(settings, tmp_path / "check" / "results.jsonl", ["speed"], io.StringIO())
    assert result.verdict == "PASS", result.reason
    [record] = check_results(tmp_path)
    figures = record["figures"]
    assert figures["users_command_gpu_peak_mb"] == 6_701
    assert figures["users_command_mfu"] == 0.138  # the median of 13.8% and 13.0%, after the first line
    assert figures["users_command_tokens_per_s"] == 205_511
    assert figures["users_command_micro_batches"].startswith("GPU micro-batches: one micro-batch of 64 rows")


def test_a_failed_launch_is_quoted_with_the_exception_its_rank_raised():
    """Under `accelerate launch` the launcher's report of the failed child fills the end of stderr: the FAIL line
    leads with what the rank raised (on an H200 it said only "exitcode: 1")."""
    from lowmem.gpucheck.runs import failure_summary

    stderr = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/x/gpt.py", line 411, in <lambda>',
        "[rank0]: RuntimeError: expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16",
        "Traceback (most recent call last):",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 4599)", "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "============================================================"])
    summary = failure_summary(stderr)
    assert summary.startswith("RuntimeError: expected m1 and m2 to have the same dtype"), summary
    assert summary.endswith("============================================================")
    assert failure_summary("one\ntwo") == "one | two", "without an exception, the end as it was"
