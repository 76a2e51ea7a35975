"""The training command: learning, 3 processes on gloo, exact gradient accumulation, the large config."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
from training_helpers import ROOT, rank_matches, run_command, three_cpu_processes, tiny_overrides, write_chat_rows


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    return write_chat_rows(folder / "train.parquet", 900, seed=1), write_chat_rows(folder / "valid.parquet", 60, seed=2)


def _validation_losses(output: str) -> tuple[float, float]:
    match = re.search(r"Validation loss ([\d.]+) at step 0 → ([\d.]+) at step (\d+)", output)
    assert match, output[-3000:]
    return float(match.group(1)), float(match.group(2))


def test_single_process_training_learns_and_saves(tmp_path, chat_data):
    done = run_command(["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=60", "--learn_rate=0.01"],
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    start, end = _validation_losses(done.stderr)
    assert start - end > 1.0
    assert (tmp_path / "tok" / "tokenizer.model").is_file(), "train trains the tokenizer when it is missing"
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    log_files = list((tmp_path / "logs").glob("chat_trainer_low_mem_*.log"))
    assert len(log_files) == 1
    log_text = log_files[0].read_text()
    assert re.search(r"step 60/60 \| epoch 0 \| loss [\d.]+ \| lr [\d.e+-]+ \| "
                     r"grad_norm [\d.]+ \| tokens/s [\d,]+ \| rss \d+ MB",
                     log_text)
    assert "Sample" in log_text
    assert not (tmp_path / "logs" / "tensorboard").exists(), "no curves unless --report_to asks for them"


def traced_three_process_run(tmp_path, chat_data, max_steps: int, extra: tuple[str, ...] = (), **test_env: str):
    """A tiny run on 3 CPU processes with each rank's trace; returns the finished process and the 3 traces."""
    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate launcher is not on PATH")
    trace_dir = tmp_path / "trace"
    done = run_command(
        ["train", *tiny_overrides(tmp_path, *chat_data), f"--max_steps={max_steps}", *extra], cwd=tmp_path,
        env={"ACCELERATE_USE_CPU": "1", "LOWMEM_TRACE_DIR": str(trace_dir), "OMP_NUM_THREADS": "1", **test_env},
        launcher=three_cpu_processes(tmp_path / "ranks"),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done, [json.loads((trace_dir / f"trace-rank{rank}.json").read_text()) for rank in range(3)]


def test_three_processes_read_disjoint_rows_and_end_with_identical_weights(tmp_path, chat_data):
    done, traces = traced_three_process_run(tmp_path, chat_data, max_steps=20, extra=("--report_to=tensorboard",))
    for trace in traces:
        assert trace["steps"] == 20
        assert len(trace["rows"]) == 20 * 8
    seen = [set(trace["rows"]) for trace in traces]
    assert all(len(rows) == 20 * 8 for rows in seen), "a rank saw a row twice"
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2]), "ranks shared rows"
    assert len({trace["weights"] for trace in traces}) == 1, "weights differ between ranks"
    assert "Processes: 3" in done.stderr
    events = list((tmp_path / "logs" / "tensorboard").rglob("events.out.tfevents.*"))
    # The curves (and accelerate's hparams subfolder) come from the main process alone.
    assert len([path for path in events if path.parent.name == "run"]) == 1 and len(events) == 2, events


def test_missing_data_file_says_where_to_put_data(tmp_path):
    done = run_command(["train", f"--train_file={tmp_path / 'nothing.parquet'}"], cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "does not exist" in done.stderr and "--train_file=PATH" in done.stderr and "demo data" in done.stderr


def test_unknown_option_lists_the_valid_ones(tmp_path):
    done = run_command(["train", "--learn_rat=0.1"], cwd=tmp_path)  # --learning_rate is transformers' name: valid
    assert done.returncode == 2
    assert "Unknown option --learn_rat." in done.stderr and "Did you mean --learn_rate" in done.stderr
    assert "Traceback" not in done.stderr


def test_large_config_builds_the_large_model_and_takes_two_steps(tmp_path, chat_data):
    data = ROOT / "lowmem" / "demo_data"
    done = run_command(
        ["train", "--use_large_config=True", "--max_steps=2", f"--train_file={data / 'train.parquet'}",
         f"--validation_file={data / 'valid.parquet'}", f"--test_file={data / 'test.parquet'}",
         f"--tokenizer_dir={tmp_path / 'tok'}", f"--output_dir={tmp_path / 'large'}", "--vocab_size=6000",
         "--batch_size_per_gpu=2", "--eval_batches=1", "--sample_max_new_tokens=4", "--eval_bleu_samples=2",
         "--eval_max_new_tokens=4"],
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    model_line = r"Model: \w+ architecture, ([\d.]+) M parameters \(([\d.]+) M without embeddings\)"
    millions = float(re.search(model_line, done.stderr).group(2))
    assert 80 < millions < 90, "GPT-2 small-sized blocks (llama): ~85 M parameters"
    assert "step 2/2" in done.stderr
    model_config = json.loads((tmp_path / "large" / "final" / "model_config.json").read_text())
    assert (model_config["n_layer"], model_config["n_embd"], model_config["max_seq_len"]) == (12, 768, 192)


@pytest.mark.own_process  # the command reads the launcher's command line from its parent process
def test_launching_three_processes_without_multi_gpu_on_cpu_is_an_error(tmp_path, chat_data):
    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate launcher is not on PATH")
    done = run_command(["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=2"], cwd=tmp_path,
                       env={"ACCELERATE_USE_CPU": "1"},
                       launcher=["accelerate", "launch", "--num_processes", "3", "--main_process_port", "0"])
    assert done.returncode != 0
    assert "asked for 3 processes, but Accelerate runs 1" in done.stderr and "--multi_gpu" in done.stderr
    assert not (tmp_path / "run").exists(), "nothing trained"


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path, chat_data):
    # Rank 1's output is NaN during step 5: after the all-reduce every rank's gradients are.
    done, traces = traced_three_process_run(tmp_path, chat_data, max_steps=8, LOWMEM_TEST_NAN_AT_STEP="5:1")
    skipped = rank_matches(tmp_path / "ranks",
                           r"\[rank (\d)\] Step 5: the gradient norm is nan, so the update was skipped on every rank")
    assert sorted(skipped) == ["0", "1", "2"], done.stderr[-3000:]
    assert "Step 4:" not in done.stderr and "Step 6:" not in done.stderr
    assert len({trace["weights"] for trace in traces}) == 1, "weights differ between ranks after the skipped step"
    losses = traces[0]["losses"]
    assert math.isnan(losses["5"]) and all(math.isfinite(losses[str(step)]) for step in (4, 6, 7, 8))
    start, end = _validation_losses(done.stderr)
    assert math.isfinite(end)
