"""Training curves (`--report_to=tensorboard`) in-process: the folder a resumed run continues in, two runs
whose folders share a last name, and the error when TensorBoard is not installed (a whole run:
tests/integration/test_tracking_run.py)."""

from __future__ import annotations

import re
import sys

import pytest
from run_outputs import read_scalars

from lowmem.config import TrainConfig, apply_overrides
from lowmem.errors import ConfigError
from lowmem.train.log import LineFigures
from lowmem.train.tracking import EVAL_TAGS, LINE_TAGS, Tracking, run_name, tensorboard_dir, tracker_arguments

pytest.importorskip("tensorboard")


def test_a_resumed_run_continues_the_curve_in_the_same_folder(tmp_path, monkeypatch):
    """What a crash after step 15 and a resume from checkpoint-10 log: one curve, 15 as the resumed run has it."""
    from lowmem.distributed.accelerator import create_accelerator

    monkeypatch.chdir(tmp_path)  # logs/ is relative to the working directory
    config = apply_overrides(TrainConfig(), {"output_dir": str(tmp_path / "model_save" / "demo"),
                                             "report_to": "tensorboard"})
    accelerator = create_accelerator(1, bf16=False, process_group_timeout_minutes=1,
                                     **tracker_arguments(config.report_to))

    def figures(loss: float) -> LineFigures:
        return LineFigures(loss=loss, learning_rate=1e-3, grad_norm=1.0, tokens_per_s=100.0, rss_mb=300.0,
                           rss_max_mb=300.0, rss_sum_mb=300.0)

    tracking = Tracking(accelerator, config)
    for start, steps, resumed in ((0, (5, 10, 15), False), (10, (15, 20), True)):
        tracking.start(start, resumed=resumed)
        for step in steps:
            tracking.log_line(step, figures(float(step) + (0.5 if resumed else 0.0)))
        tracking.end()

    scalars = read_scalars(tmp_path / "logs" / "tensorboard" / "demo")
    assert scalars["train/loss"] == [(5, 5.0), (10, 10.0), (15, 15.5), (20, 20.5)]
    assert set(scalars) == set(LINE_TAGS) and not set(scalars) & set(EVAL_TAGS)


def test_a_missing_package_is_a_config_error_that_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: find_spec answers None
    with pytest.raises(ConfigError, match=re.escape('pip install "tensorboard>=2.14"')):
        tracker_arguments("tensorboard")
    assert tracker_arguments("none") == {}
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="pip install wandb"):
        tracker_arguments("wandb")


def test_two_runs_whose_folders_share_a_last_name_get_two_tensorboard_runs(tmp_path):
    logs = tmp_path / "logs"
    first, second = tmp_path / "exp1" / "model", tmp_path / "exp2" / "model"
    assert run_name(first, logs, claim=True) == "model"
    other = run_name(second, logs, claim=True)
    assert other.startswith("model-") and other != "model"
    assert run_name(first, logs) == "model" and run_name(second, logs, claim=True) == other  # stable on resume
    assert tensorboard_dir(second, logs) == logs / "tensorboard" / other
