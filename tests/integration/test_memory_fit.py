"""The memory plan at work in `train` and `plan`: savers chosen to fit a budget, the same global batch, an exact
resume that keeps the choice, and a run that fits nowhere stopped before anything is written.

The harness fixes the plan's measured interpreter memory (LOWMEM_TEST_BASE_MB), so that the budget each test
hands the process sits where the test wants it: between the plan with and without the savers. With that figure
fixed, nothing the plan decides depends on the process, and the commands run in the test's process.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from training_helpers import run_command, traced_losses, write_chat_rows

from lowmem.cli.common import build_config
from lowmem.config import given_fields
from lowmem.config.overrides import explicit_fields
from lowmem.train.memory_fit import RunLayout, decide
from lowmem.units import MB

BASE_MB = 300
# One thread per process, as the other resume tests run: the resumed losses are compared for equality, and with
# two threads a resumed run's first step was once 7e-8 off the reference's (the summation order of a parallel
# kernel is not fixed when the threads it gets vary).
ENV = {"LOWMEM_TEST_BASE_MB": str(BASE_MB), "OMP_NUM_THREADS": "1"}


def overrides(folder: Path, *extra: str) -> list[str]:
    """A model whose activations matter beside a 300 MB interpreter; batch_size_per_gpu and accumulation are left
    at their defaults (32 x 1), which the savers may change."""
    return [f"--train_file={folder / 'train.parquet'}", f"--validation_file={folder / 'valid.parquet'}",
            f"--test_file={folder / 'valid.parquet'}", f"--tokenizer_dir={folder / 'tok'}",
            f"--output_dir={folder / 'run'}", "--vocab_size=400", "--n_layer=4", "--n_head=4", "--n_embd=128",
            "--max_seq_len=64", "--loss_chunk_tokens=0", "--dataloader_buffer_size=50", "--logging_steps=1",
            "--warmup_steps=2", "--sample_max_new_tokens=8", "--eval_bleu_samples=8", "--eval_max_new_tokens=8",
            "--epochs=1", "--save_steps=5", "--keep_latest_n_ckp=1", "--dropout=0.1", *extra]


def as_config(args: list[str]):
    values = {}
    for arg in args:
        name, _, text = arg[2:].partition("=")
        try:
            values[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            values[name] = text
    return build_config(False, values), values


def choice_at(args: list[str], budget_gb: float):
    config, values = as_config([*args, f"--memory_budget_gb={budget_gb}"])
    return decide(config, RunLayout("single", 1, 1, "cpu"), explicit_fields(config, given_fields(config, values)),
                  base_bytes=BASE_MB * MB)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fit-data")
    write_chat_rows(folder / "train.parquet", 900, seed=1)
    write_chat_rows(folder / "valid.parquet", 60, seed=2)
    return folder


@pytest.fixture(scope="module")
def halving_budget(data) -> float:
    """The largest budget (GB) at which the savers must halve the micro-batch, and still fit."""
    args = overrides(data)
    for hundredths in range(60, 25, -1):
        decision = choice_at(args, hundredths / 100)
        if decision.error is None and "batch_size_per_gpu" in decision.changes:
            return hundredths / 100
    pytest.fail("no budget makes the savers halve the micro-batch")


def copy_data(data: Path, folder: Path) -> None:
    for name in ("train.parquet", "valid.parquet"):
        (folder / name).write_bytes((data / name).read_bytes())


def saved_state(folder: Path) -> dict:
    checkpoint = max((folder / "run").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    return json.loads((checkpoint / "trainer_state.json").read_text())


def test_small_budget_turns_savers_on_keeps_the_global_batch_and_resumes_exactly(tmp_path, data, halving_budget):
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    for folder in (reference, stopped):
        folder.mkdir()
        copy_data(data, folder)
    budget = f"--memory_budget_gb={halving_budget}"
    whole = run_command(["train", *overrides(reference, budget)], cwd=reference,
                        env={**ENV, "LOWMEM_TRACE_DIR": str(reference / "trace")})
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "Memory savers turned on" in whole.stderr and "the same rows per optimizer step" in whole.stderr
    config = saved_state(reference)["config"]
    assert config["batch_size_per_gpu"] < 32
    assert config["batch_size_per_gpu"] * config["gradient_accumulation_steps"] == 32  # the global batch
    assert config["activation_checkpointing"] is True
    assert saved_state(reference)["memory_savers"]["changes"]["batch_size_per_gpu"] == config["batch_size_per_gpu"]

    first = run_command(["train", *overrides(stopped, budget)], cwd=stopped,
                        env={**ENV, "LOWMEM_STOP_AFTER_STEP": "7"})
    assert first.returncode == 0, first.stderr[-3000:]
    # Resumed on a "host" with more memory: the savers chosen for the run are kept, and the log says so.
    resumed = run_command(["train", *overrides(stopped, "--memory_budget_gb=64", "--is_keep_training=True")],
                          cwd=stopped, env={**ENV, "LOWMEM_TRACE_DIR": str(stopped / "trace")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Memory savers of the run kept for an exact resume" in resumed.stderr
    assert f"chosen for a {halving_budget:.2f} GiB budget; this host gives 64.0 GiB" in resumed.stderr
    assert "Resumed from" in resumed.stderr and "(changed:" not in resumed.stderr
    expected, got = traced_losses(reference / "trace"), traced_losses(stopped / "trace")
    assert min(got) > 7 and got == {step: expected[step] for step in got}


def test_savers_off_runs_the_settings_as_given(tmp_path, data, halving_budget):
    copy_data(data, tmp_path)
    done = run_command(["train", *overrides(tmp_path, f"--memory_budget_gb={halving_budget}", "--memory_savers=off",
                                            "--max_steps=2")], cwd=tmp_path, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Memory savers turned on" not in done.stderr and "may be OOM-killed" in done.stderr
    config = saved_state(tmp_path)["config"]
    assert (config["batch_size_per_gpu"], config["activation_checkpointing"]) == (32, False)


def listing(folder: Path) -> list[str]:
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*"))


def test_a_budget_nothing_fits_stops_before_anything_is_built(tmp_path, data):
    copy_data(data, tmp_path)
    before = listing(tmp_path)
    done = run_command(["train", *overrides(tmp_path, "--memory_budget_gb=0.2")], cwd=tmp_path, env=ENV)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "does not fit" in error[0] and "MB short" in error[0]
    assert listing(tmp_path) == before, "no log, lock, tokenizer or run folder was left behind"


def test_the_plan_command_prints_the_table_and_keeps_explicit_settings(tmp_path, data, halving_budget):
    copy_data(data, tmp_path)
    args = overrides(tmp_path, f"--memory_budget_gb={halving_budget}")
    done = run_command(["plan", *args], cwd=tmp_path, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Memory plan:" in done.stdout and "high-water per process" in done.stdout and ": fits" in done.stdout
    assert "activation checkpointing (--activation_checkpointing=True" in done.stdout
    kept = run_command(["plan", *args, "--activation_checkpointing=False"], cwd=tmp_path, env=ENV)
    assert "--activation_checkpointing=True" not in kept.stdout
    assert not (tmp_path / "run").exists() and not (tmp_path / "tok").exists()
    nowhere = run_command(["plan", *overrides(tmp_path, "--memory_budget_gb=0.2")], cwd=tmp_path, env=ENV)
    assert nowhere.returncode == 2 and "does not fit" in nowhere.stderr and "Memory plan:" in nowhere.stdout


def test_a_smaller_micro_batch_with_more_accumulation_trains_the_same_run(tmp_path, data):
    """What the micro-batch lever promises: the same rows per optimizer step give the same losses (to float
    rounding), since the loss is the mean over every token of the step and packed rows attend only to themselves."""
    losses = []
    for rows, accumulation in ((32, 1), (8, 4)):
        folder = tmp_path / f"{rows}x{accumulation}"
        folder.mkdir()
        copy_data(data, folder)
        done = run_command(["train", *overrides(folder, "--dropout=0.0", "--max_steps=6", "--memory_savers=off",
                                                f"--tokenizer_dir={tmp_path / 'tok'}",
                                                f"--batch_size_per_gpu={rows}",
                                                f"--gradient_accumulation_steps={accumulation}")],
                           cwd=folder, env={**ENV, "LOWMEM_TRACE_DIR": str(folder / "trace")})
        assert done.returncode == 0, done.stderr[-3000:]
        losses.append(traced_losses(folder / "trace"))
    assert losses[0].keys() == losses[1].keys() and len(losses[0]) == 6
    assert all(abs(losses[0][step] - losses[1][step]) < 1e-4 for step in losses[0]), losses


def large_preset_overrides(folder: Path, *extra: str) -> list[str]:
    """The large preset (32 rows x 2 per step, which the plan may change) with a tiny model and schedule, eager: told
    it is on a GPU, the run would compile by default, and inductor would build each batch shape's kernels (50
    CPU-seconds of a test's three runs) for a split that does not depend on them."""
    return ["--use_large_config=True", "--compile=False", f"--train_file={folder / 'train.parquet'}",
            f"--validation_file={folder / 'valid.parquet'}", f"--test_file={folder / 'valid.parquet'}",
            f"--tokenizer_dir={folder / 'tok'}", f"--output_dir={folder / 'run'}", "--vocab_size=400", "--n_layer=2",
            "--n_head=2", "--n_embd=32", "--max_seq_len=64", "--dataloader_buffer_size=50", "--logging_steps=1",
            "--warmup_steps=2", "--eval_batches=2", "--eval_bleu_samples=0", "--sample_max_new_tokens=8",
            "--max_steps=8", "--save_steps=4", *extra]


