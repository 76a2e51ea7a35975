"""Runs started from a trained model, through the command line: a transformers Qwen2 fine-tuned and exported back
(transformers then answers as lowmem does), a resume that never reads the source again, a second stage on one's
own pretrained run, the same model sharded over three processes, and every command finding a run by train's rule.
(Three FSDP processes starting from a model of Qwen2.5-0.5B's shapes: test_sharded_half_billion_runs.py.)"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import qwen as qwen  # noqa: E402  (the fixture)
from hf_models import mixed_lines  # noqa: E402
from training_helpers import (FSDP_CPU_ENV, FSDP_LAUNCHER, assert_losses_match, chat_project,  # noqa: E402
                              resumed_from, run_command, traced_losses, write_chat_rows)

from lowmem.checkpoint.export import load_model_folder  # noqa: E402
from lowmem.eval.commands import answer  # noqa: E402

# A short run: 4 steps of 8 rows, a validation (BLEU-4 on 4 prompts) and a checkpoint at the end.
SHORT = ["--max_steps=4", "--batch_size_per_gpu=8", "--eval_bleu_samples=4", "--eval_max_new_tokens=8",
         "--sample_max_new_tokens=8", "--save_steps=4", "--logging_steps=1", "--warmup_steps=2"]
VALIDATION_LINE = re.compile(r"Validation at step (\d+): loss ([\d.]+)")


def _validation_losses(stderr: str) -> dict[int, str]:
    return {int(step): loss for step, loss in VALIDATION_LINE.findall(stderr)}


def test_a_qwen2_fine_tuned_and_exported_answers_in_transformers_as_in_lowmem(tmp_path, qwen):
    project = chat_project(tmp_path)
    trained = run_command(["train", f"--init_from={qwen}", *SHORT], cwd=project)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run = project / "model_save" / "train_from_qwen2-tiny"
    assert f"Started from Qwen2ForCausalLM in {qwen} (the folder given): llama, 2 layers x 64 wide, 4 heads (2 " \
           "key/value)" in trained.stderr
    assert "training one" not in trained.stderr and not (project / "model_save" / "tokenizer").exists()
    record = json.loads((run / "started_from.json").read_text())
    assert record["kind"] == "transformers" and record["folder"] == str(qwen.resolve())
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (qwen / "tokenizer.json").read_bytes()
    assert (run / "best" / "tokenizer.json").is_file()

    exported = run_command(["export", str(project / "hf"), f"--init_from={qwen}"], cwd=project)
    assert exported.returncode == 0, exported.stderr[-3000:]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(project / "hf").eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(project / "hf")
    assert type(hf_model).__name__ == "Qwen2ForCausalLM" and hf_model.config.num_key_value_heads == 2
    ours, tokenizer = load_model_folder(run / "best", run / "tokenizer", torch.device("cpu"))
    ids = torch.randint(0, hf_model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf_model(ids).logits - ours(ids)[0]).abs().max().item() <= 1e-4

    prompt = "题7：春风明月"
    ours_answer = answer(ours, tokenizer, prompt, max_new_tokens=12)
    chat = hf_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**chat, max_new_tokens=12, do_sample=False)
    assert hf_tokenizer.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True) == ours_answer

    # A prompt longer than the training sequence (192) is answered whole, in the source's context (512), as
    # transformers answers it: the first answer token's logits over the whole templated prompt.
    long_prompt = "".join(mixed_lines(32, seed=5))
    chat = hf_tokenizer.apply_chat_template([{"role": "user", "content": long_prompt}], add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")
    assert 300 <= chat["input_ids"].shape[1] <= 500 - 12, chat["input_ids"].shape
    seen = []
    generate = ours.generate
    ours.generate = lambda idx, **options: seen.append(idx) or generate(idx, **options)
    answer(ours, tokenizer, long_prompt, max_new_tokens=12)
    assert seen[0].tolist() == chat["input_ids"].tolist()  # the whole prompt, none of it cut
    with torch.no_grad():
        theirs = hf_model(**chat).logits[:, -1]
        first = ours(seen[0], last_logits=True)[0][:, :theirs.shape[1]]
    assert (first - theirs).abs().max().item() <= 1e-4

    generated = run_command(["generate", f"--prompt={prompt}", "--max_new_tokens=12", f"--init_from={qwen}"],
                            cwd=project)
    assert generated.returncode == 0 and generated.stdout.strip() == ours_answer.strip(), generated.stderr[-2000:]
    scored = run_command(["evaluate", "--bleu_samples=2", f"--init_from={qwen}"], cwd=project)
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert json.loads((run / "eval" / "test_summary.json").read_text())["test_file"] == "data/test.parquet"


def test_the_resume_of_a_run_started_from_a_model_is_exact_without_the_model(tmp_path, qwen):
    source = shutil.copytree(qwen, tmp_path / "models" / "qwen2-tiny")
    flags = [f"--init_from={source}", "--max_steps=8", "--batch_size_per_gpu=8", "--dropout=0.1",
             "--gradient_accumulation_steps=2", "--save_steps=4", "--eval_bleu_samples=0", "--logging_steps=1"]
    reference = chat_project(tmp_path / "reference")
    done = run_command(["train", *flags], cwd=reference, env={"LOWMEM_TRACE_DIR": str(reference / "trace")})
    assert done.returncode == 0, done.stderr[-3000:]

    stopped = chat_project(tmp_path / "stopped")
    first = run_command(["train", *flags], cwd=stopped, env={"LOWMEM_STOP_AFTER_STEP": "4"})
    assert first.returncode == 0 and "at step 4" in first.stderr, first.stderr[-3000:]
    source.rename(source.with_name("moved-away"))  # the resume reads only the run folder
    resumed = run_command(["train", *flags, "--is_keep_training=True"], cwd=stopped,
                          env={"LOWMEM_TRACE_DIR": str(stopped / "trace")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_from(resumed.stderr) == 4 and "Started from" not in resumed.stderr
    assert_losses_match(traced_losses(stopped / "trace"), traced_losses(reference / "trace"), 4)


def _text_rows(path: Path, rows: int, seed: int) -> Path:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    texts = ["".join(rng.choices("春风明月江南归去相思落花流水千里故人长亭夜雨", k=rng.randint(20, 60))) + "。"
             for _ in range(rows)]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=64)
    return path


def test_a_second_stage_starts_from_the_first_with_its_tokenizer_and_a_new_schedule(tmp_path):
    text_train, text_valid = _text_rows(tmp_path / "text.parquet", 400, 1), _text_rows(tmp_path / "tv.parquet", 40, 2)
    pairs_train = write_chat_rows(tmp_path / "pairs.parquet", 200, seed=3)
    pairs_valid = write_chat_rows(tmp_path / "pairs_valid.parquet", 30, seed=4)
    tiny = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--max_seq_len=64", "--batch_size_per_gpu=8",
            "--eval_bleu_samples=0", "--logging_steps=1", "--sample_max_new_tokens=4"]
    first = run_command(["train", "--text_column=text", f"--train_file={text_train}", f"--validation_file={text_valid}",
                         f"--test_file={text_valid}", f"--tokenizer_dir={tmp_path / 'tok'}", "--vocab_size=300",
                         f"--output_dir={tmp_path / 'stage1'}", "--epochs=1", "--save_steps=1000", *tiny],
                        cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    last_step, last_loss = max(_validation_losses(first.stderr).items())
    assert last_step == 50  # the epoch's last step: final/ holds these weights

    # Pairs from the pretrained run: its tokenizer (none trained), a schedule from step 0 with its warmup.
    second = run_command(["train", f"--init_from={tmp_path / 'stage1'}", f"--train_file={pairs_train}",
                          f"--validation_file={pairs_valid}", f"--test_file={pairs_valid}", "--max_steps=3",
                          "--warmup_steps=10", "--learn_rate=1e-3", "--batch_size_per_gpu=8", "--eval_bleu_samples=0",
                          "--logging_steps=1", "--sample_max_new_tokens=4"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    stage2 = tmp_path / "model_save" / "pairs_from_stage1"
    assert "the run's final/, as it has no best/" in second.stderr or "the run's best/" in second.stderr
    assert "No tokenizer at" not in second.stderr
    same = [json.loads((folder / "tokenizer.json").read_text())["sha256"] for folder in (tmp_path / "stage1", stage2)]
    assert same[0] == same[1]
    assert re.search(r"step 1/3 \| epoch 0 \| loss [\d.]+ \| lr 1\.00e-04", second.stderr), second.stderr[-2000:]

    # The same weights on the same validation rows: stage two's loss at step 0 is stage one's last.
    again = run_command(["train", f"--init_from={tmp_path / 'stage1' / 'final'}", "--text_column=text",
                         f"--train_file={text_train}", f"--validation_file={text_valid}", f"--test_file={text_valid}",
                         "--max_steps=1", "--batch_size_per_gpu=8", "--eval_bleu_samples=0",
                         f"--output_dir={tmp_path / 'stage2-text'}", "--sample_max_new_tokens=4"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _validation_losses(again.stderr)[0] == last_loss


def test_three_fsdp_processes_load_the_model_the_single_process_loads(tmp_path, qwen):
    project = chat_project(tmp_path)
    flags = [f"--init_from={qwen}", "--max_steps=1", "--batch_size_per_gpu=8", "--eval_bleu_samples=0",
             "--sample_max_new_tokens=4"]
    single = run_command(["train", *flags, "--output_dir=model_save/single"], cwd=project)
    assert single.returncode == 0, single.stderr[-3000:]
    sharded = run_command(["train", *flags, "--output_dir=model_save/sharded"], cwd=project, launcher=FSDP_LAUNCHER,
                          env=FSDP_CPU_ENV)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    output = sharded.stdout + sharded.stderr  # the ranks' lines, as the launcher passes them on
    assert "Parallelism: FSDP2, 3 processes" in output
    # The sharded model's first validation (the shards gathered) scores the rows as the single process's model.
    assert _validation_losses(output)[0] == _validation_losses(single.stderr)[0]


@pytest.mark.slow
def test_every_command_finds_a_run_of_ones_own_data_with_trains_flags(tmp_path):
    project = chat_project(tmp_path / "project")
    tiny = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--vocab_size=400", "--max_steps=2", "--batch_size_per_gpu=8",
            "--gradient_accumulation_steps=1", "--eval_bleu_samples=2", "--eval_max_new_tokens=4",
            "--sample_max_new_tokens=4", "--save_steps=2", "--eval_batches=1", "--dataloader_buffer_size=50"]
    for preset, run in (([], "train"), (["--use_large_config=True"], "train_pretrain_large")):
        trained = run_command(["train", *preset, *tiny], cwd=project)
        assert trained.returncode == 0, trained.stderr[-3000:]
        assert (project / "model_save" / run / "best").is_dir()
        for command in (["generate", "--prompt=春风", "--max_new_tokens=4"], ["export", f"hf-{run}"],
                        ["evaluate", "--bleu_samples=2"], ["memlog"]):
            # memlog given train's flags reads that run's folder (with none, the newest run in logs/)
            done = run_command([*command, *preset] + (["--train_file=data/train.parquet"] if command[0] == "memlog"
                                                      else []), cwd=project)
            assert done.returncode == 0, (command, done.stderr[-2000:])
        assert (project / f"hf-{run}" / "config.json").is_file()
        assert (project / "model_save" / run / "eval" / "test_summary.json").is_file()
    # From a folder without data/: the run's test file is not found, and the demo's test set is named as such.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    scored = run_command(["evaluate", "--bleu_samples=0", f"--output_dir={project / 'model_save' / 'train'}"],
                         cwd=elsewhere)
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert "it is scored on lowmem's demo test set" in scored.stderr and "--test_file=" in scored.stderr
