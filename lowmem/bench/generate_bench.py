"""The generation benchmark: greedy decoding with and without the key/value cache.

A small random model (the demo's depth and heads at width 128, vocabulary 8000) continues a 32-token prompt
by 256 tokens; each path is timed as the best of a few runs. Random weights are enough: the work per token
does not depend on what the model has learned, and greedy decoding never stops early without an end token.

Run it with `python -m lowmem.bench.generate_bench [NEW_TOKENS] [BATCH]`; it prints one line.
"""

from __future__ import annotations

import os
import platform
import sys
import time

import torch

from lowmem.model import GPT, GPTConfig


def machine_line() -> str:
    """The machine and library versions a timing was taken on, in one line."""
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, Python {platform.python_version()}, torch {torch.__version__}"
    )


def time_generate(model: GPT, prompt: torch.Tensor, new_tokens: int, use_cache: bool, repeats: int) -> float:
    """Best wall-clock seconds of `repeats` greedy generations of `new_tokens` tokens after `prompt` (B, T).

    The best rather than the mean: slower runs measure whatever else the machine was doing.
    """
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new_tokens, greedy=True, use_cache=use_cache)
        best = min(best, time.perf_counter() - start)
    assert out.shape == (prompt.size(0), prompt.size(1) + new_tokens)
    return best


def bench_generate(
    new_tokens: int = 256,
    batch: int = 1,
    prompt_len: int = 32,
    repeats: int = 3,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    vocab_size: int = 8000,
    seed: int = 0,
) -> str:
    """Time greedy generation with and without the key/value cache on a random model.

    Args:
        new_tokens: tokens to generate after the prompt.
        batch: prompts generated together.
        prompt_len: tokens in each (random) prompt.
        repeats: runs per path; the best counts.
        n_layer, n_head, n_embd, vocab_size: the model's sizes. Its context (at least 320) holds the prompt
            and the new tokens, so the cached path never falls back to recomputing a sliding window.
        seed: seeds the weights and the prompt.

    Returns:
        One line, e.g. "generate 256 tokens, batch 1: cached 0.42 s, uncached 2.10 s (5.0x faster) on ...".
    """
    torch.manual_seed(seed)
    config = GPTConfig(
        vocab_size=vocab_size,
        max_seq_len=max(320, prompt_len + new_tokens),
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
    )
    model = GPT(config).eval()
    prompt = torch.randint(0, vocab_size, (batch, prompt_len))  # (B, T)

    # One short run per path first, so one-off costs (allocator growth, kernel selection) are not timed.
    time_generate(model, prompt, min(new_tokens, 8), use_cache=True, repeats=1)
    time_generate(model, prompt, min(new_tokens, 8), use_cache=False, repeats=1)
    cached = time_generate(model, prompt, new_tokens, use_cache=True, repeats=repeats)
    uncached = time_generate(model, prompt, new_tokens, use_cache=False, repeats=repeats)
    return (
        f"generate {new_tokens} tokens, batch {batch}: cached {cached:.2f} s, uncached {uncached:.2f} s "
        f"({uncached / cached:.1f}x faster) on {machine_line()}"
    )


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    print(bench_generate(*args))
