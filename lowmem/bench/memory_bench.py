"""The memory table: what each lever of the model side costs and saves, each case in fresh processes.

For every combination of strategy (DDP: a full replica per process; FSDP: everything sharded), loss (whole
logits; chunked) and activation checkpointing (off; on), `bench_memory` launches `bench_train` under
`accelerate launch` in processes of their own, so that each case's high-water RSS (VmHWM: the most
the process's memory ever held) is its own and not an earlier case's. Each row gives the
high-water RSS of every process, their sum, and the tokens/s of the timed steps on in-memory batches.

On a CPU the model, its gradients and the optimizer state live in host memory together with the
activations, so the table shows the whole model side of a process; on a GPU host it shows the host side.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

DDP, FSDP = "ddp", "fsdp"
STRATEGIES = (DDP, FSDP)
_HIGH_WATER = re.compile(r"process high-water RSS: ([\d,/ ]+) MB \(sum ([\d,]+) MB\)")
_PREDICTED = re.compile(r"predicted by the memory plan: ([\d,/ ]+) MB")
_CEILING = re.compile(r"\| \(a\) batches in memory \(ceiling\) \| ([\d,]+) \|")


@dataclass
class MemoryCase:
    """One row of the table: a strategy, a loss, checkpointing on or off, and what was measured."""

    strategy: str
    loss_chunk_tokens: int
    activation_checkpointing: bool
    high_water_mb: list[float] | None = None  # per process
    predicted_mb: list[float] | None = None  # the memory plan's figure per process, training steps alone
    tokens_per_second: float = 0.0
    failure: str = ""  # the end of the output of a case that did not finish

    @property
    def label(self) -> str:
        loss = f"chunked ({self.loss_chunk_tokens:,} tokens)" if self.loss_chunk_tokens else "whole logits"
        return f"| {self.strategy.upper()} | {loss} | {'on' if self.activation_checkpointing else 'off'} |"


def launcher(strategy: str, processes: int) -> list[str]:
    """`accelerate launch` for `processes` processes under DDP, or under FSDP2 as configs/accelerate/fsdp.yaml
    sets it up (full shard, one unit per transformer block), in float32: the CPU has no bf16 autocast here."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
               "--main_process_port", "0", "--mixed_precision", "no"]
    if strategy == FSDP:
        return command + ["--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "true",
                          "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                          "--fsdp_transformer_layer_cls_to_wrap", "Block", "--fsdp_state_dict_type",
                          "SHARDED_STATE_DICT", "--fsdp_offload_params", "false",
                          "--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_activation_checkpointing", "false"]
    return command + (["--multi_gpu"] if processes > 1 else [])


def cases(strategies: Sequence[str], chunk_tokens: int, every_combination: bool = True) -> list[MemoryCase]:
    """Every combination, in the order of the table: plain first, each lever added, then both; or, without
    `every_combination`, only the one with both levers for each strategy."""
    if not every_combination:
        return [MemoryCase(strategy, chunk_tokens, True) for strategy in strategies]
    return [MemoryCase(strategy, chunk, checkpointing) for strategy in strategies
            for checkpointing in (False, True) for chunk in (0, chunk_tokens)]


def _per_process(text: str) -> list[float]:
    return [float(value.replace(",", "")) for value in text.split("/")]


def parse_bench_output(output: str) -> tuple[list[float], float] | None:
    """(high-water RSS per process in MB, ceiling tokens/s) from `bench_train`'s table, or None."""
    high_water, ceiling = _HIGH_WATER.search(output), _CEILING.search(output)
    if high_water is None or ceiling is None:
        return None
    return _per_process(high_water.group(1)), float(ceiling.group(1).replace(",", ""))


def parse_predicted(output: str) -> list[float] | None:
    """The memory plan's high-water per process in MB from `bench_train`'s output, or None."""
    predicted = _PREDICTED.search(output)
    return None if predicted is None else _per_process(predicted.group(1))


