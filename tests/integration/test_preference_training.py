"""Preference training (--objective=dpo) through the command line on a transformers Qwen2: the loss at ln 2 where
the policy is its reference, held-out preferences learned, the reference precomputed as the in-memory one computes
it, adapters with no second model, an exact resume, and the refusals."""

from __future__ import annotations

import gc
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from lowmem.adapters.files import BASE_DIR

transformers = pytest.importorskip("transformers")

from hf_models import qwen as qwen  # noqa: E402  (the fixture)
from hf_models import qwen_one_block as qwen_one_block  # noqa: E402
from training_helpers import (FSDP_CPU_ENV, FSDP_LAUNCHER, assert_losses_match, commands_run_in,  # noqa: E402
                              preference_project, resumed_from, run_command, run_in_own_process,
                              traced_and_stopped_runs, traced_losses)

ENV = {"OMP_NUM_THREADS": "1"}  # one summation order: losses are compared across runs
DPO = ["--objective=dpo", "--batch_size_per_gpu=8", "--max_seq_len=64", "--warmup_steps=5", "--logging_steps=1",
       "--sample_max_new_tokens=8", "--save_steps=50", "--eval_steps=50"]
VALIDATION = re.compile(r"Validation at step (\d+): DPO loss ([\d.]+), rewards/accuracy ([\d.]+), rewards/margin "
                        r"(-?[\d.]+)")


def validations(stderr: str) -> dict[int, tuple[float, float, float]]:
    """{step: (DPO loss, rewards/accuracy, rewards/margin)} of each validation a run logged."""
    return {int(step): (float(loss), float(accuracy), float(margin))
            for step, loss, accuracy, margin in VALIDATION.findall(stderr)}


