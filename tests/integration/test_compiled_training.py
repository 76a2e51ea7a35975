"""Training compiled with inductor on the CPU, as a GPU run compiles by default: one graph per fixed batch shape,
all compiled before the first step and nothing after, no graph break in the model (the chunked loss included),
and the losses of the eager run to float tolerance.

In-process, so that dynamo's own counters can be read. Inductor generates C++ here, which takes a minute.
"""

from __future__ import annotations

import logging

import pytest
import torch
from fault_injection import TrainingTrace
from torch._dynamo.utils import counters
from trainer_fixtures import chat_data as chat_data, in_tmp as in_tmp, tokenizer_dir as tokenizer_dir  # fixtures
from trainer_fixtures import tiny_config

from lowmem.train.callbacks import Callback
from lowmem.train.trainer import Trainer

STEPS = 6


class GraphCounts(Callback):
    """Dynamo's count of compiled graphs and of graph breaks after each step."""

    def __init__(self) -> None:
        self.graphs: dict[int, int] = {}
        self.breaks: dict[int, int] = {}

    def on_step_end(self, trainer, result) -> None:
        self.graphs[trainer.state.step] = counters["stats"]["unique_graphs"]
        self.breaks[trainer.state.step] = sum(counters["graph_break"].values())


class _StandInPool:
    """A compile-worker pool that records how many steps had run when it was shut down."""

    def __init__(self, graphs: GraphCounts) -> None:
        self.graphs, self.shut_down_after_steps = graphs, None

    def shutdown(self) -> None:
        self.shut_down_after_steps = len(self.graphs.graphs)


@pytest.mark.over_a_minute("inductor compiles the model for each batch shape, then the same steps train eagerly to "
                           "compare")
@pytest.mark.slow
def test_compiled_training_compiles_each_shape_once_and_trains_as_eager(in_tmp, chat_data, tokenizer_dir, caplog):
    # Chunks of 192 tokens: the largest shape's 8 x 64 positions are 4 chunks, so the loss's loop unrolls in the graph
    # (chunks of 48, 16 of them, made 85 kernels to compile instead of 69: 135 s alone instead of 87). One block: the
    # same graphs per shape, fewer kernels in each.
    common = dict(max_steps=STEPS, dropout=0.0, static_shapes=True, loss_chunk_tokens=192, logging_steps=4, n_layer=1)
    eager = TrainingTrace(in_tmp / "eager")
    Trainer(tiny_config(in_tmp / "eager", chat_data, tokenizer_dir, **common), callbacks=[eager]).fit()

    torch._dynamo.reset()
    counters.clear()
    graphs, compiled = GraphCounts(), TrainingTrace(in_tmp / "compiled")
    trainer = Trainer(tiny_config(in_tmp / "compiled", chat_data, tokenizer_dir, compile=True,
                                  compile_backend="inductor", **common), callbacks=[graphs, compiled])
    assert trainer.speed.compile and trainer.fixed_shapes is not None
    shapes = set(trainer.fixed_shapes.sizes)
    # Inductor compiles C++ in the process here; on a GPU host its Triton kernels go to a pool of worker processes.
    # A stand-in pool shows that the pool is shut down once the shapes are compiled, before the first step.
    from torch._inductor import async_compile

    pool = _StandInPool(graphs)
    async_compile._pool_set.add(pool)
    with caplog.at_level(logging.INFO, logger="lowmem.train.trainer"):
        trainer.fit()
    assert pool.shut_down_after_steps == 0 and not async_compile._pool_set
    assert any("worker processes shut down" in record.getMessage() for record in caplog.records)

    # Every shape was compiled before the first step (a graph each, forward and backward), and nothing since.
    assert graphs.graphs[1] == len(shapes), graphs.graphs
    assert set(graphs.graphs.values()) == {len(shapes)}, "a step recompiled"
    assert set(graphs.breaks.values()) == {0}, f"graph breaks: {dict(counters['graph_break'])}"
    # AOT autograd's cache takes each graph (the chunked loss's autograd.Function included): the next rank, or the
    # next run of the same model, loads it instead of tracing it again.
    cached = counters["aot_autograd"]
    assert not cached["autograd_cache_bypass"], dict(cached)
    assert cached["autograd_cache_saved"] + cached["autograd_cache_hit"] == len(shapes), dict(cached)
    assert compiled.rows == eager.rows
    for step, loss in eager.losses.items():
        assert compiled.losses[step] == pytest.approx(loss, rel=1e-4), step
