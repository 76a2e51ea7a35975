"""Training on one text column (--text_column) through the commands: a run trains, evaluates, generates and
resumes exactly, and the training log says which tokens are in the loss. The data and the tokenizer are those
of tests/unit/test_text_column.py (tests/data_helpers.py)."""

from __future__ import annotations

import json
from pathlib import Path

from data_helpers import EVERY_TOKEN_LINE
from data_helpers import text_data as text_data, text_tokenizer as text_tokenizer  # fixtures
from training_helpers import (assert_losses_match, resume_overrides, resumed_from, run_command, tiny_overrides,
                              traced_losses, traced_run, write_chat_rows)


# ----- the train command ----------------------------------------------------------------------------------------
def _text_flags(tokenizer_dir: Path) -> tuple[str, ...]:
    return ("--text_column=text", f"--tokenizer_dir={tokenizer_dir}", "--max_steps=12", "--logging_steps=1")


def test_train_on_a_text_column_and_resume_exactly(tmp_path, text_data, text_tokenizer):
    flags = _text_flags(text_tokenizer)
    (tmp_path / "reference").mkdir()
    reference, reference_trace = traced_run(tmp_path / "reference", text_data, extra=flags)
    assert EVERY_TOKEN_LINE in reference.stderr
    assert "chosen by validation loss" in reference.stderr and "BLEU-4 " not in reference.stderr
    assert "Sample\n  prompt:" in reference.stderr and "Model saved to" in reference.stderr
    # evaluate and generate, not told of the text column, score and prompt the model as it was trained.
    run_flags = [flag for flag in resume_overrides(tmp_path / "reference", text_data)
                 if flag.startswith(("--output_dir", "--tokenizer_dir", "--test_file"))]
    evaluated = run_command(["evaluate", *run_flags, f"--tokenizer_dir={text_tokenizer}"], cwd=tmp_path / "reference")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "--text_column=text" in evaluated.stderr and "--loss_on_response_only=False" in evaluated.stderr
    summary = json.loads((tmp_path / "reference" / "run" / "eval" / "test_summary.json").read_text())
    assert summary["loss_tokens"] == "loss on every token (one text column)" and summary["bleu4"] is None
    generated = run_command(["generate", *run_flags, f"--tokenizer_dir={text_tokenizer}", "--prompt=春风",
                             "--max_new_tokens=4"], cwd=tmp_path / "reference")
    assert generated.returncode == 0 and generated.stdout.strip(), generated.stderr[-3000:]

    folder = tmp_path / "stopped"
    folder.mkdir()
    first = run_command(["train", *resume_overrides(folder, text_data, *flags)], cwd=folder,
                        env={"LOWMEM_STOP_AFTER_STEP": "5"})
    assert first.returncode == 0, first.stderr[-3000:]
    saved = json.loads((folder / "run" / "checkpoint-5" / "trainer_state.json").read_text())
    assert saved["config"]["text_column"] == "text" and saved["config"]["loss_on_response_only"] is False
    resumed, trace = traced_run(folder, text_data, extra=(*flags, "--is_keep_training=True"))
    assert resumed_from(resumed.stderr) == 5
    assert_losses_match(traced_losses(trace), traced_losses(reference_trace), 5)


def test_the_training_log_says_which_tokens_are_in_the_loss(tmp_path):
    data = (write_chat_rows(tmp_path / "train.parquet", 200, seed=1),
            write_chat_rows(tmp_path / "valid.parquet", 20, seed=2))
    common = [*tiny_overrides(tmp_path, *data), "--max_steps=2", "--eval_bleu_samples=0"]
    default = run_command(["train", *common], cwd=tmp_path)
    assert default.returncode == 0, default.stderr[-3000:]
    assert ("loss on the response tokens only (prompt/response pairs; --loss_on_response_only=False trains on "
            "every token)") in default.stderr
    every = run_command(["train", *common, "--loss_on_response_only=False", "--overwrite=True"], cwd=tmp_path)
    assert every.returncode == 0, every.stderr[-3000:]
    assert "loss on every token, prompt and response (--loss_on_response_only=False)" in every.stderr
    refused = run_command(["train", *common, "--text_column=prompt", "--loss_on_response_only=True"], cwd=tmp_path)
    assert refused.returncode == 2 and "have no prompt" in refused.stderr, refused.stderr[-3000:]