def test_dpo_starts_at_ln_2_and_learns_the_held_out_preferences(tmp_path, qwen):
    project = preference_project(tmp_path)
    done = run_command(["train", f"--init_from={qwen}", *DPO, "--learning_rate=3e-3", "--dpo_beta=0.5",
                        "--epochs=4", "--output_dir=run"], cwd=project,
                       env={**ENV, "LOWMEM_TRACE_DIR": str(project / "trace")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the reference log-probabilities come from a frozen copy of the starting model" in done.stderr
    losses = traced_losses(project / "trace")
    assert losses[1] == pytest.approx(math.log(2), abs=1e-4)  # the first step's policy is its reference
    scores = validations(done.stderr)
    assert scores[0][0] == pytest.approx(math.log(2), abs=1e-4) and scores[0][1] == 0.0
    last = scores[max(scores)]
    assert max(scores) == 200 and last[1] > 0.9 and last[2] > 0  # 64 held-out pairs, 200 CPU steps
    line = next(text for text in done.stderr.splitlines() if "step 200/200" in text)
    assert all(name in line for name in ("rewards/chosen", "rejected", "accuracy", "margin"))
    # Checkpoints are ranked by the held-out accuracy, and best/ is the best of them.
    assert "Best checkpoint by rewards_accuracy" in done.stderr
    manifest = json.loads((project / "run" / "final" / "train_config.json").read_text())
    assert manifest["best_metric"] == "rewards_accuracy" and manifest["objective"] == "dpo"
    # evaluate scores the tuned model on the chosen answers of preference rows, and its held-out rewards against the
    # run's reference (its frozen copy in run/base): the objective read from the run, not given again.
    scored = run_command(["evaluate", "--output_dir=run", "--test_file=data/valid.parquet", "--bleu_samples=4",
                          "--batch_size_per_gpu=8"], cwd=project, env=ENV)
    assert scored.returncode == 0, scored.stderr[-3000:]
    summary = json.loads((project / "run" / "eval" / "test_summary.json").read_text())
    assert summary["samples"] == 64 and "chosen answers" in summary["loss_tokens"]
    pairs = summary["preference"]
    best = max(accuracy for _, accuracy, _ in scores.values())  # best/ is the checkpoint of the best accuracy
    assert pairs["pairs"] == 64 and pairs["rewards/accuracy"] == pytest.approx(best, abs=1e-6), (pairs, scores)
    assert pairs["rewards/margin"] > 0 and pairs["reference"] == "a frozen copy of the starting model"


def test_the_precomputed_values_are_of_the_length_training_settles_from_the_rows(tmp_path, qwen):
    """Neither command given --max_seq_len: both take the length of the training pairs, so training takes the
    values the pass wrote instead of refusing them as another length's."""
    project = preference_project(tmp_path)
    written = run_command(["dpo_reference", f"--init_from={qwen}", "--train_file=data/train.parquet",
                           "--validation_file=data/valid.parquet"], cwd=project, env=ENV)
    assert written.returncode == 0, written.stderr[-3000:]
    length = json.loads((project / "data" / "train.reference" / "_reference.json").read_text())["max_seq_len"]
    assert length % 32 == 0 and length < 192  # the pairs' length, not the default
    trained = run_command(["train", f"--init_from={qwen}", "--objective=dpo", "--dpo_reference=precomputed",
                           "--train_file=data/train.reference", "--validation_file=data/valid.reference",
                           "--max_steps=1", "--sample_max_new_tokens=4"], cwd=project, env=ENV)
    assert trained.returncode == 0, trained.stderr[-3000:]
    run = project / "model_save" / "train_dpo_precomputed_from_qwen2-tiny"
    assert json.loads((run / "final" / "train_config.json").read_text())["max_seq_len"] == length


def test_the_precomputed_reference_trains_as_the_one_in_memory(tmp_path, qwen):
    project = preference_project(tmp_path)
    flags = [f"--init_from={qwen}", *DPO, "--max_steps=6", "--learning_rate=3e-3"]
    written = run_command(["dpo_reference", f"--init_from={qwen}", "--train_file=data/train.parquet",
                           "--validation_file=data/valid.parquet", "--max_seq_len=64"], cwd=project, env=ENV)
    assert written.returncode == 0, written.stderr[-3000:]
    folder = project / "data" / "train.reference"
    assert len(list(folder.glob("part-*.parquet"))) == 7 and "--dpo_reference=precomputed" in written.stdout
    in_memory = run_command(["train", *flags, "--output_dir=copy"], cwd=project,
                            env={**ENV, "LOWMEM_TRACE_DIR": str(project / "trace-copy")})
    precomputed = run_command(["train", *flags, "--output_dir=pre", "--dpo_reference=precomputed",
                               f"--train_file={folder}", "--validation_file=data/valid.reference"], cwd=project,
                              env={**ENV, "LOWMEM_TRACE_DIR": str(project / "trace-pre")})
    assert in_memory.returncode == 0 and precomputed.returncode == 0, precomputed.stderr[-3000:]
    assert "the rows' precomputed reference_chosen and reference_rejected" in precomputed.stderr
    ours, theirs = traced_losses(project / "trace-pre"), traced_losses(project / "trace-copy")
    assert sorted(ours) == sorted(theirs) == list(range(1, 7))
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], abs=1e-5), step
    assert validations(precomputed.stderr)[6] == pytest.approx(validations(in_memory.stderr)[6], abs=1e-4)

    # A pass that stopped resumes: the parts already written are kept as they are.
    kept = (folder / "part-00000.parquet").stat().st_mtime_ns
    (folder / "part-00006.parquet").unlink()
    again = run_command(["dpo_reference", f"--init_from={qwen}", "--train_file=data/train.parquet",
                         "--validation_file=data/valid.parquet", "--max_seq_len=64"], cwd=project, env=ENV)
    assert again.returncode == 0 and "400 rows (16 computed now)" in again.stderr, again.stderr[-3000:]
    assert (folder / "part-00000.parquet").stat().st_mtime_ns == kept
    # Values computed for another sequence length are refused, by the pass and by training.
    other = run_command(["train", *flags, "--output_dir=other", "--dpo_reference=precomputed", "--max_seq_len=48",
                         f"--train_file={folder}", "--validation_file=data/valid.reference"], cwd=project, env=ENV)
    assert other.returncode == 2 and "--max_seq_len=64" in other.stderr and "Traceback" not in other.stderr



