"""`--bf16_on_cpu=True` through the training command: a run trains, validates and saves under bf16 autocast on
the CPU, and a run killed after a save resumes with the same losses (to 1e-6: a resume on the same machine
replays the same operations in the same order). BF16_RTOL, the tolerance against float32, is explained in
tests/tolerances.py."""

from __future__ import annotations

import pytest
from tolerances import BF16_RTOL
from training_helpers import (assert_losses_match, kill_all, resume_chat_data, resumed_from, start_run,
                              traced_losses, traced_run, wait_for_step)

SHORT = ("--epochs=1", "--max_steps=30", "--save_steps=10")  # 30 steps, a save every 10
BF16 = ("--bf16_on_cpu=True", *SHORT)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return resume_chat_data(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory, chat_data):
    done, trace = traced_run(tmp_path_factory.mktemp("bf16-reference"), chat_data, extra=BF16)
    return done, traced_losses(trace)


def test_a_bf16_run_on_the_cpu_trains_validates_and_saves(tmp_path, chat_data, bf16_reference):
    done, losses = bf16_reference
    assert "mixed precision: bf16" in done.stderr
    assert "Validation at step" in done.stderr and "Sample" in done.stderr
    float32_done, float32_trace = traced_run(tmp_path, chat_data, extra=SHORT)
    assert "mixed precision: no" in float32_done.stderr
    float32_losses = traced_losses(float32_trace)
    assert losses.keys() == float32_losses.keys()
    assert losses != float32_losses, "bf16 autocast must have changed the losses"
    assert losses[1] == pytest.approx(float32_losses[1], rel=BF16_RTOL)  # the same model, the same first batch


def test_a_bf16_run_killed_after_a_save_resumes_with_the_same_losses(tmp_path, chat_data, bf16_reference):
    _, reference_losses = bf16_reference
    process = start_run(tmp_path, chat_data, env={"LOWMEM_TEST_STEP_SECONDS": "0.03"}, extra=BF16)
    wait_for_step(process, 15)
    kill_all(process)
    resumed, trace = traced_run(tmp_path, chat_data, extra=[*BF16, "--is_keep_training=True"])
    assert "mixed precision: bf16" in resumed.stderr
    start = resumed_from(resumed.stderr)
    assert start in (10, 20)  # the save before the kill (20 if the kill landed after it)
    assert_losses_match(traced_losses(trace), reference_losses, start)
