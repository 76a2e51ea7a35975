"""The stages of `lowmem gpu_check`, in the order they run. Each takes the check's settings and returns its
figures, or raises `StageFailed` / `StageSkipped` with the reason.

On a GPU each stage runs what users run (the demo config in bf16, the large config's benchmark, as many
processes as GPUs); with `--device=cpu` the same stages run reduced (a small model, fewer steps, two
processes on gloo, bf16 through `--bf16_on_cpu`), which is how the check itself is tested.
"""

from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lowmem.gpucheck.paths import STAGES as PATH_STAGES
from lowmem.gpucheck.step_paths import STAGES as STEP_STAGES
from lowmem.gpucheck.runs import (Deadline, StageFailed, StageSkipped, fresh_folder, lowmem_command, resumed_from,
                                  run, run_and_kill_after)
from lowmem.program import command_line

# What `configs/accelerate/fsdp.yaml` sets, as launcher flags: the check needs no file from a checkout.
FSDP_FLAGS = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "true",
              "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block",
              "--fsdp_state_dict_type", "SHARDED_STATE_DICT", "--fsdp_offload_params", "false",
              "--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_activation_checkpointing", "false"]
DEEPSPEED_CONFIG = Path("configs") / "accelerate" / "deepspeed_zero2_offload.yaml"

# A resumed run on the CPU repeats the same operations in the same order: the same losses (the log's four
# decimals). On a GPU, atomic adds (the embedding's and attention's backward passes) sum in an order that
# varies from run to run, so two runs are not bitwise equal; such differences, rounded to bf16 (2**-8) and
# carried over a hundred steps, stay far below 2% of the loss, while a resume that lost or repeated data, or
# restored the wrong state, moves it by more.
RESUME_TOLERANCE = {"cpu": 1e-6, "cuda": 2e-2}

