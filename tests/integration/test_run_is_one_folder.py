"""A run is one folder: its training log, memory logs and tokenizer record live under output_dir (the launch
folder's logs/ still has the day's log and links to the memory logs); `memlog RUN_FOLDER` joins a resumed
run's segments; `--resume_from_checkpoint` continues from an older checkpoint, setting the newer aside; and a
resume with another tokenizer than the checkpoint's is refused."""

from __future__ import annotations

import json

from training_helpers import resume_chat_data, run_command, tiny_overrides

from lowmem.cli import main
from lowmem.memory.report import memlog_command


def test_a_run_is_one_folder_resumes_from_a_chosen_checkpoint_and_keeps_its_tokenizer(tmp_path):
    chat_data = resume_chat_data(tmp_path)
    base = ["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=10", "--save_steps=5",
            "--memory_log_steps=2", "--eval_bleu_samples=0"]
    first = run_command(base, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "run"
    first_ten = (run / "checkpoint-10" / "trainer_state.json").read_text()

    again = run_command([*base, f"--resume_from_checkpoint={run / 'checkpoint-5'}"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resumed from" in again.stderr and "checkpoint-5" in again.stderr
    [aside] = run.glob("superseded-*")
    assert (aside / "checkpoint-10" / "trainer_state.json").read_text() == first_ten, "nothing lost"
    assert (run / "checkpoint-10").is_dir()

    # One folder: the run's own training log holds both segments; memory logs and the tokenizer record are here.
    run_log = (run / "logs" / "train.log").read_text()
    assert run_log.count("Training: ") == 2 and "Resumed from" in run_log
    memory_logs = sorted((run / "logs").glob("memory_*_rank0.jsonl"))
    assert len(memory_logs) == 2
    links = sorted((tmp_path / "logs").glob("memory_*_rank0.jsonl"))
    assert [link.resolve() for link in links] == [log.resolve() for log in memory_logs]
    assert list((tmp_path / "logs").glob("chat_trainer_low_mem_*.log")), "the day's log is still written"
    record = json.loads((run / "tokenizer.json").read_text())
    assert record["tokenizer_dir"] == str(tmp_path / "tok") and record["trained_on"]["files"]
    saved = json.loads(first_ten)["tokenizer"]
    assert saved["sha256"] == record["sha256"] and saved["pieces"] == record["pieces"]

    # memlog takes the run folder and joins the two segments, the redone steps once.
    table = memlog_command(str(run))
    assert "2 segments joined" in table and " 0-10 " in table
    summary = json.loads(memlog_command(str(run), json_output=True))
    [rank0] = summary["ranks"]
    assert rank0["first_step"] == 0 and rank0["last_step"] == 10

    # Another tokenizer: the resume is refused, and the run's record is left as it was.
    assert main(["tokenizer", f"--train_file={chat_data[1]}", f"--tokenizer_dir={tmp_path / 'tok2'}",
                 "--vocab_size=330"]) == 0
    before = sorted(path.name for path in run.iterdir())
    refused = run_command([*base, "--max_steps=12", "--is_keep_training=True", f"--tokenizer_dir={tmp_path / 'tok2'}",
                           "--allow_config_change=True"], cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert ("was trained with the tokenizer" in refused.stderr
            and f"--tokenizer_dir={tmp_path / 'tok'}" in refused.stderr)
    assert sorted(path.name for path in run.iterdir()) == before
    assert json.loads((run / "tokenizer.json").read_text()) == record


def test_a_resume_from_a_named_checkpoint_settles_from_it_not_from_the_newest(tmp_path):
    # checkpoint-5 was saved with the loss on the responses only (the default for prompt/response rows); the
    # newest, checkpoint-10, by a resume that changed it. A resume from checkpoint-5 that does not name the
    # setting takes checkpoint-5's and continues exactly.
    chat_data = resume_chat_data(tmp_path)
    base = ["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=10", "--save_steps=5",
            "--eval_bleu_samples=0"]
    run = tmp_path / "run"
    assert run_command(base, cwd=tmp_path).returncode == 0
    changed = run_command([*base, f"--resume_from_checkpoint={run / 'checkpoint-5'}", "--allow_config_change=True",
                           "--loss_on_response_only=False"], cwd=tmp_path)
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert json.loads((run / "checkpoint-10" / "trainer_state.json").read_text())["config"][
        "loss_on_response_only"] is False

    again = run_command([*base, f"--resume_from_checkpoint={run / 'checkpoint-5'}"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "loss on the response tokens only" in again.stderr.split("Resumed from")[0]
    assert json.loads((run / "checkpoint-10" / "trainer_state.json").read_text())["config"][
        "loss_on_response_only"] is True
