"""FSDP2 end to end on the CPU: 3 processes on gloo, started the way users start it,

    accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 3 --main_process_port 0 \
        train_low_mem.py train ...

with the training code, checkpoints and evaluation that FSDP runs on GPUs. Accelerate alone would run DDP
there (it builds FSDP on accelerators only); `lowmem.distributed.accelerator.fsdp_on_cpu` makes it FSDP.
A run killed with SIGKILL after a save and resumed trains the same rows with the same losses as an
uninterrupted one, and its checkpoints keep the optimizer state sharded, one file per rank.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from gloo_ranks import free_port, start_ranks
from training_helpers import chat_data as chat_data  # the resume tests' data, made once per module
from training_helpers import (FSDP_CONFIG, FSDP_CPU_ENV as CPU_ENV, FSDP_LAUNCHER, assert_losses_match, kill_all,
                              resumed_from, start_run, traced_losses, traced_run, wait_for_step)

EXTRA = ("--epochs=1", "--save_steps=5")  # 19 steps with 3 ranks, a save every 5
STRATEGY_LINE = "Parallelism: FSDP2, 3 processes."

WORLD = 3
needs_launcher = pytest.mark.skipif(shutil.which("accelerate") is None, reason="the accelerate launcher is not on PATH")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, chat_data):
    """An uninterrupted FSDP run: its output, trace folder and run folder."""
    folder = tmp_path_factory.mktemp("fsdp-reference")
    done, trace = traced_run(folder, chat_data, env=CPU_ENV, extra=EXTRA, launcher=FSDP_LAUNCHER)
    return done, trace, folder / "run"


@pytest.mark.slow
@needs_launcher
@pytest.mark.over_a_minute("a launch of three FSDP2 processes killed mid-run and its resume, against a reference run "
                           "of its own (the module's fixture)")
def test_fsdp_on_three_cpu_processes_resumes_exactly_after_sigkill(tmp_path, chat_data, reference):
    _, reference_trace, _ = reference
    process = start_run(tmp_path, chat_data, env={**CPU_ENV, "LOWMEM_TEST_STEP_SECONDS": "0.05"},
                        launcher=FSDP_LAUNCHER, extra=EXTRA)
    wait_for_step(process, 11)  # after the save at step 10
    kill_all(process)
    resumed, trace = traced_run(tmp_path, chat_data, env=CPU_ENV, extra=[*EXTRA, "--is_keep_training=True"],
                                launcher=FSDP_LAUNCHER)
    assert STRATEGY_LINE in resumed.stderr
    start = resumed_from(resumed.stderr)
    assert start in (10, 15), "resumed from the last save before the kill (10, or 15 if the kill landed late)"
    for rank in range(3):
        expected = json.loads((reference_trace / f"trace-rank{rank}.json").read_text())
        got = json.loads((trace / f"trace-rank{rank}.json").read_text())
        # No row twice, none left out: each rank's rows after the resume are the reference's last ones.
        assert len(got["rows"]) > 0 and got["rows"] == expected["rows"][-len(got["rows"]):], rank
        assert got["steps"] == expected["steps"]
        # Bit for bit, unlike DDP (whose gradient buckets are rebuilt after a process's first step, so a resumed
        # run adds in another order): FSDP2 reduces each unit's gradients in the same order in every run, and
        # the weights and optimizer state come back exactly.
        assert got["weights"] == expected["weights"], rank
    assert_losses_match(traced_losses(trace), traced_losses(reference_trace), start)


PICKLE_MAGIC = b"\x80"  # the first byte of every pickle (protocol 2 and later), torch.save's zip files aside


@pytest.mark.slow
@needs_launcher
def test_fsdp_checkpoints_are_each_ranks_shards_and_hold_no_pickle(reference):
    """No rank gathered the model or its optimizer state to save them: each wrote its own rows of every weight and
    moment into a safetensors file, and the main process a JSON index of where they are; nothing is pickled."""
    reference_run, _, run_dir = reference
    assert STRATEGY_LINE in reference_run.stderr, "the log names the strategy that ran"
    checkpoints = sorted(run_dir.glob("checkpoint-*"))
    assert checkpoints, "the run kept no checkpoint"
    for checkpoint in checkpoints:
        assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer").exists()
        assert not list(checkpoint.rglob("*.pt")) and not list(checkpoint.rglob(".metadata")), "a pickled file"
        for folder in ("model_shards", "optimizer_shards"):
            files = sorted(path.name for path in (checkpoint / folder).glob("*.safetensors"))
            assert files == [f"rank{rank:05d}.safetensors" for rank in range(WORLD)], (checkpoint, folder, files)
            index = json.loads((checkpoint / folder / "index.json").read_text())
            assert index["format"] == "lowmem-shards/1" and index["files"] == files
            for name, tensor in index["tensors"].items():
                if tensor["shape"] and tensor["shape"][0] >= WORLD:  # split by rows: a piece in each rank's file
                    assert sorted(piece["file"] for piece in tensor["pieces"]) == files, (name, tensor)
        weights = json.loads((checkpoint / "model_shards" / "index.json").read_text())["tensors"]
        assert "lm_head.weight" in weights and "tok_emb.weight" not in weights, "one name of the tied pair, as DDP's"
        moments = json.loads((checkpoint / "optimizer_shards" / "index.json").read_text())
        assert any(name.endswith("/exp_avg_sq") for name in moments["tensors"])
        assert [group["weight_decay"] for group in moments["param_groups"]] == [0.1, 0.0]


@pytest.mark.slow
@needs_launcher
def test_a_pickle_planted_in_a_sharded_checkpoint_is_never_unpickled(tmp_path, chat_data, reference):
    """A pickle planted as torch.distributed.checkpoint's metadata beside the shards (its marker's CRC too) is never
    read: the resume goes on and the command never runs; a shard replaced by a pickle stops the resume on every rank
    with one message naming the file; `evaluate`, `generate` and `export` read the shards as data too."""
    import pickle

    from checkpoint_tampering import Planted, replace_as_saved
    from training_helpers import resume_overrides, run_command

    _, _, run_dir = reference
    shutil.copytree(run_dir.parent / "tok", tmp_path / "tok")
    shutil.copytree(run_dir, tmp_path / "run")
    checkpoint = max((tmp_path / "run").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    ran = tmp_path / "the-command-ran"
    for folder in ("model_shards", "optimizer_shards"):
        replace_as_saved(checkpoint / folder / ".metadata", pickle.dumps(Planted(ran)))
    args = ["train", *resume_overrides(tmp_path, chat_data, *EXTRA, "--is_keep_training=True",
                                       f"--resume_from_checkpoint={checkpoint}")]
    common = [f"--output_dir={tmp_path / 'run'}", f"--tokenizer_dir={tmp_path / 'tok'}", f"--checkpoint={checkpoint}"]
    for command in (["evaluate", *common, f"--test_file={chat_data[1]}", "--bleu_samples=2"],
                    ["generate", *common, "--prompt=春风", "--max_new_tokens=4"],
                    ["export", str(tmp_path / "exported"), *common]):
        done = run_command(command, cwd=tmp_path, env=CPU_ENV)
        assert done.returncode == 0, (command[0], done.stderr[-2000:])
    resumed = run_command(args, cwd=tmp_path, env=CPU_ENV, launcher=FSDP_LAUNCHER)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from {checkpoint}" in resumed.stderr
    assert not ran.exists(), "a planted pickle was unpickled"

    shard = checkpoint / "optimizer_shards" / "rank00001.safetensors"
    replace_as_saved(shard, pickle.dumps({"state": Planted(ran)}))
    refused = run_command(args, cwd=tmp_path, env=CPU_ENV, launcher=FSDP_LAUNCHER)
    assert refused.returncode != 0
    assert f"'{shard}' is not a readable safetensors file" in refused.stderr, refused.stderr[-3000:]
    assert not re.search(r'File ".*/lowmem/', refused.stderr), refused.stderr[-3000:]
    assert not ran.exists(), "a planted pickle was unpickled"


@pytest.mark.slow
@needs_launcher
def test_a_damaged_shard_sets_its_checkpoint_aside_and_the_resume_falls_back(tmp_path, chat_data, reference):
    """One byte of one rank's weights shard flipped: the completeness marker's CRC finds it, the checkpoint is moved
    aside as any damaged one is, and the run resumes from the newest intact checkpoint."""
    from training_helpers import resume_overrides, run_command

    _, _, run_dir = reference
    shutil.copytree(run_dir.parent / "tok", tmp_path / "tok")
    shutil.copytree(run_dir, tmp_path / "run")
    newest, older = sorted((tmp_path / "run").glob("checkpoint-*"), key=lambda path: -int(path.name.split("-")[1]))[:2]
    shard = newest / "model_shards" / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # a value's byte: the header still reads
    shard.write_bytes(bytes(data))
    resumed = run_command(["train", *resume_overrides(tmp_path, chat_data, *EXTRA, "--is_keep_training=True")],
                          cwd=tmp_path, env=CPU_ENV, launcher=FSDP_LAUNCHER)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(rf"Damaged checkpoint \S*{newest.name} moved to", resumed.stderr), resumed.stderr[-3000:]
    assert resumed_from(resumed.stderr) == int(older.name.split("-")[1])


# ----- loading the weights: the main process reads the file --------------------------------------------------
def fsdp_launch_environment() -> dict[str, str]:
    """The variables `accelerate launch --config_file configs/accelerate/fsdp.yaml` sets for its processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(FSDP_CONFIG), "--num_processes", str(WORLD),
                                               "train_low_mem.py", "train"])
    args, _, _ = _validate_launch_command(args)
    launched = prepare_multi_gpu_env(args)
    return {name: value for name, value in launched.items() if os.environ.get(name) != value}


