"""A data error in a DataLoader worker through the train command: exit code 2, one message, no traceback."""

from __future__ import annotations

import pytest
from data_helpers import DAMAGED_GROUP_ROWS as GROUP_ROWS, DAMAGED_ROWS as ROWS, write_bad_text, write_damaged
from training_helpers import run_command, tiny_overrides, write_chat_rows


@pytest.mark.parametrize("kind", ["damaged row group", "text that is not UTF-8"])
def test_the_train_command_reports_a_workers_data_error_in_one_paragraph(tmp_path, kind):
    """Met by the DataLoader worker: the tokenizer was trained before the file changed, and the damaged row group
    (5 of 10) is none of those the run's content fingerprint reads in the training process."""
    train, valid = tmp_path / "train.parquet", write_chat_rows(tmp_path / "valid.parquet", 40, seed=2)
    if kind == "damaged row group":
        write_chat_rows(train, ROWS, seed=3, row_group_rows=GROUP_ROWS)
    else:
        write_bad_text(train, clean=True)
    common = [*tiny_overrides(tmp_path, train, valid), "--max_steps=0", "--eval_bleu_samples=0"]
    assert run_command(["tokenizer", *common], cwd=tmp_path).returncode == 0  # read before the damage
    if kind == "damaged row group":
        write_damaged(train, group=5)
        expected = "Could not read row group 5 of"
    else:
        write_bad_text(train)
        expected = "holds text that is not valid UTF-8"
    done = run_command(["train", *common, "--dataloader_num_workers=1"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "in DataLoader worker process" not in done.stderr  # torch's wrapping
