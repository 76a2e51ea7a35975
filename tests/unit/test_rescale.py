"""Resuming on another number of processes, in-process: the stretched schedule is continuous and ends at the
new total, and the log line says how to keep the global batch (the runs:
tests/integration/test_rescale_training.py)."""

from __future__ import annotations

import pytest

from lowmem.config import TrainConfig
from lowmem.train.resume import accumulation_to_keep, rescale_line
from lowmem.train.schedule import get_lr, stretched_step


def test_the_stretched_schedule_is_continuous_and_ends_at_the_new_total():
    # Saved at step 40 of 100; the rest now takes 90 steps instead of 60.
    lr = [get_lr(stretched_step(step, 40, 40.0, 100, 130), 1e-3, 10, 100) for step in range(40, 131)]
    assert lr[0] == get_lr(40, 1e-3, 10, 100)
    assert lr == sorted(lr, reverse=True)
    assert lr[-1] == pytest.approx(1e-4)
    # A second change stretches from where the first left it.
    at_70 = stretched_step(70, 40, 40.0, 100, 130)
    assert stretched_step(70, 70, at_70, 100, 90) == pytest.approx(at_70)
    assert stretched_step(90, 70, at_70, 100, 90) == pytest.approx(100)


def test_the_log_line_says_how_to_keep_the_global_batch():
    saved = {"world_size": 3, "workers_per_rank": 1,
             "config": {"batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}}
    config = TrainConfig(batch_size_per_gpu=8, gradient_accumulation_steps=2)
    line = rescale_line(saved, config, {"world_size": 2, "workers_per_rank": 2}, 500, 40)
    assert "2 process(es) × 2 reader(s) where the run had 3 × 1" in line
    assert "now 32 rows per optimizer step (it was 48)" in line and "--gradient_accumulation_steps=3" in line
    assert accumulation_to_keep(48, 5, 8) is None
    assert "no whole --gradient_accumulation_steps keeps 48" in rescale_line(
        saved, config, {"world_size": 5, "workers_per_rank": 1}, 100, 10)
    same = rescale_line(saved, TrainConfig(batch_size_per_gpu=8, gradient_accumulation_steps=3),
                        {"world_size": 2, "workers_per_rank": 1}, 100, 10)
    assert "stays 48 rows" in same
