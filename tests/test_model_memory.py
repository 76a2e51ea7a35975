"""The model side of memory, measured in fresh processes: the chunked loss lowers a process's peak, and FSDP
with 3 processes peaks lower per process than DDP.

Each case is `bench_train` under `accelerate launch` in processes of its own (lowmem.bench.memory_bench); the
high-water RSS is the kernel's `ru_maxrss`, read by each process at its end, so no case sees another's peak.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from statistics import mean

import pytest

from lowmem.bench.memory_bench import DDP, FSDP, MemoryCase, parse_bench_output, run_case

# A mid-size model whose weights, gradients and AdamW state (17 M parameters: 270 MB in float32) and
# logits (16 x 192 tokens x 8,064 = 99 MB per float32 copy) both weigh against the ~330 MB of the
# interpreter and torch.
MID_SIZE = ["--n_layer=4", "--n_embd=512", "--n_head=8", "--vocab_size=8000", "--max_seq_len=192",
            "--batch_size_per_gpu=16", "--steps=1", "--skip_steps=1", "--pipeline=False"]


def test_the_bench_table_is_parsed():
    output = ("| (a) batches in memory (ceiling) | 1,234 | 1.00 | 0.00% | 600 / 610 | - | - |\n\n"
              "RSS the data pipeline adds per process: 20 / 21 MB; process high-water RSS: 1,001 / 999 MB "
              "(sum 2,000 MB)")
    assert parse_bench_output(output) == ([1001.0, 999.0], 1234.0)
    assert parse_bench_output("Traceback ...") is None


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="the accelerate launcher is not on PATH")
def test_fsdp_and_the_chunked_loss_each_lower_the_peak(tmp_path):
    tokenizer_dir = tmp_path / "tok"
    # The tokenizer is trained once, here: a case's rank 0 training it would raise that rank's peak.
    trained = subprocess.run([sys.executable, "-m", "lowmem", "tokenizer", "--vocab_size=8000",
                              f"--tokenizer_dir={tokenizer_dir}"], cwd=tmp_path, capture_output=True, text=True)
    assert trained.returncode == 0, trained.stderr[-3000:]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    args = [*MID_SIZE, f"--tokenizer_dir={tokenizer_dir}"]
    os.chdir(tmp_path)  # the demo data set is found from here, as in the tokenizer run
    measured = {}
    for name, case in {"ddp plain": MemoryCase(DDP, 0, False), "ddp chunked": MemoryCase(DDP, 1024, False),
                       "fsdp chunked": MemoryCase(FSDP, 1024, False)}.items():
        result = run_case(case, processes=3, bench_args=args, env=env)
        assert result.high_water_mb is not None, f"{name} failed:\n{result.failure}"
        measured[name] = result.high_water_mb
    ddp_plain, ddp_chunked, fsdp_chunked = (mean(measured[name]) for name in measured)
    # The plain loss holds about three (tokens, vocabulary) float32 tensors in a step (~300 MB here); the
    # chunked one a 1,024-token chunk's (~33 MB each).
    assert ddp_chunked < ddp_plain - 100, measured
    # DDP keeps the whole 270 MB of weights, gradients and optimizer state in every process; FSDP a third.
    assert fsdp_chunked < ddp_chunked - 60, measured
    assert max(measured["fsdp chunked"]) < min(measured["ddp chunked"]), measured
