"""Each rank's random states in a checkpoint: only the current GPU's CUDA state is saved, and checkpoints that
hold one state per visible GPU (the older format) still load. CUDA is simulated on the CPU."""

from __future__ import annotations

import base64
import logging
import random

import numpy as np
import pytest
import torch

from lowmem.train.state import RngState


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as a process on device 1 of several would see it: its generator's state, and what is set."""
    calls: dict[str, list] = {"set": []}
    current = torch.tensor([1, 1, 1], dtype=torch.uint8)

    def get_rng_state(device="cuda"):
        return current.clone()

    def get_rng_state_all():
        raise AssertionError("every visible GPU's state was read")

    def set_rng_state(state, device="cuda"):
        calls["set"].append(state)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", get_rng_state_all)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", get_rng_state_all)
    return calls


def test_cpu_states_round_trip():
    states = RngState().state_dict()
    expected = (random.random(), np.random.rand(), torch.rand(1))
    RngState().load_state_dict(states)
    again = (random.random(), np.random.rand(), torch.rand(1))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])
    if not torch.cuda.is_available():
        assert "cuda" not in states


def test_only_the_current_devices_cuda_state_is_saved_and_loaded(fake_cuda):
    states = RngState().state_dict()
    assert isinstance(states["cuda"], str) and base64.b64decode(states["cuda"]) == bytes([1, 1, 1])  # one state
    RngState().load_state_dict(states)
    assert [state.tolist() for state in fake_cuda["set"]] == [[1, 1, 1]]


def test_a_checkpoint_with_every_gpus_state_loads_the_current_devices(fake_cuda, caplog):
    states = RngState().state_dict()
    states["cuda"] = [torch.tensor([0], dtype=torch.uint8), torch.tensor([10], dtype=torch.uint8),
                      torch.tensor([20], dtype=torch.uint8)]  # the older format: one state per GPU seen then
    RngState().load_state_dict(states)
    assert [state.tolist() for state in fake_cuda["set"]] == [[10]]  # device 1's

    states["cuda"] = states["cuda"][:1]  # saved where only one GPU was visible: none for device 1
    with caplog.at_level(logging.WARNING, logger="lowmem.train.state"):
        RngState().load_state_dict(states)
    assert len(fake_cuda["set"]) == 1
    assert "not restored" in caplog.text
