"""Training curves (`--report_to=tensorboard`) of a tiny training run: every tag at the steps and values of
its training log."""

from __future__ import annotations

import math
import re

import pytest
from run_outputs import read_scalars
from training_helpers import run_command, tiny_overrides, write_chat_rows

from lowmem.train.tracking import LINE_TAGS, TAGS, tensorboard_dir

pytest.importorskip("tensorboard")

LOG_LINE = re.compile(r"step (\d+)/\d+ \| epoch \d+ \| loss ([\d.]+) \|")
VALIDATION_LINE = re.compile(r"Validation at step (\d+): loss [\d.]+, perplexity [\d.]+ \([^)]*\)(, BLEU-4)?")


def test_a_tiny_run_writes_every_curve_at_the_steps_and_values_of_its_log(tmp_path):
    data = (write_chat_rows(tmp_path / "train.parquet", 300, seed=1),
            write_chat_rows(tmp_path / "valid.parquet", 30, seed=2))
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
