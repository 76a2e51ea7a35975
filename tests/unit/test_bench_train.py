"""`bench_train`'s figures in-process: the GPU peaks are looked up by the most specific name first, MFU, the plain
PyTorch loop's step, and the table with its reference row (the command itself:
tests/integration/test_bench_train_command.py)."""

from __future__ import annotations

import pytest
import torch

from lowmem.bench import train_bench
from lowmem.bench.train_bench import PhaseResult, format_table, plain_loop_step
from lowmem.config import TrainConfig
from lowmem.distributed.performance import PEAK_BF16_TFLOPS, mfu, peak_bf16_tflops
from lowmem.model import GPT, IGNORE_INDEX, GPTConfig


def test_gpu_peaks_are_looked_up_most_specific_name_first():
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_bf16_tflops("NVIDIA A10G") == 70.0
    assert peak_bf16_tflops("NVIDIA L40S") == 362.0
    assert peak_bf16_tflops("Some Future GPU") == 0.0
    assert train_bench.peak_bf16_tflops is peak_bf16_tflops  # still importable from the benchmark


@pytest.mark.parametrize("device_name, tflops", [
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA A800-SXM4-80GB", 312.0),
    ("NVIDIA A10", 125.0), ("NVIDIA A30", 165.0), ("NVIDIA A40", 149.7), ("NVIDIA RTX A6000", 154.8),
    ("NVIDIA RTX A5000", 111.1), ("NVIDIA RTX A4500", 94.6),
    ("NVIDIA RTX 6000 Ada Generation", 364.2), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0),
    ("NVIDIA GeForce RTX 4090", 165.2), ("NVIDIA GeForce RTX 4080 SUPER", 104.5), ("NVIDIA GeForce RTX 4080", 97.5),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", 88.2), ("NVIDIA GeForce RTX 4070 Ti", 80.2),
    ("NVIDIA GeForce RTX 4070 SUPER", 71.0), ("NVIDIA GeForce RTX 4070", 58.3), ("NVIDIA GeForce RTX 4060 Ti", 44.1),
    ("NVIDIA GeForce RTX 3090 Ti", 80.0), ("NVIDIA GeForce RTX 3090", 71.0), ("NVIDIA GeForce RTX 3080 Ti", 68.2),
    ("NVIDIA GeForce RTX 3080", 59.5), ("NVIDIA GeForce RTX 3070 Ti", 43.5), ("NVIDIA GeForce RTX 3070", 40.6),
    ("NVIDIA GeForce RTX 3060 Ti", 32.4), ("NVIDIA GeForce RTX 3060", 25.5),
])
def test_each_gpu_gets_its_own_peak_not_a_shorter_names(device_name, tflops):
    assert peak_bf16_tflops(device_name) == tflops


@pytest.mark.parametrize("device_name", [
    "NVIDIA RTX A1000",  # not an A100
    "NVIDIA RTX A4000",  # not an A40
    "NVIDIA RTX A400",
    "NVIDIA GeForce RTX 4090 Laptop GPU",  # a smaller chip than the desktop card
    "Tesla V100-SXM2-16GB", "Tesla T4",  # no bf16 tensor cores
    "NVIDIA GeForce RTX 4060",
])
def test_gpus_without_a_known_peak_get_none(device_name):
    assert peak_bf16_tflops(device_name) == 0.0


def test_every_entry_is_reachable_ahead_of_the_names_it_contains():
    for name, tflops in PEAK_BF16_TFLOPS.items():
        assert peak_bf16_tflops(f"NVIDIA {name}") == tflops, name


def test_mfu_is_the_share_of_the_devices_peak():
    assert mfu(1000.0, 6e9, 100.0) == pytest.approx(0.06)  # 6 TFLOP/s of 100
    assert mfu(1000.0, 6e9, 100.0, devices=2) == pytest.approx(0.03)
    assert mfu(1000.0, 6e9, 0.0) is None  # unknown peak: no MFU


