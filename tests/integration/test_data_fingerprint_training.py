"""The data's content fingerprint through the training command: a resume on a file generated again stops with
the message (exit code 2) and continues with --allow_config_change=True."""

from __future__ import annotations

from training_helpers import resume_chat_data, resume_overrides, run_command, write_chat_rows


def test_train_resume_on_a_regenerated_file_stops_and_the_flag_continues(tmp_path):
    chat_data = resume_chat_data(tmp_path)
    first = run_command(["train", *resume_overrides(tmp_path, chat_data)], cwd=tmp_path,
                        env={"LOWMEM_STOP_AFTER_STEP": "10"})
    assert first.returncode == 0, first.stderr[-3000:]
    train_file = chat_data[0]
    write_chat_rows(train_file, 900, seed=3)  # the same rows per row group, other text

    refused = run_command(["train", *resume_overrides(tmp_path, chat_data), "--is_keep_training=True"], cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"error: The content of '{train_file}' changed since this data position was saved" in refused.stderr
    assert "--allow_config_change=True" in refused.stderr

    allowed = run_command(["train", *resume_overrides(tmp_path, chat_data, "--max_steps=12"),
                           "--is_keep_training=True", "--allow_config_change=True"], cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "Continuing from the saved position as asked" in allowed.stderr
    assert "checkpoint-10: epoch 0, step 10" in allowed.stderr