def run_case(case: MemoryCase, processes: int, bench_args: list[str], env: dict[str, str]) -> MemoryCase:
    """Run one case in fresh processes and fill in what it measured (or why it failed)."""
    # A case measures lowmem's own memory and speed: the plain-loop reference and the loop would only take time.
    command = [*launcher(case.strategy, processes), "-m", "lowmem", "bench_train", "--reference=False",
               "--trainer=False", *bench_args,
               f"--loss_chunk_tokens={case.loss_chunk_tokens}",
               f"--activation_checkpointing={case.activation_checkpointing}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    parsed = parse_bench_output(done.stdout)
    if done.returncode != 0 or parsed is None:
        case.failure = (done.stdout + done.stderr)[-2000:]
        return case
    if (case.strategy == FSDP) != (", FSDP" in done.stdout):  # the header names the strategy that ran
        case.failure = "accelerate did not run the strategy asked for:\n" + done.stdout[:1000]
        return case
    case.high_water_mb, case.tokens_per_second = parsed
    case.predicted_mb = parse_predicted(done.stdout)
    return case


def format_memory_table(measured: list[MemoryCase]) -> str:
    """The table, one row per case; a failed case says so on its row."""
    lines = ["| strategy | loss | activation checkpointing | high-water RSS per process MB | predicted MB | "
             "sum MB | tokens/s |",
             "|---|---|---|---:|---:|---:|---:|"]
    for case in measured:
        if case.high_water_mb is None:
            lines.append(f"{case.label} failed | - | - | - |")
            continue
        per_process = " / ".join(f"{value:,.0f}" for value in case.high_water_mb)
        predicted = " / ".join(f"{value:,.0f}" for value in case.predicted_mb) if case.predicted_mb else "-"
        lines.append(f"{case.label} {per_process} | {predicted} | {sum(case.high_water_mb):,.0f} | "
                     f"{case.tokens_per_second:,.0f} |")
    return "\n".join(lines)


def bench_memory(bench_args: list[str], processes: int = 3, strategies: Sequence[str] = STRATEGIES,
                 chunk_tokens: int = 2048, rows: int = 0, on_cpu: bool = True, every_combination: bool = True) -> str:
    """Measure every case and return the table (with the failures' output under it).

    Args:
        bench_args: flags for `bench_train` (the config: `--use_large_config=True`, `--n_layer=24`, ...;
            the steps: `--steps=1 --skip_steps=1`).
        processes: processes per case.
        strategies: "ddp", "fsdp" or both.
        chunk_tokens: the chunked loss's tokens per chunk.
        rows: generate a file of this many synthetic rows for every case (0: the config's train_file).
        on_cpu: run on the CPU (gloo) even where a GPU is present.
        every_combination: measure all four cases per strategy; False measures only both levers together
            (for models too large or slow to measure four times).
    """
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        from lowmem.errors import ConfigError

        raise ConfigError(f"Unknown strategy {', '.join(unknown)}: choose among {', '.join(STRATEGIES)}.")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if on_cpu:
        env["ACCELERATE_USE_CPU"] = "1"
    with tempfile.TemporaryDirectory(prefix="lowmem-bench-memory-") as folder:
        args = [*bench_args, "--pipeline=False"]
        if rows > 0:  # one file for every case, written once
            from lowmem.bench.data_bench import generate_file

            args.append(f"--data_file={generate_file(Path(folder) / 'rows.parquet', rows)}")
        measured = []
        for case in cases(strategies, chunk_tokens, every_combination):
            measured.append(run_case(case, processes, args, env))
            print(format_memory_table(measured).splitlines()[-1], file=sys.stderr, flush=True)  # progress
    table = format_memory_table(measured)
    failures = [f"{case.label} failed:\n{case.failure}" for case in measured if case.failure]
    return "\n\n".join([table, *failures])

