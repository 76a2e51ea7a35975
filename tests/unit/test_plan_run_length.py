"""`plan` says how long the run will be before it starts: its optimizer steps per epoch and in all, and the warmup,
as `train` with the same flags then counts them."""

from __future__ import annotations

import re

import pytest
from training_helpers import commands_run_in, tiny_overrides, write_chat_rows

from lowmem.cli import main

PLANNED = re.compile(r"Run length: about (\d+) optimizer steps per epoch \((\d+) rows per process, \d+ per step\), "
                     r"(\d+) in all over (\d+) epoch")
TRAINED = re.compile(r"Training: (\d+) rows per process per epoch, (\d+) optimizer steps per epoch, (\d+) steps in all")


@pytest.mark.parametrize("extra", [["--epochs=2"], ["--epochs=2", "--max_steps=20", "--warmup_steps=15"]])
def test_the_plans_run_length_is_the_one_train_counts(tmp_path, capsys, extra):
    train = write_chat_rows(tmp_path / "train.parquet", 203, seed=1)
    valid = write_chat_rows(tmp_path / "valid.parquet", 20, seed=2)
    flags = [*tiny_overrides(tmp_path, train, valid), "--eval_bleu_samples=0", "--save_steps=1000", *extra]
    with commands_run_in(tmp_path):
        assert main(["plan", *flags]) == 0
    printed = capsys.readouterr().out
    planned = PLANNED.search(printed)
    assert planned, printed
    with commands_run_in(tmp_path):
        assert main(["train", *flags]) == 0
    logged = capsys.readouterr().err  # training logs on stderr
    trained = TRAINED.search(logged)
    assert trained, logged[-3000:]
    per_epoch, rows, in_all = int(planned.group(1)), int(planned.group(2)), int(planned.group(3))
    assert (rows, per_epoch, in_all) == tuple(int(value) for value in trained.groups())
    if "--max_steps=20" in extra:
        assert in_all == 20 and "cut to --max_steps=20" in printed
        assert "--warmup_steps=15 is 75% of this run's 20 optimizer steps" in printed  # given: kept, and said
    else:
        assert in_all == 2 * per_epoch and "Warmup 2 steps." in printed
