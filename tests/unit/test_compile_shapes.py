"""torch.compile over batches shaped to fit: pairs of answers change width and pair count from batch to batch, and
the compiled model must not compile a graph for each (after torch's limit of 8 it would run eager, silently, and
compile stalls would land at different steps on different ranks). Graphs and graph breaks are counted with
Dynamo's compile counter; the backend is "eager" (Dynamo's graphs are what is counted, not inductor's kernels)."""

from __future__ import annotations

import pytest
import torch

from lowmem.config import TrainConfig
from lowmem.distributed.performance import speed_settings
from lowmem.gpucheck.paths import DPO_CHUNK_TOKENS as CHUNK_TOKENS
from lowmem.gpucheck.paths import dpo_compile_counts
from lowmem.model.loss import chunk_spans


def test_the_loss_chunks_are_counted_in_powers_of_two_and_cover_every_position_once():
    for size in (1, 5, 511, 512, 513, 1152, 3000):
        spans = chunk_spans(size, CHUNK_TOKENS)
        covered = [position for span in spans for position in range(size)[span]]
        assert covered == list(range(size))
        assert max(span.stop - span.start for span in spans) <= CHUNK_TOKENS
        assert len(spans) & (len(spans) - 1) == 0  # a power of two
    assert [len(chunk_spans(size, CHUNK_TOKENS)) for size in (192, 512, 513, 1024, 1025, 1152)] == [1, 1, 2, 2, 4, 4]


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "adapters"])
def test_dpo_under_compile_takes_six_batch_widths_in_three_graphs_without_a_break(adapters):
    """The policy's DPO pass (with its backward) and the reference's pass with the adapters off, compiled as a DPO
    run compiles them: each at most three graphs over six widths and a pair count that changes, no graph break, and
    the eager model's values (gpu_check's dpo_compile stage runs the same on a GPU)."""
    counts = dpo_compile_counts(torch.device("cpu"), "eager", adapters)
    assert counts["graph_breaks"] == 0, counts
    assert counts["policy_graphs"] <= 3 and counts["reference_graphs"] <= 3, counts
    assert counts["largest_difference"] <= 1e-5, counts


def test_batches_shaped_to_fit_compile_for_dynamic_shapes_and_fixed_shapes_for_themselves():
    assert speed_settings(TrainConfig(objective="dpo", compile=True), "cpu").dynamic is True
    assert speed_settings(TrainConfig(compile=True, static_shapes=True), "cpu").dynamic is False
    assert speed_settings(TrainConfig(compile=True), "cpu").dynamic is None


def test_dynamic_shapes_trace_each_graph_once_with_the_models_floats_as_constants():
    """Under `dynamic=True` dynamo makes every float it reads a symbol; the rotary base's `theta ** exponents` cannot
    become tensor arithmetic, and dynamo would trace the whole graph a second time with the float fixed. The run's
    compile makes the model's floats constants at once: one trace, no restart. The backend is "aot_eager": AOT
    autograd's pass over the graph is where the float is found."""
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    from lowmem.distributed.performance import maybe_compile
    from lowmem.model import GPT, GPTConfig

    config = TrainConfig(objective="dpo", compile=True, compile_backend="aot_eager")
    speed = speed_settings(config, "cpu")
    assert speed.dynamic is True
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, max_seq_len=16, n_layer=1, n_head=2, n_embd=16, architecture="llama"))
    torch._dynamo.reset()
    clear_compilation_metrics()
    compiled = maybe_compile(model, config, speed=speed)
    idx = torch.randint(0, 50, (2, 12))
    _, loss = compiled(idx, idx)
    loss.backward()
    metrics = get_compilation_metrics()
    torch._dynamo.reset()  # what the compile keeps would weigh on the later tests' counts of Python objects
    clear_compilation_metrics()
    assert metrics and all(not entry.restart_reasons for entry in metrics), [entry.restart_reasons for entry in metrics]
