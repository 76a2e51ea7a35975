"""Training curves (`--report_to=tensorboard`): the tags, their steps and values against the training log, the
folder a resumed run continues in, and the error when TensorBoard is not installed."""

from __future__ import annotations

import math
import re
import sys

import pytest
from training_helpers import run_command, tiny_overrides, write_chat_rows

from lowmem.config import TrainConfig, apply_overrides
from lowmem.errors import ConfigError
from lowmem.train.log import LineFigures
from lowmem.train.tracking import EVAL_TAGS, LINE_TAGS, TAGS, Tracking, run_name, tensorboard_dir, tracker_arguments

pytest.importorskip("tensorboard")

LOG_LINE = re.compile(r"step (\d+)/\d+ \| epoch \d+ \| loss ([\d.]+) \|")
VALIDATION_LINE = re.compile(r"Validation at step (\d+): loss [\d.]+, perplexity [\d.]+ \([^)]*\)(, BLEU-4)?")


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in `folder` (not its subfolders): tag → [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_a_tiny_run_writes_every_curve_at_the_steps_and_values_of_its_log(tmp_path):
    data = write_chat_rows(tmp_path / "train.parquet", 300, seed=1), write_chat_rows(tmp_path / "valid.parquet", 30, seed=2)
    done = run_command(["train", *tiny_overrides(tmp_path, *data), "--max_steps=10", "--logging_steps=5",
                        "--eval_steps=5", "--report_to=tensorboard", f"--validation_sources={data[1]}"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]

    folder = tmp_path / tensorboard_dir(tmp_path / "run")
    assert folder == tmp_path / "logs" / "tensorboard" / "run"
    scalars = read_scalars(folder)
    assert set(TAGS) <= set(scalars), sorted(scalars)

    logged = {int(step): float(loss) for step, loss in LOG_LINE.findall(done.stderr)}
    assert sorted(logged) == [5, 10], done.stderr[-3000:]
    for tag in LINE_TAGS:
        assert [step for step, _ in scalars[tag]] == [5, 10], tag
    for step, loss in scalars["train/loss"]:
        assert loss == pytest.approx(logged[step], abs=1e-4), "the curve's loss is the log line's"

    validations = [(int(step), bool(bleu)) for step, bleu in VALIDATION_LINE.findall(done.stderr)]
    # Step 10 is due and the last: validated once, not again by the end of training.
    assert [step for step, _ in validations] == [0, 5, 10], validations
    for tag in ("eval/val_loss", "eval/perplexity"):
        assert [step for step, _ in scalars[tag]] == [step for step, _ in validations], tag
    assert [step for step, _ in scalars["eval/bleu4"]] == [step for step, bleu in validations if bleu], \
        "BLEU-4 where it was scored (not at step 0)"
    for tag in TAGS:
        assert all(math.isfinite(value) for _, value in scalars[tag]), tag
    assert scalars["eval/val_loss"][-1][1] < scalars["eval/val_loss"][0][1]
    # The loss on each of --validation_sources: here the validation file itself, so the same values.
    assert [(step, pytest.approx(value, abs=1e-4)) for step, value in scalars["eval/val_loss/valid"]] == \
        scalars["eval/val_loss"]
    assert all(value > 0 for _, value in scalars["memory/rss_mb"])
    # One process: the largest rank and the sum over ranks are its own RSS.
    assert scalars["memory/rss_max_mb"] == scalars["memory/rss_mb"] == scalars["memory/rss_sum_mb"]


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
    with pytest.raises(ConfigError, match=re.escape('pip install "lowmem[tensorboard]"')):
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
