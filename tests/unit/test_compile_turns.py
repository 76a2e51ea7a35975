"""The ranks of one machine compile in turn (lowmem/distributed/compile_turns.py): one lock per run and machine, taken
around inductor's compilation of each forward and backward graph; a single rank compiles with plain inductor. Three
real ranks compiling through it: tests/integration/test_cuda_mirror.py."""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from lowmem.distributed import compile_turns
from lowmem.distributed.compile_turns import inductor_backend, machine_turn, turn_lock_path

RUN = {"LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "a"}


def test_the_ranks_of_a_run_share_one_lock_and_another_run_or_a_single_rank_has_none_of_it():
    assert turn_lock_path(RUN) == turn_lock_path(dict(RUN))
    assert turn_lock_path({**RUN, "MASTER_PORT": "29501"}) != turn_lock_path(RUN)
    assert turn_lock_path({**RUN, "TORCHELASTIC_RUN_ID": "b"}) != turn_lock_path(RUN)
    assert turn_lock_path({**RUN, "LOCAL_WORLD_SIZE": "1"}) is None
    assert turn_lock_path({}) is None


def _hold(lock_path: str, started, seconds: float) -> None:
    with machine_turn(Path(lock_path)):
        started.set()
        time.sleep(seconds)


def test_a_rank_waits_for_the_turn_another_process_holds(tmp_path):
    lock_path = tmp_path / "turn.lock"
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    holder = context.Process(target=_hold, args=(str(lock_path), started, 1.5))
    holder.start()
    assert started.wait(60)
    began = time.monotonic()
    with machine_turn(lock_path):
        waited = time.monotonic() - began
    holder.join(30)
    assert waited > 0.5, waited  # it got the turn only once the holder let go


def test_inductor_compiles_each_graph_inside_the_turn_and_computes_what_eager_does(monkeypatch, tmp_path):
    turns: list[Path] = []

    @contextlib.contextmanager
    def counted_turn(lock_path: Path):
        turns.append(lock_path)
        yield

    monkeypatch.setattr(compile_turns, "machine_turn", counted_turn)
    monkeypatch.setattr(compile_turns, "turn_lock_path", lambda environ=None: tmp_path / "turn.lock")
    backend = inductor_backend(None, False)
    assert backend != "inductor"
    torch._dynamo.reset()
    layer = torch.nn.Linear(4, 3)
    inputs = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(layer, backend=backend, dynamic=False)
    # Compiled here, not found in inductor's or AOTAutograd's cache (which an earlier test or run may have filled).
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        (compiled(inputs) ** 2).sum().backward()
    compiled_grad = layer.weight.grad.clone()
    layer.weight.grad = None
    (layer(inputs) ** 2).sum().backward()
    torch._dynamo.reset()
    assert turns == [tmp_path / "turn.lock"] * 2  # the forward graph and the backward graph, each in its turn
    torch.testing.assert_close(compiled_grad, layer.weight.grad)


def test_one_rank_on_the_machine_compiles_with_plain_inductor(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert inductor_backend("max-autotune", None) == "inductor"


@pytest.mark.parametrize("mode", [None, "max-autotune-no-cudagraphs"])
def test_the_mode_reaches_the_backend_as_torch_applies_it(monkeypatch, mode):
    for name, value in RUN.items():
        monkeypatch.setenv(name, value)
    backend = inductor_backend(mode, None)
    assert backend.config == torch._TorchCompileInductorWrapper(mode, None, None).config
