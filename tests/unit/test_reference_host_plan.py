"""The largest models the reference host trains, by `lowmem plan` (three 20 GB GPUs, 12 GB of RAM, FSDP2): adapters
on a model of Qwen2.5-7B's shapes and a full fine-tune of Qwen2.5-1.5B's fit, with nothing gathered whole for
validation, saving or export. The sources are weights files of holes: the plan reads their headers only."""

from __future__ import annotations

import re

import pytest
from hf_models import QWEN25_7B, QWEN25_15B, sparse_qwen2_folder

from lowmem.cli import main
from lowmem.units import MB

REFERENCE_HOST = ["--device=cuda", "--gpu_memory_gb=20", "--num_processes=3", "--memory_budget_gb=12",
                  "--strategy=fsdp"]
INTERPRETER_MB = 540  # a fresh `lowmem plan` process's RSS at start, measured: this test process holds more


@pytest.fixture
def plan_output(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("lowmem.train.memory_fit.measure_base_bytes", lambda: INTERPRETER_MB * MB)

    def plan(*flags: str) -> str:
        assert main(["plan", *REFERENCE_HOST, *flags]) == 0, capsys.readouterr().err[-3000:]
        return capsys.readouterr().out
    return plan


def figure(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, text
    return int(match.group(1).replace(",", ""))


def test_adapters_on_a_seven_billion_model_fit_the_reference_host(tmp_path, plan_output):
    source = sparse_qwen2_folder(tmp_path / "qwen2.5-7b-shapes", QWEN25_7B)
    out = plan_output(f"--init_from={source}", "--lora_rank=16")
    assert "7,615.6 M parameters frozen" in out
    assert figure(r"GPU peak: ([\d,]+) MB", out) <= 18_432
    assert figure(r"this machine: ([\d,]+) MB", out) <= 11_059 and ": fits" in out
    # Nothing whole: no replica, no save-time copy, the base in bf16 (2 B a parameter, in its shards).
    assert "replica" not in out and "save-time copy" not in out
    assert re.search(r"model weights +[\d,]+ +resident +\(2 B x 7,615.6 M frozen", out), out
    assert re.search(r"The largest llama of these proportions this host trains .*adapters of rank 16 on "
                     r"([\d.]+) B", out)
    largest = float(re.search(r"adapters of rank 16 on ([\d.]+) B", out).group(1))
    assert largest >= 7.6, "the 7B model fits, so the largest of its proportions is at least as large"


def test_a_full_fine_tune_of_one_and_a_half_billion_fits_the_reference_host(tmp_path, plan_output):
    source = sparse_qwen2_folder(tmp_path / "qwen2.5-1.5b-shapes", QWEN25_15B)
    out = plan_output(f"--init_from={source}")
    assert figure(r"GPU peak: ([\d,]+) MB", out) <= 20_480 * 0.9
    assert ": fits" in out and "replica" not in out
    full = float(re.search(r"full fine-tune ([\d.]+) B", out).group(1))
    assert full >= 1.5, out
