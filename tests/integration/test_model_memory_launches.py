"""The model side of memory, measured in fresh processes: the chunked loss lowers a process's peak, and FSDP
with 3 processes peaks lower per process than DDP.

Each case is `bench_train` under `accelerate launch` in processes of its own (lowmem.bench.memory_bench); the
high-water RSS is VmHWM, read by each process at its end, so no case sees another's peak (nor the pytest
process's: a child's `ru_maxrss` starts at its parent's high-water, VmHWM at zero).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from statistics import mean

import pytest

from lowmem.bench.memory_bench import DDP, FSDP, MemoryCase, run_case


# A mid-size model whose weights, gradients and AdamW state (17 M parameters: 270 MB in float32) and
# logits (a few thousand tokens × 8,064: 100 MB and more per float32 copy) both weigh against the ~400 MB of
# the interpreter, torch and the data pipeline. Every case checkpoints its activations (MemoryCase's last
# field), so that they do not hide the other two levers, and returns freed tensors to the system (a fixed
# mmap threshold), so that a high-water mark is what a step needed, not what glibc's heap kept. Two steps:
# AdamW's moments, the largest share of the state, exist from the first step's update on.
MID_SIZE = ["--n_layer=4", "--n_embd=512", "--n_head=8", "--vocab_size=8000", "--max_seq_len=192",
            "--steps=1", "--skip_steps=1", "--pipeline=False", "--malloc_mmap_threshold_mb=1"]
# The state is what differs: small batches, quicker steps. Measured alone: 4 rows, DDP 730-748 MB and FSDP 655-658 MB
# a process; 16 rows, 773-776 and 690-691 (the same 85 MB between the means), in 105 CPU-seconds instead of 80.
STRATEGY_BATCH = "--batch_size_per_gpu=4"


LOSS_STEPS = """
import sys, torch
from lowmem.memory.cleanup import set_malloc_mmap_threshold
from lowmem.memory.probe import own_high_water
from lowmem.model import GPT, GPTConfig
set_malloc_mmap_threshold(1)
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=8000, max_seq_len=192, n_layer=4, n_head=8, n_embd=512))
model.use_memory_savers(loss_chunk_tokens=int(sys.argv[1]), checkpoint_activations=True)
tokens = torch.randint(0, 8000, (22, 192))  # 4,224 tokens: (4,224 x 8,064) float32 logits are 136 MB
_, loss = model(tokens, tokens)  # a forward and backward pass: where the loss's tensors peak
loss.backward()
print(own_high_water() / 2**20)
"""


def loss_high_water(chunk_tokens: int) -> float:
    """The high-water RSS in MB of a forward and backward pass of the mid-size model in a fresh process."""
    # A clean environment with one thread: nothing another test left in os.environ changes the kernels' buffers.
    env = {name: os.environ[name] for name in ("PATH", "HOME", "TMPDIR", "VIRTUAL_ENV") if name in os.environ}
    done = subprocess.run([sys.executable, "-c", LOSS_STEPS, str(chunk_tokens)], capture_output=True, text=True,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.split()[-1])


@pytest.mark.over_a_minute("three launches of three processes each, measured for their peaks: as given, FSDP, the "
                           "chunked loss")
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

    def high_water(case: MemoryCase, processes: int, batch: str) -> list[float]:
        result = run_case(case, processes=processes, bench_args=[*args, batch], env=env)
        assert result.high_water_mb is not None, f"{case.label} failed:\n{result.failure}"
        return result.high_water_mb

    # The loss: whole logits against chunks of 1,024 tokens, each in a fresh process (measured 842 vs 642 MB).
    plain, chunked = (loss_high_water(chunk) for chunk in (0, 1024))
    # The plain loss holds about three (tokens, vocabulary) float32 tensors at once (136 MB each here); the
    # chunked one a 1,024-token chunk's (33 MB). Inside the whole suite the gap once read 75 MB, not 200.
    assert chunked < plain - 50, (plain, chunked)

    # The strategy: 3 processes each. DDP keeps the whole 270 MB of weights, gradients and optimizer state
    # in every process; FSDP a third of it.
    ddp, fsdp = (high_water(MemoryCase(strategy, 1024, True), 3, STRATEGY_BATCH) for strategy in (DDP, FSDP))
    assert mean(fsdp) < mean(ddp) - 60, (ddp, fsdp)
    assert max(fsdp) < min(ddp), (ddp, fsdp)

KEEP_HEAP_PINNED = """
import sys, psutil, torch
from lowmem.memory.cleanup import set_malloc_mmap_threshold
print(set_malloc_mmap_threshold(float(sys.argv[1])))
rss = lambda: psutil.Process().memory_info().rss
first = torch.ones(1 << 20)  # 4 MiB, mapped; freeing it raises glibc's threshold to its size
del first
before = rss()
blocks = [torch.ones(1 << 20) for _ in range(50)]  # 200 MiB of activation-sized tensors
del blocks[:-1]  # all freed but the newest, which sits on top of the heap
print((rss() - before) / 2**20)
"""


@pytest.mark.parametrize("threshold_mb, held_at_most, held_at_least", [(0, None, 150), (1, 30, None)])
def test_a_fixed_mmap_threshold_returns_freed_tensors_to_the_system(threshold_mb, held_at_most, held_at_least):
    done = subprocess.run([sys.executable, "-c", KEEP_HEAP_PINNED, str(threshold_mb)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    was_set, held_mb = done.stdout.split()
    if threshold_mb and was_set != "True":
        pytest.skip("no glibc mallopt in this C library")
    if held_at_least is not None:  # glibc's default: the freed tensors stay in the process, behind the last one
        assert float(held_mb) >= held_at_least, held_mb
    if held_at_most is not None:  # each tensor had its own mapping: gone with it
        assert float(held_mb) <= held_at_most, held_mb