# bench_train's rows and its line comparing lowmem's step with a plain PyTorch loop's.
CEILING_ROW = "(a) batches in memory (ceiling)"
PLAIN_LOOP_ROW = "(r) plain PyTorch loop (reference)"
PLAIN_LOOP_RATIO = re.compile(r"\(a\)/\(r\) = (\d+(?:\.\d+)?)")
LOOP_RATIO = re.compile(r"\(t\)/\(r\) = (\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class CheckSettings:
    """Where and how big the check runs."""

    device: str  # "cuda" or "cpu"
    folder: Path  # every run's files go below it
    gpus: int  # GPUs visible (0 on the CPU)
    stage_seconds: float = 480.0

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    def env(self) -> dict[str, str]:
        """The environment of every command: on the CPU, gloo processes of one thread each, no GPU."""
        if self.on_cpu:
            return {"ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        return {}

    @property
    def micro_batch_rows(self) -> int:
        """Rows (pairs, in the DPO run of trainer_dpo) per micro-batch: 2 on the CPU, where bf16 matmuls are emulated,
        tens of times slower than float32, without AVX-512 BF16 or AMX; 8 on a GPU."""
        return 2 if self.on_cpu else 8

    def model_flags(self) -> list[str]:
        """On the CPU a small model on the demo data (`micro_batch_rows` a micro-batch); on a GPU the demo config as
        it is."""
        tokenizer = f"--tokenizer_dir={self.folder / 'tokenizer'}"
        if not self.on_cpu:
            return [tokenizer]
        return [tokenizer, "--n_layer=2", "--n_head=2", "--n_embd=64", "--max_seq_len=128",
                f"--batch_size_per_gpu={self.micro_batch_rows}", "--eval_batches=2", "--eval_bleu_samples=8",
                "--eval_max_new_tokens=16", "--sample_max_new_tokens=16", "--warmup_steps=5"]

    def precision_flags(self) -> list[str]:
        """bf16: the default on a GPU that has it; asked for on the CPU."""
        return ["--bf16_on_cpu=True"] if self.on_cpu else []

    @property
    def train_steps(self) -> int:
        return 100 if self.on_cpu else 200

    @property
    def save_steps(self) -> int:
        return 25 if self.on_cpu else 50

    @property
    def memory_log_steps(self) -> int:
        return 4 if self.on_cpu else 10

    @property
    def processes(self) -> int:
        return 2 if self.on_cpu else max(1, self.gpus)


Stage = Callable[[CheckSettings], dict[str, Any]]


# ----- 1. environment -----------------------------------------------------------------------------------------
def environment(settings: CheckSettings) -> dict[str, Any]:
    """Versions, the GPUs and their bf16, the host's RAM and its cgroup's limit."""
    import accelerate
    import psutil
    import torch

    from lowmem.distributed.accelerator import bf16_supported
    from lowmem.memory.budget import budget_source, read_cgroup_limit_bytes

    gpus = [{"name": torch.cuda.get_device_name(index),
             "memory_gb": round(torch.cuda.get_device_properties(index).total_memory / 2**30, 1),
             "capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
             "bf16": bf16_supported(torch.device("cuda", index))}
            for index in range(torch.cuda.device_count())]
    limit = read_cgroup_limit_bytes()
    figures = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "accelerate": accelerate.__version__, "gpus": gpus, "cpu_cores": os.cpu_count(),
               "host_ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
               "cgroup_limit_gb": None if limit is None else round(limit / 2**30, 1), "budget_source": budget_source()}
    if not settings.on_cpu and not gpus:
        raise StageFailed("no GPU is visible to torch (torch.cuda.device_count() is 0): check the driver and "
                          f"CUDA_VISIBLE_DEVICES, or run `{command_line('gpu_check --device=cpu')}`")
    return figures


# ----- 2. train: bf16, SIGKILL after a save, resume -----------------------------------------------------------
def train(settings: CheckSettings) -> dict[str, Any]:
    """The demo config in bf16: an uninterrupted run, and one killed after a save and resumed, whose later
    losses must match the uninterrupted run's."""
    deadline = Deadline(settings.stage_seconds)
    folder = settings.folder / "train"
    args = ["train", "--output_dir=run", f"--max_steps={settings.train_steps}",
            f"--save_steps={settings.save_steps}", "--logging_steps=1",
            f"--memory_log_steps={settings.memory_log_steps}", *settings.model_flags(), *settings.precision_flags()]
    reference_folder, resumed_folder = fresh_folder(folder / "reference"), fresh_folder(folder / "resumed")
    reference = run(lowmem_command(args), reference_folder, settings.env(), deadline)
    if reference.returncode != 0:
        raise StageFailed(f"the uninterrupted run failed (exit code {reference.returncode}): {reference.tail()}")
    precision = "bf16" if "mixed precision: bf16" in reference.stderr else "float32"
    kill_at = 2 * settings.save_steps + 1
    run_and_kill_after(lowmem_command(args), resumed_folder, settings.env(), deadline, kill_at)
    resumed = run(lowmem_command([*args, "--is_keep_training=True"]), resumed_folder, settings.env(), deadline)
    if resumed.returncode != 0:
        raise StageFailed(f"the resume failed (exit code {resumed.returncode}): {resumed.tail()}")
    start = resumed_from(resumed.stderr)
    tolerance = RESUME_TOLERANCE[settings.device]
    figures = {"precision": precision, "steps": settings.train_steps, "killed_at_step": kill_at,
               "resumed_from": start, "tolerance": tolerance,
               "final_loss": reference.losses.get(settings.train_steps)}
    if start is None or start > kill_at:
        raise StageFailed(f"the resumed run did not start from a checkpoint saved before the kill at step {kill_at}")
    later = {step: loss for step, loss in resumed.losses.items() if step > start}
    missing = sorted(set(range(start + 1, settings.train_steps + 1)) - set(later))
    if missing:
        raise StageFailed(f"the resumed run logged no loss for steps {missing[:5]}...")
    differences = {step: abs(loss - reference.losses[step]) / max(abs(reference.losses[step]), 1e-12)
                   for step, loss in later.items()}
    worst = max(differences, key=differences.__getitem__)
    figures["largest_relative_difference"] = differences[worst]
    figures["at_step"] = worst
    if differences[worst] > tolerance:
        raise StageFailed(f"the resumed run's loss at step {worst} is {later[worst]} against {reference.losses[worst]} "
                          f"uninterrupted ({differences[worst]:.2e} relative, tolerance {tolerance:.0e})")
    if settings.on_cpu and precision != "bf16":
        raise StageFailed("--bf16_on_cpu=True did not train under bf16 (the log does not say 'mixed precision: bf16')")
    return figures


# ----- 3. bench: bench_train with and without torch.compile ---------------------------------------------------
def bench(settings: CheckSettings) -> dict[str, Any]:
    """`bench_train` (the large config on a GPU), eager and compiled: tokens/s, MFU, data wait, peak GPU
    memory and each process's host high-water with the CUDA runtime loaded, and lowmem's step against a plain
    PyTorch loop's on the same batches.

    Each case's ratio to the plain loop and the MFU of both are also figures of their own
    (`eager_ratio_to_plain_loop`, `eager_mfu`, ...), so that the verdict line shows them."""
    deadline = Deadline(settings.stage_seconds)
    if settings.on_cpu:
        # Reduced: a few steps of the small model; "eager" only traces the model, which checks the compiled
        # path's wiring (fixed shapes included) without minutes of code generation.
        base = ["bench_train", *settings.model_flags(), "--steps=3", "--skip_steps=1"]
        compiled = ["--compile=True", "--compile_backend=eager", "--static_shapes=True"]
    else:
        base = ["bench_train", "--use_large_config=True", "--steps=200", "--skip_steps=10",
                f"--tokenizer_dir={settings.folder / 'tokenizer_large'}"]  # trained once, by the first case
        compiled = ["--compile=True"]
    figures: dict[str, Any] = {}
    cases: dict[str, Any] = {}
    for name, extra in (("eager", ["--compile=False"]), ("compiled", compiled)):
        done = run(lowmem_command([*base, *extra]), fresh_folder(settings.folder / "bench" / name), settings.env(),
                   deadline)
        if done.returncode != 0:
            raise StageFailed(f"bench_train ({name}) failed (exit code {done.returncode}): {done.tail()}")
        case = cases[name] = parse_bench_table(done.stdout)
        if case["ratio_to_plain_loop"] is None:
            raise StageFailed(f"bench_train ({name}) printed no (a)/(r) line: the plain PyTorch loop did not run "
                              f"({done.tail()})")
        figures[f"{name}_ratio_to_plain_loop"] = case["ratio_to_plain_loop"]
        figures[f"{name}_mfu"] = f"(a) {case['mfu_ceiling']}, (r) {case['mfu_plain_loop']}"
        figures[f"{name}_loop_ratio_to_plain_loop"] = case["loop_ratio_to_plain_loop"]
    return {**figures, **cases}


def parse_bench_table(text: str) -> dict[str, Any]:
    """The rows of `bench_train`'s table as figures, its line of high-water RSS, and lowmem's step and loop against
    the plain loop's: `ratio_to_plain_loop` ((a)/(r), None when the reference did not run),
    `loop_ratio_to_plain_loop` ((t)/(r), None when either did not run) and the MFU of (a) and (r) (`mfu_ceiling`,
    `mfu_plain_loop`: as printed, "-" where unknown, None for a missing row)."""
    columns = ("tokens_per_s", "vs_ceiling", "data_wait", "peak_rss_mb", "peak_gpu_mb", "mfu")
    rows: dict[str, Any] = {}
    summary = ""
    ratio = loop_ratio = None
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        plain_loop_ratio, loop_line = PLAIN_LOOP_RATIO.search(line), LOOP_RATIO.search(line)
        if loop_line:
            loop_ratio = float(loop_line.group(1))
        if line.startswith("| ") and len(cells) == 7 and cells[0] not in ("phase",) and not cells[0].startswith("--"):
            rows[cells[0]] = dict(zip(columns, cells[1:]))
        elif "process high-water RSS" in line:
            summary = line.strip()
        elif plain_loop_ratio:
            ratio = float(plain_loop_ratio.group(1))
    if not rows:
        raise StageFailed("bench_train printed no table")
    return {"phases": rows, "memory": summary, "ratio_to_plain_loop": ratio, "loop_ratio_to_plain_loop": loop_ratio,
            "mfu_ceiling": rows.get(CEILING_ROW, {}).get("mfu"),
            "mfu_plain_loop": rows.get(PLAIN_LOOP_ROW, {}).get("mfu")}


# ----- 4. speed: the users' command, and attention over long packed rows ----------------------------------
# A training log line's throughput figures (MFU and the GPU's peak only where the log has them; the MFU may carry its
# reading with attention over max_seq_len in brackets).
SPEED_LINE = re.compile(r"step (\d+)/\d+ \| .*?\| tokens/s ([\d,]+)(?: \| mfu ([\d.]+)%(?: \([^)]*\))?)?"
                        r"(?: \| gpu peak ([\d,]+) MB)?")
ATTENTION_ROW = re.compile(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \|$")


def speed(settings: CheckSettings) -> dict[str, Any]:
    """The users' command as they run it (`train --use_large_config=True`, one process, its defaults): tokens/s,
    MFU and the GPU's peak from its log lines after the first, and the micro-batches the plan chose; then
    `bench_attention` at 4,096 tokens (packed rows on FlexAttention and on SDPA with a mask, against causal SDPA).

    On the CPU: the small model with fixed shapes and compile (the "eager" backend), and attention at 512 tokens.
    """
    deadline = Deadline(settings.stage_seconds)
    if settings.on_cpu:
        args = ["train", *settings.model_flags(), "--max_steps=12", "--logging_steps=4", "--static_shapes=True",
                "--compile=True", "--compile_backend=eager"]
        attention = ["bench_attention", "--seq_len=512", "--batch=2", "--repeats=3", "--device=cpu"]
    else:
        args = ["train", "--use_large_config=True", f"--tokenizer_dir={settings.folder / 'tokenizer_large'}",
                "--max_steps=600", "--logging_steps=50", "--save_steps=100000", "--eval_bleu_samples=0"]
        attention = ["bench_attention", "--seq_len=4096"]
    done = run(lowmem_command([*args, "--output_dir=run"]), fresh_folder(settings.folder / "speed"), settings.env(),
               deadline)
    if done.returncode != 0:
        raise StageFailed(f"the users' command failed (exit code {done.returncode}): {done.tail()}")
    lines = [match.groups() for match in SPEED_LINE.finditer(done.stderr)]
    if len(lines) < 2:
        raise StageFailed(f"the users' command logged {len(lines)} step line(s), 2 or more needed: {done.tail()}")
    later = lines[1:]  # the first window's steps still warm the allocator and kernels up

    def median(values: list[float]) -> float | None:
        return sorted(values)[len(values) // 2] if values else None

    split = re.search(r"GPU micro-batches: [^(]+", done.stderr)
    figures: dict[str, Any] = {
        "users_command_tokens_per_s": median([float(tokens.replace(",", "")) for _, tokens, _, _ in later]),
        "users_command_mfu": median([float(mfu) / 100 for _, _, mfu, _ in later if mfu]),
        "users_command_gpu_peak_mb": max((float(peak.replace(",", "")) for _, _, _, peak in later if peak),
                                         default=None),
        "users_command_micro_batches": split.group(0).strip() if split else "as configured",
        "users_command_shapes": _line_after(done.stderr, "Batch shapes: "),
    }
    measured = run(lowmem_command(attention), fresh_folder(settings.folder / "attention"), settings.env(), deadline)
    if measured.returncode != 0:
        raise StageFailed(f"bench_attention failed (exit code {measured.returncode}): {measured.tail()}")
    rows = {match.group(1): float(match.group(3)) for line in measured.stdout.splitlines()
            if (match := ATTENTION_ROW.match(line.strip()))}
    figures["attention_vs_causal"] = rows
    return figures


def _line_after(text: str, prefix: str) -> str | None:
    """What follows `prefix` on the first line that has it, up to the first parenthesis."""
    for line in text.splitlines():
        if prefix in line:
            return line.split(prefix, 1)[1].split(" (")[0].strip()
    return None


# ----- 5. parallel: DDP, FSDP2 and DeepSpeed over every GPU ---------------------------------------------------
def parallel(settings: CheckSettings) -> dict[str, Any]:
    """As many processes as GPUs under DDP, FSDP2 (and DeepSpeed ZeRO-2 offload where it imports): a few
    steps, a save, a SIGKILL, a resume that ends the run."""
    deadline = Deadline(settings.stage_seconds)
    processes = settings.processes
    common = ["--num_processes", str(processes), "--main_process_port", "0"]
    deepspeed_skipped = _deepspeed_skip_reason(settings)
    launchers: dict[str, list[str] | None] = {
        "ddp": [*(["--multi_gpu"] if processes > 1 else []), *common],
        "fsdp": [*FSDP_FLAGS, *common, "--mixed_precision", "bf16"],
        "deepspeed": None if deepspeed_skipped else ["--config_file", str(DEEPSPEED_CONFIG.resolve()), *common],
    }
    figures: dict[str, Any] = {"processes": processes}
    for name, launcher in launchers.items():
        figures[name] = ("skipped: " + deepspeed_skipped if launcher is None
                         else _kill_and_resume(settings, name, launcher, deadline))
    return figures


def _deepspeed_skip_reason(settings: CheckSettings) -> str:
    if settings.on_cpu:
        return "DeepSpeed's offloaded optimizer is checked on GPUs only (its CPU Adam compiles on first use)"
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return "deepspeed does not import here"
    if not DEEPSPEED_CONFIG.is_file():
        return f"{DEEPSPEED_CONFIG} not found: run the check from a checkout of the project"
    return ""


def _kill_and_resume(settings: CheckSettings, name: str, launcher: list[str], deadline: Deadline) -> dict[str, Any]:
    folder = fresh_folder(settings.folder / "parallel" / name)
    steps, save = 6, 3
    # The GPU's numerics on the CPU too: bf16 (FSDP2's bf16 policy, DDP's autocast) and the loss over whole logits,
    # which the plan chooses on a GPU where they fit.
    on_cpu_as_on_gpu = [*settings.precision_flags(), "--loss_chunk_tokens=0"] if settings.on_cpu else []
    args = ["train", "--output_dir=run", f"--max_steps={steps}", f"--save_steps={save}", "--logging_steps=1",
            "--eval_steps=0", *settings.model_flags(), *on_cpu_as_on_gpu]
    killed_log = run_and_kill_after(lowmem_command(args, launcher), folder, settings.env(), deadline, save + 1)
    strategy = next((line.split("Parallelism: ", 1)[1].strip() for line in killed_log.splitlines()
                     if "Parallelism: " in line), "")
    resumed = run(lowmem_command([*args, "--is_keep_training=True"], launcher), folder, settings.env(), deadline)
    if resumed.returncode != 0:
        raise StageFailed(f"{name}: the resume failed (exit code {resumed.returncode}): {resumed.tail()}")
    start = resumed_from(resumed.stderr)
    if start != save or steps not in resumed.losses:
        raise StageFailed(f"{name}: the resume started from {start} (expected checkpoint-{save}) and logged steps "
                          f"{sorted(resumed.losses)}")
    return {"strategy": strategy, "resumed_from": start, "losses": resumed.losses}


# ----- 6. memory log ------------------------------------------------------------------------------------------
def memory_log(settings: CheckSettings) -> dict[str, Any]:
    """The train stage's uninterrupted run's memory log, read back as `memlog` reads it (after a warm-up that
    takes in the first save): a FLAT verdict on every rank, and on a GPU the CUDA fields filled in."""
    from lowmem.errors import LowmemError
    from lowmem.memory.log_files import find_run, read_run
    from lowmem.memory.report import summarize

    logs = settings.folder / "train" / "reference" / "logs"
    try:
        records_by_rank, notes = read_run(find_run(None, logs))
    except LowmemError as error:
        raise StageFailed(f"{error} (the train stage writes it: did it get that far?)") from None
    # The warm-up runs to the record after the first save, which allocates its buffers once (a few MB on the
    # small model, a step up that a short run's fit would read as growth).
    warmup = settings.save_steps + settings.memory_log_steps
    summaries = {rank: summarize(records, warmup_steps=warmup) for rank, records in sorted(records_by_rank.items())
                 if records}
    figures: dict[str, Any]  # a figures dict per rank, and the notes
    figures = {f"rank{rank}": {"verdict": summary.verdict, "explanation": summary.explanation,
                               "records": summary.records, "peak_rss_mb": round(summary.peak_rss / 2**20),
                               "planned_peak_mb": None if summary.predicted_peak is None
                               else round(summary.predicted_peak / 2**20),
                               "peak_gpu_mb": None if summary.peak_gpu is None else round(summary.peak_gpu / 2**20)}
               for rank, summary in summaries.items()}
    figures["notes"] = list(notes)
    not_flat = [f"rank {rank}: {summary.verdict} ({summary.explanation})" for rank, summary in summaries.items()
                if summary.verdict != "FLAT"]
    if not_flat:
        raise StageFailed("; ".join(not_flat))
    if not settings.on_cpu and any(summary.peak_gpu is None for summary in summaries.values()):
        raise StageFailed("the memory log has no CUDA figures (cuda_peak) on a GPU run")
    return figures


STAGES: dict[str, Stage] = {"environment": environment, **PATH_STAGES, **STEP_STAGES, "train": train, "bench": bench,
                            "speed": speed, "parallel": parallel, "memory_log": memory_log}


def describe(figures: dict[str, Any], width: int = 240) -> str:
    """A stage's single-valued figures as `name=value` for its verdict line (the rest is in the results file)."""
    scalars = [f"{name}={_short(value)}" for name, value in figures.items()
               if isinstance(value, (str, int, float)) or value is None]
    text = " ".join(scalars) or "(figures in the results file)"
    return text if len(text) <= width else text[:width - 3] + "..."


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else json.dumps(value) if value is None else str(value)


__all__ = ["STAGES", "CheckSettings", "StageFailed", "StageSkipped", "describe", "parse_bench_table"]