def test_dpo_reference_on_several_processes_writes_what_one_writes_and_resumes_on_another_number(tmp_path, qwen):
    """Each process computes its share of the row groups into the same folder: the parts are those one process
    writes, value for value, and a pass that stopped resumes on another number of processes."""
    import pyarrow.parquet as pq

    project = preference_project(tmp_path)
    args = ["dpo_reference", f"--init_from={qwen}", "--train_file=data/train.parquet",
            "--validation_file=data/valid.parquet", "--max_seq_len=64"]
    alone = run_command(args, cwd=project, env=ENV)
    assert alone.returncode == 0, alone.stderr[-3000:]
    for name in ("train", "valid"):
        (project / "data" / f"{name}.reference").rename(project / f"{name}.alone")

    def launched(processes: int) -> str:
        done = run_command(args, cwd=project, env={**ENV, "ACCELERATE_USE_CPU": "1"},
                           launcher=["accelerate", "launch", "--multi_gpu", "--num_processes", str(processes),
                                     "--main_process_port", "0"])
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("Train with: train --objective=dpo") == 1  # said once, by the main process
        return done.stderr

    assert "400 rows (400 computed now by 2 processes)" in launched(2)
    for name, groups in (("train", 7), ("valid", 1)):
        shared, one = project / "data" / f"{name}.reference", project / f"{name}.alone"
        assert sorted(part.name for part in shared.glob("part-*")) == [f"part-{n:05d}.parquet" for n in range(groups)]
        for part in one.glob("part-*.parquet"):
            assert pq.read_table(shared / part.name).equals(pq.read_table(part)), part.name
        assert json.loads((shared / "_reference.json").read_text())["complete"]
    # Stopped with two parts missing: three processes write those two, and only those.
    folder = project / "data" / "train.reference"
    kept = (folder / "part-00000.parquet").stat().st_mtime_ns
    (folder / "part-00001.parquet").unlink()
    (folder / "part-00005.parquet").unlink()
    assert "400 rows (128 computed now by 3 processes)" in launched(3)
    assert (folder / "part-00000.parquet").stat().st_mtime_ns == kept
    for number in (1, 5):
        part = f"part-{number:05d}.parquet"
        assert pq.read_table(folder / part).equals(pq.read_table(project / "train.alone" / part))

def _parameters_alive() -> int:
    """Elements of every distinct Parameter alive in the process (garbage of earlier tests collected first, so that
    it is not counted before and gone after)."""
    gc.collect()
    seen: dict[int, int] = {}
    for thing in gc.get_objects():
        if isinstance(thing, torch.nn.Parameter):
            seen[id(thing)] = thing.numel()
    return sum(seen.values())


