"""Adapters (LoRA) trained through the command line on a transformers Qwen2: checkpoints that hold the adapters
only, the base kept once in the run folder, best/ and final/ with the merged model and peft's files (peft and
transformers compute what lowmem does), an exact resume that reads only the run folder, and the refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import qwen as qwen  # noqa: E402  (the fixture)
from training_helpers import (FSDP_CPU_ENV, FSDP_LAUNCHER, assert_losses_match, chat_project,  # noqa: E402
                              resumed_from, run_command, traced_and_stopped_runs, traced_losses)

from lowmem.adapters.files import ADAPTERS_FILE, BASE_DIR  # noqa: E402
from lowmem.checkpoint.export import load_model_folder  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1"}  # one summation order: the resumed losses are compared with the reference's
LORA = ["--lora_rank=4", "--lora_alpha=8", "--max_steps=8", "--batch_size_per_gpu=8", "--save_steps=4",
        "--eval_bleu_samples=0", "--logging_steps=1", "--warmup_steps=2", "--learning_rate=5e-3",
        "--sample_max_new_tokens=8"]


def test_adapters_train_alone_and_leave_a_merged_model_peft_and_transformers_compute(tmp_path, qwen):
    project = chat_project(tmp_path)
    done = run_command(["train", f"--init_from={qwen}", *LORA], cwd=project, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    run = project / "model_save" / "train_lora4_from_qwen2-tiny"
    assert "Adapters (LoRA): rank 4, alpha 8 (scale 2)" in done.stderr
    for checkpoint in sorted(run.glob("checkpoint-*")):  # the adapters and the trainer's state, never the base
        assert (checkpoint / ADAPTERS_FILE).is_file() and not (checkpoint / "model.safetensors").exists()
        assert (checkpoint / ADAPTERS_FILE).stat().st_size < 0.1 * (run / BASE_DIR / "model.safetensors").stat().st_size

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    source = transformers.AutoModelForCausalLM.from_pretrained(qwen).eval()
    base, _ = load_model_folder(run / BASE_DIR, run / "tokenizer", torch.device("cpu"))
    with torch.no_grad():  # the run's copy of its base is the model it started from
        expected_base = source(ids).logits
        assert (base(ids)[0][..., :expected_base.shape[-1]] - expected_base).abs().max().item() <= 1e-5
    final, _ = load_model_folder(run / "final", run / "tokenizer", torch.device("cpu"))
    with torch.no_grad():
        ours = final(ids)[0][..., :expected_base.shape[-1]]
    assert (ours - expected_base).abs().max().item() > 1e-3  # the adapters changed what it computes

    exported = run_command(["export", str(project / "hf"), f"--init_from={qwen}", "--lora_rank=4",
                            f"--adapter_dir={project / 'adapter'}"], cwd=project, env=ENV)
    assert exported.returncode == 0, exported.stderr[-3000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(project / "hf").eval()
    with torch.no_grad():
        assert (merged(ids).logits - ours).abs().max().item() <= 1e-4

    peft = pytest.importorskip("peft")
    config = json.loads((project / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(qwen.resolve())
    with_adapter = peft.PeftModel.from_pretrained(source, str(project / "adapter")).eval()
    with torch.no_grad():
        assert (with_adapter(input_ids=ids).logits - ours).abs().max().item() <= 1e-4


def test_adapters_on_a_model_of_ones_own_come_with_a_base_transformers_loads(tmp_path):
    """A run of adapters started from a lowmem run: its base is no folder transformers reads, so `export
    --adapter_dir` writes it beside the adapters, named in adapter_config.json; peft on it computes the merged model."""
    peft = pytest.importorskip("peft")
    project = chat_project(tmp_path)
    small = ["--vocab_size=400", "--n_layer=2", "--n_head=2", "--n_embd=32", "--max_seq_len=64", "--max_steps=4",
             "--batch_size_per_gpu=8", "--eval_bleu_samples=0", "--sample_max_new_tokens=4", "--save_steps=4"]
    pretrained = run_command(["train", *small, "--output_dir=own"], cwd=project, env=ENV)
    assert pretrained.returncode == 0, pretrained.stderr[-3000:]
    adapters = ["--init_from=own", "--output_dir=lora", "--lora_rank=4", "--learning_rate=5e-2", "--max_steps=4",
                "--batch_size_per_gpu=8", "--eval_bleu_samples=0", "--sample_max_new_tokens=4", "--save_steps=4"]
    trained = run_command(["train", *adapters], cwd=project, env=ENV)
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = run_command(["export", str(project / "hf"), "--output_dir=lora",
                            f"--adapter_dir={project / 'adapter'}"], cwd=project, env=ENV)
    assert exported.returncode == 0, exported.stderr[-3000:]
    config = json.loads((project / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((project / "adapter" / "base").resolve())
    base = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(project / "hf").eval()
    with_adapter = peft.PeftModel.from_pretrained(base, str(project / "adapter")).eval()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = merged(ids).logits
        assert (with_adapter(input_ids=ids).logits - expected).abs().max().item() <= 1e-4
        with with_adapter.disable_adapter():  # the base alone: the adapters changed what it computes
            assert (with_adapter(input_ids=ids).logits - expected).abs().max().item() > 1e-3


def test_a_resume_of_adapters_is_exact_from_the_run_folder_and_refuses_a_changed_base(tmp_path, qwen):
    source = shutil.copytree(qwen, tmp_path / "models" / "qwen2-tiny")
    flags = [f"--init_from={source}", *LORA, "--gradient_accumulation_steps=2", "--dropout=0.1"]
    reference, stopped = traced_and_stopped_runs(chat_project, tmp_path, flags, ENV, stop_after=4)
    source.rename(source.with_name("moved-away"))  # the resume reads only the run folder
    run = stopped / "model_save" / "train_lora4_from_qwen2-tiny"
    # A next stage cannot start from a checkpoint of adapters alone (the run has no best/ yet): it is told how.
    next_stage = run_command(["train", f"--init_from={run}", "--max_steps=2", "--output_dir=next"], cwd=stopped,
                             env=ENV)
    assert next_stage.returncode == 2 and "holds the adapters alone" in next_stage.stderr, next_stage.stderr[-3000:]
    base_file = run / BASE_DIR / "model.safetensors"
    original = base_file.read_bytes()
    changed = bytearray(original)
    changed[-4:] = bytes(4)  # the last weight's last value: the same file, another base
    base_file.write_bytes(bytes(changed))
    refused = run_command(["train", *flags, "--is_keep_training=True"], cwd=stopped, env=ENV)
    assert refused.returncode == 2 and "changed since the run started" in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    assert sorted(path.name for path in run.glob("checkpoint-*")) == ["checkpoint-4"]  # nothing lost

    base_file.write_bytes(original)
    # The same projections spelled otherwise are no change of setting.
    resumed = run_command(["train", *flags, "--is_keep_training=True", "--lora_targets=mlp,attention"], cwd=stopped,
                          env={**ENV, "LOWMEM_TRACE_DIR": str(stopped / "trace")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_from(resumed.stderr) == 4 and "Started from" not in resumed.stderr
    assert "(changed:" not in resumed.stderr
    assert_losses_match(traced_losses(stopped / "trace"), traced_losses(reference / "trace"), 4)


@pytest.mark.parametrize("flags, says", [
    (["--lora_rank=4"], "--init_from=PATH"),
    (["--lora_rank=4", "--lora_targets=c_attn", "INIT"], "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                                        "down_proj"),
    (["--lora_targets=q_proj,v_proj", "INIT"], "no --lora_rank was given"),
])
def test_adapters_asked_wrongly_are_refused_in_one_paragraph(tmp_path, qwen, flags, says):
    project = chat_project(tmp_path)
    flags = [f"--init_from={qwen}" if flag == "INIT" else flag for flag in flags]
    done = run_command(["train", *flags, "--max_steps=2"], cwd=project, env=ENV)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not list((project / "model_save").glob("*/checkpoint-*"))


@pytest.mark.slow
def test_adapters_under_fsdp2_on_three_processes_train_and_resume_exactly(tmp_path, qwen):
    """The adapters sharded with the base by FSDP2: each rank fills its base shards, the checkpoints hold the
    adapters (gathered) and the sharded optimizer state of the adapters, and a stopped run resumes exactly."""
    env = dict(FSDP_CPU_ENV)
    flags = [f"--init_from={qwen}", *LORA, "--batch_size_per_gpu=4"]
    reference = chat_project(tmp_path / "reference")
    done = run_command(["train", *flags], cwd=reference, launcher=FSDP_LAUNCHER,
                       env={**env, "LOWMEM_TRACE_DIR": str(reference / "trace")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Parallelism: FSDP2, 3 processes" in done.stdout + done.stderr
    run = reference / "model_save" / "train_lora4_from_qwen2-tiny"
    last = run / "checkpoint-8"
    assert (last / ADAPTERS_FILE).is_file() and not (last / "model.safetensors").exists()

    stopped = chat_project(tmp_path / "stopped")
    first = run_command(["train", *flags], cwd=stopped, launcher=FSDP_LAUNCHER,
                        env={**env, "LOWMEM_STOP_AFTER_STEP": "4"})
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_command(["train", *flags, "--is_keep_training=True"], cwd=stopped, launcher=FSDP_LAUNCHER,
                          env={**env, "LOWMEM_TRACE_DIR": str(stopped / "trace")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_from(resumed.stdout + resumed.stderr) == 4
    assert_losses_match(traced_losses(stopped / "trace"), traced_losses(reference / "trace"), 4)
