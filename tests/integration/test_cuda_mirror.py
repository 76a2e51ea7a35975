"""`--mirror_cuda=True`: the CPU takes every automatic setting as a CUDA GPU would (torch.compile, fixed batch shapes
for packed rows, bf16 autocast, the bf16 frozen copy), so that the code a GPU runs is run here first. Each stage
trains a few steps plain (float32, eager) and mirrored, on one process and on three (DDP on gloo, with the bf16
all-reduce hook), and the mirrored losses follow the plain ones within bf16's rounding. FSDP2's bf16 policy on three
processes: tests/integration/test_preference_training.py (the precomputed reference starting at ln 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("transformers")

from hf_models import qwen_one_block as qwen_one_block  # noqa: E402  (the fixture)
from training_helpers import (chat_project, preference_project, run_command, three_cpu_processes,  # noqa: E402
                              traced_losses)

STEPS = 4
COMMON = [f"--max_steps={STEPS}", "--logging_steps=1", "--warmup_steps=1", "--batch_size_per_gpu=8", "--save_steps=50",
          "--eval_steps=50", "--eval_bleu_samples=0", "--sample_max_new_tokens=4"]
DPO = ["--objective=dpo", "--max_seq_len=64", "--learning_rate=1e-3"]
# stage: (the project it trains in, its flags; "{qwen}" is the tiny transformers model it starts from, of one block)
STAGES: dict[str, tuple[Callable[[Path], Path], list[str]]] = {
    # 48 tokens: the rows pack into two fixed batch shapes (7 and 8 sequences), each compiled before the first step;
    # at 64 they took three. One block, as the model the other stages start from (`qwen_one_block`).
    "pretrain": (chat_project, ["--vocab_size=400", "--n_layer=1", "--n_head=2", "--n_embd=32", "--max_seq_len=48",
                                "--learning_rate=3e-3"]),
    "lora": (chat_project, ["--init_from={qwen}", "--lora_rank=4", "--learning_rate=5e-3", "--max_seq_len=64"]),
    "dpo-adapters": (preference_project, ["--init_from={qwen}", *DPO, "--lora_rank=8"]),
    "dpo-copy": (preference_project, ["--init_from={qwen}", *DPO, "--dpo_reference=copy"]),
    "dpo-precomputed": (preference_project, ["--init_from={qwen}", *DPO, "--dpo_reference=precomputed",
                                             "--train_file=data/train.reference",
                                             "--validation_file=data/valid.reference"]),
}


def _bf16_close(mirrored: float, plain: float) -> bool:
    """Within bf16's rounding of a few steps: 2% of the loss, and a hundredth of a nat."""
    return abs(mirrored - plain) <= 0.02 * abs(plain) + 0.01


@pytest.mark.over_a_minute("on three processes each compiles the model with inductor, and the plain run trains the "
                           "stage again")
@pytest.mark.parametrize("processes, stage", [(count, stage) for count in (1, 3) for stage in STAGES],
                         ids=lambda value: str(value))
def test_the_cuda_mirror_trains_each_stage_as_the_plain_cpu_run_does(tmp_path, qwen_one_block, processes, stage):
    make_project, stage_flags = STAGES[stage]
    project = make_project(tmp_path)
    qwen = qwen_one_block
    flags = [flag.replace("{qwen}", str(qwen)) for flag in stage_flags]
    env = {"OMP_NUM_THREADS": "1", **({"ACCELERATE_USE_CPU": "1"} if processes > 1 else {})}
    if stage == "dpo-precomputed":  # mirrored: computed under bf16 autocast, as the mirrored run trains
        for mirror in ("False", "True"):
            folder = project / "mirror" if mirror == "True" else project
            if mirror == "True":
                (folder / "data").mkdir(parents=True)
                for name in ("train", "valid"):
                    (folder / "data" / f"{name}.parquet").symlink_to(project / "data" / f"{name}.parquet")
            written = run_command(["dpo_reference", f"--init_from={qwen}", "--max_seq_len=64",
                                   f"--mirror_cuda={mirror}", "--train_file=data/train.parquet",
                                   "--validation_file=data/valid.parquet"], cwd=folder, env=env)
            assert written.returncode == 0, written.stderr[-3000:]
    losses = {}
    for mirror in ("False", "True"):
        folder = project / "mirror" if stage == "dpo-precomputed" and mirror == "True" else project
        launcher = three_cpu_processes(tmp_path / f"ranks-{mirror}") if processes > 1 else None
        extra = ["--ddp_bf16_gradients=True"] if processes > 1 and mirror == "True" else []
        done = run_command(["train", *COMMON, *flags, *extra, f"--mirror_cuda={mirror}", f"--output_dir=run-{mirror}"],
                           cwd=folder, launcher=launcher,
                           env={**env, "LOWMEM_TRACE_DIR": str(folder / f"trace-{mirror}")})
        assert done.returncode == 0, done.stderr[-3000:]
        output = done.stdout + done.stderr
        if mirror == "True":
            assert "compile=on" in output and "mixed precision: bf16" in output, output[-3000:]
            assert ("fixed batch shapes=on" in output) == (not stage.startswith("dpo"))
            assert "Traceback" not in output
            if processes > 1:
                assert "gradients all-reduced in bf16" in output
            if stage == "dpo-copy":
                assert "frozen copy" in output
        losses[mirror] = traced_losses(folder / f"trace-{mirror}")
    assert sorted(losses["True"]) == list(range(1, STEPS + 1))
    for step, plain in losses["False"].items():
        assert _bf16_close(losses["True"][step], plain), (step, losses)
