"""torch.compile over batches shaped to fit: pairs of answers change width and pair count from batch to batch, and
the compiled model must not compile a graph for each (after torch's limit of 8 it would run eager, silently, and
compile stalls would land at different steps on different ranks). Graphs and graph breaks are counted with
Dynamo's compile counter; the backend is "eager" (Dynamo's graphs are what is counted, not inductor's kernels)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from lowmem.adapters import LoRASpec, add_adapters, adapters_off
from lowmem.config import TrainConfig
from lowmem.distributed.performance import maybe_compile, speed_settings
from lowmem.model import GPT, GPTConfig
from lowmem.model.loss import IGNORE_INDEX, chunk_spans

VOCAB = 64
CHUNK_TOKENS = 512
# Six widths (multiples of 32, as the collate rounds them) and, once, a pair left out: 192 to 1,152 positions, one
# to three chunks of 512.
BATCHES = [(3, 32), (3, 64), (3, 96), (2, 128), (3, 160), (3, 192)]


def _batch(pairs: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, targets, the reference's log-probabilities as float32 bits, pair weights) of 2P sequences whose
    answers are their last three quarters."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2 * pairs, width), generator=generator)
    targets = input_ids.roll(-1, dims=1)
    targets[:, : width // 4] = IGNORE_INDEX
    reference = -torch.rand(2 * pairs, generator=generator) * width
    return input_ids, targets, reference.view(torch.int32), torch.ones(pairs)


def _compiled_dpo_model(lora: bool) -> tuple[GPT, torch.nn.Module, CompileCounterWithBackend]:
    """A tiny model (with adapters when `lora`) compiled as a DPO run compiles it, with a graph counter."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=256, n_layer=2, n_head=2, n_embd=16, architecture="llama"))
    if lora:
        add_adapters(model, LoRASpec(rank=4, alpha=8.0))
    model.use_memory_savers(CHUNK_TOKENS, False)
    config = TrainConfig(objective="dpo", compile=True)
    speed = speed_settings(config, "cpu")
    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = maybe_compile(model, dataclasses.replace(config, compile_backend=counter), speed=speed)
    return model, compiled, counter


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def test_the_loss_chunks_are_counted_in_powers_of_two_and_cover_every_position_once():
    for size in (1, 5, 511, 512, 513, 1152, 3000):
        spans = chunk_spans(size, CHUNK_TOKENS)
        covered = [position for span in spans for position in range(size)[span]]
        assert covered == list(range(size))
        assert max(span.stop - span.start for span in spans) <= CHUNK_TOKENS
        assert len(spans) & (len(spans) - 1) == 0  # a power of two
    assert [len(chunk_spans(size, CHUNK_TOKENS)) for size in (192, 512, 513, 1024, 1025, 1152)] == [1, 1, 2, 2, 4, 4]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "adapters"])
def test_dpo_under_compile_takes_six_batch_widths_in_three_graphs_without_a_break(lora):
    """The policy's DPO pass (with its backward) and the reference's pass with the adapters off: each at most three
    graphs over six widths and a pair count that changes, no graph break, and the eager model's values."""
    model, compiled, counter = _compiled_dpo_model(lora)
    for seed, (pairs, width) in enumerate(BATCHES):
        input_ids, targets, reference_bits, weights = _batch(pairs, width, seed)
        sums, surrogate = compiled(input_ids, targets, reference_logps=reference_bits, dpo_beta=0.1,
                                   pair_weights=weights)
        surrogate.backward()
        eager_sums, _ = model(input_ids, targets, reference_logps=reference_bits, dpo_beta=0.1, pair_weights=weights)
        torch.testing.assert_close(sums, eager_sums, atol=1e-5, rtol=1e-5)
    policy_graphs = counter.frame_count
    assert _graph_breaks() == 0, dict(counters["graph_break"])
    assert policy_graphs <= 3, f"{policy_graphs} graphs for {len(BATCHES)} batch shapes of the policy"

    model.eval()
    with torch.no_grad(), adapters_off(model):
        for seed, (pairs, width) in enumerate(BATCHES):
            input_ids, targets, _, _ = _batch(pairs, width, seed)
            logps, _ = compiled(input_ids, targets, answer_logps=True)
            torch.testing.assert_close(logps, model(input_ids, targets, answer_logps=True)[0])
    reference_graphs = counter.frame_count - policy_graphs
    assert _graph_breaks() == 0, dict(counters["graph_break"])
    assert reference_graphs <= 3, f"{reference_graphs} graphs for {len(BATCHES)} batch shapes of the reference"


def test_batches_shaped_to_fit_compile_for_dynamic_shapes_and_fixed_shapes_for_themselves():
    assert speed_settings(TrainConfig(objective="dpo", compile=True), "cpu").dynamic is True
    assert speed_settings(TrainConfig(compile=True, static_shapes=True), "cpu").dynamic is False
    assert speed_settings(TrainConfig(compile=True), "cpu").dynamic is None
