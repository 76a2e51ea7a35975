"""Adapters never plan more memory than a full fine-tune of the same model and batch: on the CPU and on the reference
host's GPUs, with and without activation checkpointing (the adapters' dropout recomputed with their block). The
sources are weights files of holes: the plan reads their headers only."""

from __future__ import annotations

import re

import pytest
from hf_models import QWEN25_05B, QWEN25_15B, sparse_qwen2_folder
from training_helpers import write_chat_rows

from lowmem.cli import main
from lowmem.units import MB

INTERPRETER_MB = 540  # a fresh `lowmem plan` process's RSS at start, measured: this test process holds more
SMALL = dict(QWEN25_05B, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             vocab_size=32000)
SAME_BATCH = ["--memory_savers=off", "--batch_size_per_gpu=8", "--gradient_accumulation_steps=1",
              "--max_seq_len=512"]
HOSTS = {"cpu": ["--num_processes=1"],
         "reference host": ["--device=cuda", "--gpu_memory_gb=20", "--num_processes=3", "--memory_budget_gb=12"]}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    return {name: sparse_qwen2_folder(folder / name, sizes)
            for name, sizes in (("small", SMALL), ("0.5b", QWEN25_05B), ("1.5b", QWEN25_15B))}


def peak(capsys, *flags: str) -> int:
    """The plan's peak: each GPU's on a GPU host, else this machine's."""
    assert main(["plan", *flags]) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    match = re.search(r"GPU peak: ([\d,]+) MB", out) or re.search(r"this machine: ([\d,]+) MB", out)
    assert match, out
    return int(match.group(1).replace(",", ""))


@pytest.mark.parametrize("host", list(HOSTS))
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("shape", ["small", "0.5b", "1.5b"])
def test_adapters_plan_no_more_than_a_full_fine_tune(sources, tmp_path, monkeypatch, capsys, host, checkpointing,
                                                     shape):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("lowmem.train.memory_fit.measure_base_bytes", lambda: INTERPRETER_MB * MB)
    (tmp_path / "data").mkdir()
    for name, seed in (("train", 1), ("valid", 2), ("test", 3)):
        write_chat_rows(tmp_path / "data" / f"{name}.parquet", 40, seed=seed)
    flags = [f"--init_from={sources[shape]}", *SAME_BATCH, *HOSTS[host],
             f"--activation_checkpointing={checkpointing}"]
    full = peak(capsys, *flags)
    adapters = peak(capsys, *flags, "--lora_rank=16")
    assert adapters <= full, (adapters, full)
    if checkpointing:  # dropout's copies are recomputed with their block: one block's, not every block's
        with_dropout = peak(capsys, *flags, "--lora_rank=16", "--lora_dropout=0.05")
        assert with_dropout <= full, (with_dropout, full)