def prepared_gpt(seed: int, accelerator):
    from lowmem.config import OptimConfig
    from lowmem.distributed.strategy import prepare_model_and_optimizer
    from lowmem.model import GPT, GPTConfig

    torch.manual_seed(seed)  # the same weights on every rank
    model = GPT(GPTConfig(vocab_size=96, max_seq_len=16, n_layer=2, n_head=2, n_embd=32))
    return prepare_model_and_optimizer(model, OptimConfig(), accelerator)


def moments(optimizer) -> list[torch.Tensor]:
    """This rank's shard of every AdamW moment, in parameter order."""
    inner = optimizer.optimizer
    return [inner.state[p][key].to_local() for group in inner.param_groups for p in group["params"]
            for key in ("exp_avg", "exp_avg_sq")]


def save_legacy_layout(folder: Path, model, optimizer, accelerator) -> None:
    """An FSDP checkpoint as the earlier version wrote it: the weights gathered into one model.safetensors by the main
    process, the optimizer state through torch.distributed.checkpoint (a pickled .metadata beside its shards)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lowmem.distributed.strategy import full_model_state, save_distributed
    from lowmem.model.weights import save_weights, uncompiled

    state = full_model_state(model, accelerator)
    if accelerator.is_main_process:
        save_weights(state, folder / "model.safetensors")
    save_distributed({"optimizer": get_optimizer_state_dict(uncompiled(model), optimizer.optimizer)},
                     folder / "optimizer")


def load_worker(rank: int, port: int, folder: Path, launch_env: dict[str, str]) -> None:
    """Train a step and save it in both layouts; load each into a model with other weights, where only rank 0 may
    read a whole weights file; then load from a checkpoint of the earlier layout whose weights file is missing."""
    import safetensors.torch

    from lowmem.distributed.accelerator import create_accelerator
    from lowmem.distributed.strategy import (describe, full_model_state, load_model_and_optimizer,
                                             save_model_and_optimizer)
    from lowmem.errors import CheckpointError
    from lowmem.model.weights import unwrap

    os.environ.update({**launch_env, **CPU_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    accelerator = create_accelerator(1, bf16=True, process_group_timeout_minutes=2)
    model, optimizer = prepared_gpt(0, accelerator)
    tokens = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(rank))  # (B, T)
    _, loss = model(tokens, tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    sharded, legacy = folder / "sharded", folder / "legacy"
    for path in (sharded, legacy):
        path.mkdir(exist_ok=True)
    save_model_and_optimizer(sharded, model, optimizer, accelerator)
    save_legacy_layout(legacy, model, optimizer, accelerator)
    accelerator.wait_for_everyone()
    saved = full_model_state(model, accelerator, on_every_rank=True)

    read_whole = safetensors.torch.load_file
    if rank != 0:
        def refuse(*args, **kwargs):
            raise AssertionError(f"rank {rank} read a whole weights file")
        safetensors.torch.load_file = refuse
    results = {}
    for layout, checkpoint in (("sharded", sharded), ("legacy", legacy)):
        restored, restored_optimizer = prepared_gpt(1, accelerator)
        load_model_and_optimizer(checkpoint, restored, restored_optimizer, accelerator)
        loaded = full_model_state(restored, accelerator, on_every_rank=True)
        results[layout] = {
            "same_names": sorted(loaded) == sorted(saved),
            "same_weights": all(torch.equal(loaded[name], saved[name]) for name in saved),
            "same_moments": all(torch.equal(a, b) for a, b in zip(moments(optimizer), moments(restored_optimizer)))}
    safetensors.torch.load_file = read_whole

    missing = folder / "missing"  # an FSDP checkpoint of the earlier layout without its weights file
    (missing / "optimizer").mkdir(parents=True, exist_ok=True)
    try:
        load_model_and_optimizer(missing, restored, restored_optimizer, accelerator)
        error = ""
    except CheckpointError as raised:
        error = str(raised)
    result = {"strategy": describe(accelerator), "device": accelerator.device.type, **results,
              "head_in_embedding": unwrap(restored).head_in_embedding, "names": sorted(saved), "error": error}
    (folder / f"rank{rank}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    # The FSDP2 modules and optimizers hold the process group (their mesh's): let go of them and destroy the group
    # here, while the interpreter is whole. Left to the interpreter's exit, gloo's threads are torn down with it,
    # and a work item they still hold frees its tensors without the interpreter (SIGABRT, "terminate called without
    # an active exception").
    del model, optimizer, restored, restored_optimizer, saved
    gc.collect()
    torch.distributed.destroy_process_group()


@pytest.mark.filterwarnings("ignore")
def test_fsdp_checkpoints_of_both_layouts_load_exactly(tmp_path):
    """A sharded checkpoint loads each rank's rows of the weights and moments; one of the earlier layout (whole
    weights, torch.distributed.checkpoint's optimizer state) still loads exactly, rank 0 reading its weights file and
    broadcasting them a parameter at a time (the others never open it); tied lm_head/tok_emb included (one name in the
    files, computed through the embedding's unit); a weights file rank 0 cannot read fails on every rank with a
    message instead of leaving the others waiting in the broadcast."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    start_ranks(load_worker, (free_port(), checkpoint, fsdp_launch_environment()), WORLD)
    for rank in range(WORLD):
        result = json.loads((checkpoint / f"rank{rank}.json").read_text())
        assert result["strategy"] == "FSDP2, 3 processes" and result["device"] == "cpu", result
        for layout in ("sharded", "legacy"):
            assert all(result[layout].values()), (rank, layout, result)
        assert result["head_in_embedding"], rank
        assert "lm_head.weight" in result["names"] and "tok_emb.weight" not in result["names"]
        assert "The main process could not read" in result["error"] and "model.safetensors" in result["error"]