def test_a_run_whose_split_the_plan_changed_for_a_gpu_resumes_exactly(tmp_path, data):
    """On a GPU the plan gives the large preset's 64 rows per step to one micro-batch; the run saves that choice
    and a resume keeps it (here the plan is told the run is on a 20 GB GPU; the training itself runs on the CPU)."""
    gpu = {**ENV, "LOWMEM_TEST_PLAN_GPU_GB": "20"}
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    for folder in (reference, stopped):
        folder.mkdir()
        copy_data(data, folder)
    whole = run_command(["train", *large_preset_overrides(reference)], cwd=reference,
                        env={**gpu, "LOWMEM_TRACE_DIR": str(reference / "trace")})
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "GPU micro-batches: one micro-batch of 64 rows per step instead of 32 x 2" in whole.stderr
    config = saved_state(reference)["config"]
    assert (config["batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (64, 1)

    first = run_command(["train", *large_preset_overrides(stopped)], cwd=stopped,
                        env={**gpu, "LOWMEM_STOP_AFTER_STEP": "5"})
    assert first.returncode == 0, first.stderr[-3000:]
    # Resumed where the plan would split differently (a 2 GB GPU): the run's own split is kept.
    resumed = run_command(["train", *large_preset_overrides(stopped, "--is_keep_training=True")], cwd=stopped,
                          env={**gpu, "LOWMEM_TEST_PLAN_GPU_GB": "2", "LOWMEM_TRACE_DIR": str(stopped / "trace")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Memory savers of the run kept for an exact resume: --batch_size_per_gpu=64" in resumed.stderr
    assert "(changed:" not in resumed.stderr
    expected, got = traced_losses(reference / "trace"), traced_losses(stopped / "trace")
    assert sorted(got) == [6, 7, 8] and got == {step: expected[step] for step in got}


def test_the_plan_command_for_a_gpu_names_the_split_it_would_train(tmp_path, data):
    """`lowmem plan --device=cuda --gpu_memory_gb=GB --use_large_config=True`, as the docs show it: one micro-batch of
    64 rows on a 20 GB GPU, the preset's 32 x 2 on a 4 GB one; the rows per step stay 64."""
    copy_data(data, tmp_path)
    common = ["plan", "--use_large_config=True", "--device=cuda", f"--train_file={tmp_path / 'train.parquet'}",
              f"--validation_file={tmp_path / 'valid.parquet'}", f"--tokenizer_dir={tmp_path / 'tok'}"]
    large = run_command([*common, "--gpu_memory_gb=20"], cwd=tmp_path, env=ENV)
    assert large.returncode == 0, large.stderr[-3000:]
    assert "micro-batch 64 rows x 1" in large.stdout
    assert "GPU micro-batches: one micro-batch of 64 rows per step instead of 32 x 2" in large.stdout
    small = run_command([*common, "--gpu_memory_gb=4"], cwd=tmp_path, env=ENV)
    assert small.returncode == 0, small.stderr[-3000:]
    assert "micro-batch 32 rows x 2" in small.stdout and "GPU micro-batches" not in small.stdout


def test_a_runs_saved_config_applies_its_given_values_and_the_plan_chooses_again(tmp_path, data, halving_budget):
    copy_data(data, tmp_path)
    first = run_command(["train", *overrides(tmp_path, f"--memory_budget_gb={halving_budget}", "--max_steps=5")],
                        cwd=tmp_path, env=ENV)
    assert first.returncode == 0, first.stderr[-3000:]
    saved_path = tmp_path / "run" / "final" / "train_config.json"
    saved = json.loads(saved_path.read_text())
    assert saved["activation_checkpointing"] is True and saved["batch_size_per_gpu"] < 32  # chosen for that budget
    assert "n_layer" in saved["given_fields"] and "activation_checkpointing" not in saved["given_fields"]
    assert saved["preset"] == "default"

    def printed(config_file: Path) -> tuple[dict, str]:
        done = run_command(["train", f"--config={config_file}", "--memory_budget_gb=64",
                            f"--output_dir={tmp_path / 'again'}", "--print_config"], cwd=tmp_path, env=ENV)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout), done.stderr

    again, said = printed(saved_path)  # another host: a budget the savers are not needed for
    assert "is a run's saved config: applying the" in said and "are chosen again here" in said
    assert (again["n_layer"], again["n_embd"], again["max_steps"]) == (4, 128, 5)  # given: applied
    assert again["activation_checkpointing"] is False and again["batch_size_per_gpu"] == 32  # chosen again
    # A file without the record of what was given (an earlier version's) still applies every field.
    every_field = tmp_path / "every_field.json"
    every_field.write_text(json.dumps({key: value for key, value in saved.items()
                                       if key not in ("given_fields", "preset")}))
    kept, _ = printed(every_field)
    assert kept["activation_checkpointing"] is True and kept["batch_size_per_gpu"] == saved["batch_size_per_gpu"]
