"""Evaluation through the commands: training validates every sample once and keeps the best checkpoint (by
BLEU-4, or by the validation loss without it), `evaluate` scores every test sample exactly once across ranks,
and `generate` answers prompts or says which command to run first."""

from __future__ import annotations

import json
import shutil

import pytest
from training_helpers import run_command, tiny_overrides, write_chat_rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run whose validation (61 rows) and test (67 rows) files are not multiples of batch × ranks."""
    folder = tmp_path_factory.mktemp("trained")
    train = write_chat_rows(folder / "train.parquet", 600, seed=1)
    valid = write_chat_rows(folder / "valid.parquet", 61, seed=2, row_group_rows=10)
    test = write_chat_rows(folder / "test.parquet", 67, seed=3, row_group_rows=10)
    done = run_command(["train", *tiny_overrides(folder, train, valid), f"--test_file={test}", "--max_steps=30",
                        "--eval_bleu_samples=-1", "--save_steps=15", "--keep_latest_n_ckp=1"], cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, train, valid, test, done.stderr


def test_training_validates_every_sample_once_and_keeps_the_best_by_bleu(trained):
    folder, _, _, _, output = trained
    assert "Validation at step 30: loss" in output
    assert "(61 samples)" in output and "BLEU-4" in output
    assert "(61 samples, greedy; nrefs:1" in output
    manifest = json.loads((folder / "run" / "checkpoints.json").read_text())
    assert manifest["metric"] == "bleu4" and manifest["mode"] == "max"
    assert (folder / "run" / "best" / "model.safetensors").is_file()
    assert (folder / "run" / "final" / "tokenizer.model").is_file()


@pytest.mark.parametrize("processes", [1, 3])
def test_evaluate_scores_every_test_sample_exactly_once(trained, tmp_path, processes):
    folder, train, valid, test, _ = trained
    args = ["evaluate", *tiny_overrides(folder, train, valid), f"--test_file={test}", "--batch_size_per_gpu=4"]
    if processes == 1:
        done = run_command(args, cwd=folder)
    else:
        if shutil.which("accelerate") is None:
            pytest.skip("the accelerate launcher is not on PATH")
        done = run_command(args, cwd=folder, env={"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
                           launcher=["accelerate", "launch", "--multi_gpu", "--num_processes", "3",
                                     "--main_process_port", "0"])
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((folder / "run" / "eval" / "test_summary.json").read_text())
    assert summary["samples"] == 67 and summary["bleu_samples"] == 67
    triples = [json.loads(line)
               for line in (folder / "run" / "eval" / "test_generations.jsonl").read_text().splitlines()]
    import pyarrow.parquet as pq

    expected = pq.read_table(test).column("prompt").to_pylist()
    assert [t["prompt"] for t in triples] == expected, "every test prompt once, in file order"
    assert 0 <= summary["bleu4"] <= 100 and summary["baseline_repeat_prompt_bleu4"] >= 0
    assert len(summary["bleu_precisions"]) == 4 and 0 < summary["bleu_brevity_penalty"] <= 1
    references = [t["reference"] for t in triples]
    import sacrebleu

    shifted = sacrebleu.corpus_bleu(references[1:] + references[:1], [references], tokenize="zh")
    assert summary["baseline_other_reference_bleu4"] == pytest.approx(shifted.score)


def test_evaluate_without_bleu_reports_the_loss(trained):
    folder, train, valid, test, _ = trained
    done = run_command(["evaluate", *tiny_overrides(folder, train, valid), f"--test_file={test}", "--bleu_samples=0",
                        f"--output_dir={folder / 'run'}"], cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((folder / "run" / "eval" / "test_summary.json").read_text())
    assert summary["samples"] == 67 and summary["loss"] > 0 and summary["perplexity"] > 1
    assert summary["bleu_samples"] == 0 and summary["bleu4"] is None
    assert (folder / "run" / "eval" / "test_generations.jsonl").read_text() == ""


def test_without_bleu_the_best_checkpoint_is_chosen_by_validation_loss_and_said(tmp_path):
    train = write_chat_rows(tmp_path / "train.parquet", 300, seed=1)
    valid = write_chat_rows(tmp_path / "valid.parquet", 20, seed=2)
    done = run_command(["train", *tiny_overrides(tmp_path, train, valid), "--eval_bleu_samples=0", "--save_steps=10",
                        "--max_steps=20"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--eval_bleu_samples=0 computes no BLEU-4 to rank checkpoints by" in done.stderr
    assert "Best checkpoint by val_loss" in done.stderr
    assert (tmp_path / "run" / "best" / "model.safetensors").is_file()


def test_generate_answers_a_prompt_and_reads_prompts_until_an_empty_line(trained):
    folder, train, valid, _, _ = trained
    done = run_command(["generate", "--prompt=题9-1：春风明月", *tiny_overrides(folder, train, valid),
                        "--max_new_tokens=12"], cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
    import subprocess
    import sys
    from training_helpers import ROOT

    interactive = subprocess.run([sys.executable, str(ROOT / "train_low_mem.py"), "generate",
                                  *tiny_overrides(folder, train, valid), "--max_new_tokens=6"],
                                 input="题1：春风\n题2：明月\n\nnot read\n", capture_output=True, text=True, cwd=folder,
                                 timeout=120)
    assert interactive.returncode == 0, interactive.stderr[-2000:]
    assert interactive.stdout.count("prompt> ") == 3  # two answered, the empty line ends


def test_generate_without_a_model_says_which_command_to_run(tmp_path):
    done = run_command(["generate", "--prompt=hello", f"--output_dir={tmp_path / 'none'}"], cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "python train_low_mem.py train" in done.stderr
