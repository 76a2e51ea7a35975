"""The GPU commands: `gpu_check` (every GPU path in one command) and `gpu_bundle` (what a GPU machine without
network needs to run it)."""

from __future__ import annotations

import sys
from pathlib import Path

from lowmem.cli.common import comma_separated


def gpu_check(device: str = "", folder: str = "gpu_check", results: str = "", stages: str = "",
              stage_minutes: float = 8.0) -> None:
    """Check every GPU path of the project in one go, stage by stage, each ending with PASS, FAIL or SKIP.

    1 environment: torch, CUDA, the GPUs and their bf16, the host's RAM and its cgroup limit.
    2-7 the code paths: source_logits (a transformers Qwen2 loaded onto the device, logits against transformers'),
      dpo_compile (DPO on adapters compiled: at most 3 graphs over 6 batch widths, no break, eager's values),
      flex_attention (FlexAttention against SDPA, eager and compiled, two shapes; on a GPU every gradient, with
      activation checkpointing), fsdp_dpo (a one-process FSDP2 group in bf16: adapters, the reference with them off,
      ln 2 from int32 reference bits), pinned_copy (pinned against pageable host-to-GPU copies), trainer_dpo (a
      short DPO run on adapters: ln 2 at step 1, peft's files in final/).
    8-10 the step's paths: fused_clip (clipping in the fused AdamW against torch's, a NaN step skipped), ddp_hook (a
      one-process DDP group with the bf16 all-reduce hook), copy_reference (the bf16 frozen copy's log-probabilities
      against the policy's).
    11 train: the demo config in bf16 for 200 steps; a second run killed (SIGKILL) after a save and resumed must
      log the same later losses (within a tolerance said in the results).
    12 bench: bench_train --use_large_config=True, eager and compiled: tokens/s, MFU, data wait, peak GPU
      memory, host high-water per process, and lowmem's step against a plain PyTorch loop's on the same batches.
    13 speed: the users' command (train --use_large_config=True, its defaults) for 600 steps: tokens/s, MFU and
      GPU peak from its log lines, the micro-batches chosen; bench_attention at 4,096 tokens.
    14 parallel: as many processes as GPUs under DDP, FSDP2 and (where deepspeed imports) DeepSpeed ZeRO-2
      offload: a few steps, a save, a SIGKILL, a resume.
    15 memory_log: the train stage's memory log read back: FLAT on every rank, CUDA figures present.
    A failed stage does not stop the next. Each verdict also goes to the results file as a JSON line. The exit
    code is 1 when a stage failed.

    Args:
        device: cuda (the default where a GPU is visible) or cpu: the same stages, reduced (a small model, two
            processes on gloo, bf16 through --bf16_on_cpu), in a few minutes.
        folder: where the check's runs go (cleared when the check runs again).
        results: the JSON-lines file of verdicts and figures (default: FOLDER/results.jsonl).
        stages: a comma-separated subset, e.g. train,memory_log (default: all fifteen, in order).
        stage_minutes: the most one stage may take.
    """
    import torch

    from lowmem.errors import ConfigError
    from lowmem.gpucheck.check import run_check
    from lowmem.gpucheck.stages import STAGES, CheckSettings

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device={device!r}: choose cuda or cpu.")
    names = comma_separated(stages)
    settings = CheckSettings(device=device, folder=Path(folder).resolve(),
                             gpus=torch.cuda.device_count() if device == "cuda" else 0,
                             stage_seconds=stage_minutes * 60)
    results_path = Path(results) if results else settings.folder / "results.jsonl"
    outcome = run_check(settings, results_path, names or list(STAGES), sys.stdout)
    if any(result.verdict == "FAIL" for result in outcome):
        raise SystemExit(1)


def gpu_bundle(out: str = "gpu_bundle", packages: str = "fire") -> None:
    """Build what a GPU machine without network needs to run `gpu_check`: the project as a wheel, the packages
    its image lacks as wheels (with the packages they need), and install_and_check.sh, which installs them
    over the machine's own torch (pip --no-index --no-deps) and runs the check.

    On the GPU machine: `bash gpu_bundle/install_and_check.sh` (flags after it go to gpu_check).

    Args:
        out: the bundle's folder (made anew).
        packages: comma-separated installed distributions to carry besides the project, each with what it
            requires; pure Python (or abi3) only, as the GPU machine's Python may be another version.
    """
    from lowmem.gpucheck.bundle import build_bundle

    bundle = build_bundle(Path(out), comma_separated(packages))
    print(bundle.describe())