@pytest.fixture(scope="module")
def wider_qwen(tmp_path_factory) -> Path:
    """A Qwen2 of 8 layers x 384 (16.6 M parameters, 66 MB in float32): large enough that a second copy shows in
    the process's RSS above what else a Trainer allocates."""
    from hf_models import qwen2_tokenizer

    folder = tmp_path_factory.mktemp("models") / "qwen2-wider"
    ids = qwen2_tokenizer(folder)
    config = transformers.Qwen2Config(vocab_size=ids, eos_token_id=ids - 1, pad_token_id=ids - 3, hidden_size=384,
                                      intermediate_size=1536, num_hidden_layers=8, num_attention_heads=6,
                                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def _rss() -> int:
    """This process's RSS with the garbage of earlier tests collected and the C heap's free memory returned (as the
    Trainer's own cleanup returns it: else that return would count against what the Trainer adds)."""
    import psutil

    from lowmem.memory.cleanup import return_free_heap

    gc.collect()
    return_free_heap()
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_with_adapters_the_reference_is_the_model_itself_and_no_copy_is_made(tmp_path, wider_qwen, lora_rank):
    from lowmem.config import TrainConfig
    from lowmem.model.weights import unwrap_gpt
    from lowmem.train.trainer import Trainer

    project = preference_project(tmp_path)
    config = TrainConfig(init_from=str(wider_qwen), objective="dpo", lora_rank=lora_rank,
                         output_dir=str(project / "run"), train_file=str(project / "data" / "train.parquet"),
                         validation_file=str(project / "data" / "valid.parquet"), max_seq_len=64,
                         batch_size_per_gpu=8, max_steps=2, progress=False, malloc_mmap_threshold_mb=1,
                         eval_batches=2, sample_max_new_tokens=4)  # the run's end: a short validation and sample
    before, rss_before = _parameters_alive(), _rss()
    with commands_run_in(project):
        trainer = Trainer(config)
        model = unwrap_gpt(trainer.model)
        weights = sum(parameter.numel() for parameter in model.parameters())
        base = weights - sum(parameter.numel() for name, parameter in model.named_parameters() if ".lora_" in name)
        added, rss_added = _parameters_alive() - before, _rss() - rss_before
        base_bytes = 4 * base
        if lora_rank:  # the training model and its adapters, nothing more
            assert trainer.preference is not None and trainer.preference.reference.copy is None
            assert added == weights
            assert rss_added < 1.5 * base_bytes, (rss_added, base_bytes)
        else:  # a full fine-tune keeps a frozen copy: the count and the RSS see it
            assert added == weights + base
            assert rss_added > 1.8 * base_bytes, (rss_added, base_bytes)
        trainer.fit()
        del trainer, model
    gc.collect()


def test_a_dpo_run_resumes_exactly_from_its_own_copy_of_the_reference(tmp_path, qwen):
    source = shutil.copytree(qwen, tmp_path / "models" / "qwen2-tiny")
    flags = [f"--init_from={source}", *DPO, "--max_steps=8", "--save_steps=4", "--gradient_accumulation_steps=2",
             "--learning_rate=3e-3", "--output_dir=run"]
    reference, stopped = traced_and_stopped_runs(preference_project, tmp_path, flags, ENV, stop_after=4)
    source.rename(source.with_name("moved-away"))  # the resume reads only the run folder
    # The frozen reference is the run's copy of the model it started from: one that changed since is refused.
    base_file = stopped / "run" / BASE_DIR / "model.safetensors"
    original = base_file.read_bytes()
    changed = bytearray(original)
    changed[-4:] = bytes(4)
    base_file.write_bytes(bytes(changed))
    refused = run_command(["train", *flags, "--is_keep_training=True"], cwd=stopped, env=ENV)
    assert refused.returncode == 2 and "changed since the run started" in refused.stderr, refused.stderr[-3000:]
    assert "its reference" in refused.stderr and "Traceback" not in refused.stderr
    assert sorted(path.name for path in (stopped / "run").glob("checkpoint-*")) == ["checkpoint-4"]  # nothing lost

    base_file.write_bytes(original)
    resumed = run_command(["train", *flags, "--is_keep_training=True"], cwd=stopped,
                          env={**ENV, "LOWMEM_TRACE_DIR": str(stopped / "trace")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_from(resumed.stderr) == 4
    assert_losses_match(traced_losses(stopped / "trace"), traced_losses(reference / "trace"), 4)


@pytest.mark.parametrize("case, says", [
    ("no_rejected", "rejected"),
    ("held_out_without_rejected", "valid.parquet' has no column 'rejected'"),
    ("no_model", "--init_from=PATH"),
])
def test_preference_training_asked_wrongly_is_refused_in_one_paragraph(tmp_path, qwen, case, says):
    import pyarrow.parquet as pq

    project = preference_project(tmp_path)
    flags = [*DPO, "--max_steps=2", "--output_dir=run"]
    if case != "no_model":  # a file without its answers not preferred: refused before anything is written
        name = "train" if case == "no_rejected" else "valid"
        table = pq.read_table(project / "data" / f"{name}.parquet").drop(["rejected"])
        pq.write_table(table, project / "data" / f"{name}.parquet")
        flags.append(f"--init_from={qwen}")
    done = run_command(["train", *flags], cwd=project, env=ENV)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not (project / "run").exists()  # nothing written, nothing lost
    assert (project / "data" / "train.parquet").is_file()


@pytest.mark.slow
def test_adapters_dpo_on_three_processes_resumes_on_one_training_each_pair_once(tmp_path, qwen):
    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate launcher is not on PATH")
    project = preference_project(tmp_path)
    flags = [f"--init_from={qwen}", *DPO, "--lora_rank=4", "--learning_rate=1e-2", "--epochs=1", "--output_dir=run"]
    launcher = ["accelerate", "launch", "--multi_gpu", "--num_processes", "3", "--main_process_port", "0"]
    env = {**ENV, "ACCELERATE_USE_CPU": "1"}
    first = run_command(["train", *flags], cwd=project, launcher=launcher,
                        env={**env, "LOWMEM_TRACE_DIR": str(project / "trace3"), "LOWMEM_STOP_AFTER_STEP": "5"})
    assert first.returncode == 0 and "at step 5" in first.stderr, first.stderr[-3000:]
    resumed = run_command(["train", *flags, "--is_keep_training=True"], cwd=project,
                          env={**env, "LOWMEM_TRACE_DIR": str(project / "trace1")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_from(resumed.stderr) == 5 and "Resuming on 1 process(es)" in resumed.stderr
    # Each pair is two sequences (its chosen and its rejected answer): each is trained on once in the epoch.
    seen = [row for trace in ("trace3", "trace1") for path in sorted((project / trace).glob("trace-rank*.json"))
            for row in json.loads(path.read_text())["rows"]]
    assert len(seen) == len(set(seen)), "a pair was trained on twice"
    assert 2 * (400 - 3 * 8) <= len(seen) <= 2 * 400  # at most a short last step of each process left out
    assert len(json.loads((project / "trace3" / "trace-rank0.json").read_text())["rows"]) == 5 * 2 * 8
    losses = traced_losses(project / "trace1")
    assert min(losses) == 6 and all(math.isfinite(loss) for loss in losses.values())


@pytest.mark.over_a_minute("three launches of three FSDP2 processes and a reference pass: 25 CPU-s alone on the 2-core "
                           "machine, longer beside the other worker")
def test_precomputed_values_under_fsdp2_in_bf16_start_the_run_at_ln_2(tmp_path, qwen):
    """Three gloo processes, FSDP2's bf16 policy: a reference pass under the same launcher computes as the sharded
    policy does (bf16 blocks handing float32 on), so step 0's loss is ln 2; values computed in one process (bf16
    autocast: a float32 residual stream) are used with a warning, and start the run away from it. beta 1 (not 0.1)
    so that a difference in the numerics shows in the loss beyond the tolerance."""
    project = preference_project(tmp_path)
    common = [f"--init_from={qwen}", "--max_seq_len=64", "--bf16_on_cpu=True"]
    data = ["--train_file=data/train.parquet", "--validation_file=data/valid.parquet"]
    flags = ["train", *common, *DPO, "--dpo_reference=precomputed", "--dpo_beta=1", "--max_steps=1",
             "--train_file=data/train.reference", "--validation_file=data/valid.reference"]
    record = project / "data" / "train.reference" / "_reference.json"
    first_losses, reference_values = {}, {}
    for launch in ("fsdp", "one process"):
        shutil.rmtree(project / "data" / "train.reference", ignore_errors=True)
        shutil.rmtree(project / "data" / "valid.reference", ignore_errors=True)
        # The one-process values in a process of their own: computed with FSDP_CPU_ENV's one thread, as the ranks
        # compute, whatever threads the test's process has.
        written = (run_command if launch == "fsdp" else run_in_own_process)(
            ["dpo_reference", *common, *data], cwd=project, env=FSDP_CPU_ENV,
            launcher=FSDP_LAUNCHER if launch == "fsdp" else None)
        assert written.returncode == 0, written.stderr[-3000:]
        precision = json.loads(record.read_text())["precision"]
        assert precision == ("bf16 under FSDP2" if launch == "fsdp" else "bf16 autocast")
        reference_values[launch] = _reference_values(project / "data" / "train.reference")
        trace = project / f"trace-{launch}"
        done = run_command([*flags, f"--output_dir=run-{launch}"], cwd=project, launcher=FSDP_LAUNCHER,
                           env={**FSDP_CPU_ENV, "LOWMEM_TRACE_DIR": str(trace)})
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Parallelism: FSDP2, 3 processes" in done.stdout + done.stderr and "mixed precision: bf16" in done.stderr
        warnings = done.stderr.count("were computed in bf16 autocast, and this run computes in bf16 under FSDP2")
        assert warnings == (0 if launch == "fsdp" else 2)  # once for each folder, by the main process
        first_losses[launch] = traced_losses(trace)[1]
    # The same numerics give the same bits, row by row: only the float32 sums of the loss round.
    assert first_losses["fsdp"] == pytest.approx(math.log(2), abs=1e-6)
    # The other numerics move each row's values; the first step's mean over its rows may land near ln 2 or not (the
    # rows' differences take either sign), so the values themselves are compared.
    rows = reference_values["fsdp"].keys()
    assert rows == reference_values["one process"].keys()
    moved = [abs(a - b) for row in rows
             for a, b in zip(reference_values["fsdp"][row], reference_values["one process"][row])]
    print(f"one process against fsdp: mean {sum(moved) / len(moved):.2e}, largest {max(moved):.2e} nats; first "
          f"losses {first_losses}")
    assert sum(moved) / len(moved) > 1e-3, (sum(moved) / len(moved), first_losses)


def _reference_values(folder: Path) -> dict[tuple[str, str, str], tuple[float, float]]:
    """(prompt, chosen, rejected) → (reference_chosen, reference_rejected) of every row a reference pass wrote."""
    import pyarrow.parquet as pq

    values = {}
    for part in sorted(folder.glob("part-*.parquet")):
        table = pq.read_table(part).to_pydict()
        for prompt, chosen, rejected, reference_chosen, reference_rejected in zip(
                table["prompt"], table["chosen"], table["rejected"], table["reference_chosen"],
                table["reference_rejected"]):
            values[(prompt, chosen, rejected)] = (float(reference_chosen), float(reference_rejected))
    return values


REFERENCE_KINDS = {"adapters": ["--lora_rank=8"], "copy": ["--dpo_reference=copy"],
                   "precomputed": ["--dpo_reference=precomputed", "--train_file=data/train.reference",
                                   "--validation_file=data/valid.reference"]}


@pytest.mark.over_a_minute("inductor compiles the policy and its reference twice each, for the first batch's width "
                           "and then for dynamic shapes, and the run is trained again eagerly to compare")
@pytest.mark.parametrize("kind", sorted(REFERENCE_KINDS))
def test_dpo_trains_under_compile_with_the_eager_runs_losses(tmp_path, qwen_one_block, kind):
    """Each kind of reference, compiled: the rows' answer sums are taken within each row's span (inductor could not
    generate the scatter the sums were once added by), the batches of varying widths compile for dynamic shapes,
    and the losses are the eager run's. The model has one block: inductor compiles each of its graphs twice."""
    qwen = qwen_one_block
    project = preference_project(tmp_path)
    if kind == "precomputed":
        written = run_command(["dpo_reference", f"--init_from={qwen}", "--train_file=data/train.parquet",
                               "--validation_file=data/valid.parquet", "--max_seq_len=64"], cwd=project, env=ENV)
        assert written.returncode == 0, written.stderr[-3000:]
    flags = [f"--init_from={qwen}", *DPO, *REFERENCE_KINDS[kind], "--max_steps=4", "--learning_rate=1e-2"]
    losses = {}
    for compiled in ("False", "True"):
        done = run_command(["train", *flags, f"--compile={compiled}", f"--output_dir=run-{compiled}"], cwd=project,
                           env={**ENV, "LOWMEM_TRACE_DIR": str(project / f"trace-{compiled}")})
        assert done.returncode == 0, done.stderr[-3000:]
        losses[compiled] = traced_losses(project / f"trace-{compiled}")
    assert "compile=on" in done.stderr and sorted(losses["True"]) == list(range(1, 5))
    assert "for dynamic shapes (batches shaped to fit)" in done.stderr
    for step, loss in losses["False"].items():
        assert losses["True"][step] == pytest.approx(loss, abs=1e-4), step