def test_a_plain_loop_step_is_the_mean_over_the_steps_tokens():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, max_seq_len=8, n_layer=1, n_head=2, n_embd=16))
    batches = [{"input_ids": torch.randint(0, 50, (2, 8)), "targets": torch.randint(0, 50, (2, 8))} for _ in range(2)]
    batches[1]["targets"][:, :5] = IGNORE_INDEX  # micro-batches of unequal counted tokens: 16 and 6
    with torch.no_grad():
        sums = [model(batch["input_ids"], batch["targets"])[1] * (batch["targets"] != IGNORE_INDEX).sum()
                for batch in batches]
    before = model.lm_head.weight.detach().clone()
    optimizer = model.configure_optimizer(0.1, 1e-2)
    loss = plain_loop_step(model, optimizer, batches, TrainConfig(grad_clip=1.0), torch.device("cpu"))
    torch.testing.assert_close(loss, sum(sums) / 22)
    assert not torch.equal(model.lm_head.weight, before)  # the step was applied
    assert all(parameter.grad is None for parameter in model.parameters())


def phase(name: str, tokens: int, seconds: float = 1.0) -> PhaseResult:
    return PhaseResult(name, 3, seconds, tokens, peak_rss=800_000_000)


def rank(reference: PhaseResult | None, reference_ran: bool = True, trainer: PhaseResult | None = None) -> dict:
    return {"data": phase("data", 90_000), "data_rss": 20_000_000, "ceiling": phase("ceiling", 7_500),
            "pipeline": phase("pipeline", 7_400), "trainer": trainer, "reference": reference,
            "reference_ran": reference_ran, "high_water": 900_000_000, "predicted": 950_000_000}


def test_the_table_compares_lowmem_with_the_plain_loop():
    table = format_table([rank(phase("reference", 8_000))], flops_per_token=6_000_000, peak_tflops=0.0)
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    assert rows == ["phase", "data pipeline alone", "(a) batches in memory (ceiling)", "(b) real pipeline",
                    "(r) plain PyTorch loop (reference)"]
    assert "| (r) plain PyTorch loop (reference) | 8,000 | 1.07 | 0.00% | 800 | - | - |" in table
    assert "lowmem's step / plain loop: (a)/(r) = 0.94 (same batches, same model, same attention)" in table
    assert "(b)/(a) = 0.987; RSS the data pipeline adds per process: 20 MB" in table
    assert "(t)/(r)" not in table  # no training-loop phase ran


def test_the_table_gives_the_training_loop_against_the_plain_loop_and_mfu_over_real_rows():
    loop = phase("trainer", 7_200)
    loop.attention_pairs = 7_200 * 50  # rows of 50 tokens on average: each token sees 50 keys, not 192
    reference = phase("reference", 8_000)
    reference.attention_pairs = 8_000 * 50
    table = format_table([rank(reference, trainer=loop)], flops_per_token=6_000_000 + 12_000 * 192,
                         peak_tflops=0.1, attention_flops_per_pair=12_000, max_seq_len=192)
    # The loop's MFU counts its rows' own attention: 7,200 x (6 M + 12,000 x 50) / 1e11 = 47.5% (59.8% over 192).
    assert "| (t) the training loop (Trainer.fit) | 7,200 | 0.96 | - | 800 | - | 47.5% |" in table
    assert "the training loop / plain loop: (t)/(r) = 0.90 (what the users' command pays" in table


def test_the_table_says_where_the_plain_loop_ran_out_of_memory_and_shows_no_ratio():
    table = format_table([rank(phase("reference", 8_000)), rank(None)], flops_per_token=6_000_000, peak_tflops=0.0)
    assert "(r) plain PyTorch loop (reference)" not in table and "(a)/(r)" not in table
    assert "(r) plain PyTorch loop: out of GPU memory on rank(s) 1" in table
    skipped = format_table([rank(None, reference_ran=False)], flops_per_token=6_000_000, peak_tflops=0.0)
    assert "plain PyTorch loop" not in skipped and "(a)/(r)" not in skipped


def test_the_table_shows_each_training_phases_mfu_on_a_known_peak():
    table = format_table([rank(phase("reference", 8_000))], flops_per_token=6_000_000_000, peak_tflops=100.0)
    assert "| (a) batches in memory (ceiling) | 7,500 | 1.00 | 0.00% | 800 | - | 45.0% |" in table
    assert "| (r) plain PyTorch loop (reference) | 8,000 | 1.07 | 0.00% | 800 | - | 48.0% |" in table
    assert "| data pipeline alone | 90,000 | 12.00 | - | 800 | - | - |" in table
