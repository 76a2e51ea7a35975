"""The training benchmark: the same model and optimizer fed from memory (the ceiling) and from the pipeline.

Phases, in one process per rank (run it under `accelerate launch` for several):
    data      the pipeline alone (ParquetStream → tokenizing collate → DataLoader), before the model
              exists: its tokens/s and the RSS it adds (its workers included) are the data pipeline's share
    ceiling   `steps` optimizer steps on batches collated beforehand and held in memory: no data work at all
    pipeline  the same `steps` steps through the real pipeline; the time spent waiting for the next batch
              is the data wait

Both training phases see the same batches (the pipeline's first ones), so any difference in speed is the
cost of producing them on the fly. Tokens are real (non-padding) input tokens.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from lowmem.config import TrainConfig
from lowmem.config.columns import data_columns, response_only
from lowmem.data.collate import TokenizingCollate
from lowmem.memory.probe import own_high_water
from lowmem.units import DECIMAL_MB


# Dense bf16 tensor-core peaks (TFLOP/s) by GPU name, from the vendors' data sheets; `--peak_tflops` overrides.
# The first name found in the device's name wins, so specific names come before general ones (an H100
# without NVL or PCIe in its name is the SXM part: "NVIDIA H100 80GB HBM3").
PEAK_BF16_TFLOPS = {
    "H200": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0,
    "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.0, "RTX 3090": 71.0,
}


@dataclass
class PhaseResult:
    """One phase on one rank."""

    name: str
    steps: int
    seconds: float
    tokens: int
    data_wait_seconds: float = 0.0
    peak_rss: int = 0  # highest RSS sampled in the phase: this process plus its DataLoader workers
    peak_gpu_bytes: int = 0


class RssSampler:
    """The highest RSS of this process plus its children (DataLoader workers), sampled when asked."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0

    def sample(self) -> int:
        total = self.process.memory_info().rss
        for child in self.process.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:  # a worker that just exited
                pass
        self.peak = max(self.peak, total)
        return total


def real_tokens(batch: dict[str, torch.Tensor], pad_id: int) -> int:
    return int((batch["input_ids"] != pad_id).sum())


def peak_bf16_tflops(device_name: str) -> float:
    """The GPU's dense bf16 peak from its name (0 when unknown)."""
    for name, tflops in PEAK_BF16_TFLOPS.items():  # longer, more specific names come first
        if name in device_name:
            return tflops
    return 0.0


def measure_data_phase(loader: Any, micro_batches: int, pad_id: int) -> tuple[PhaseResult, int]:
    """Iterate the pipeline alone; returns the phase and the RSS it added over the process before it."""
    sampler = RssSampler()
    before = sampler.sample()
    tokens, started = 0, time.perf_counter()
    batches = iter(loader)
    for _ in range(micro_batches):
        batch = next(batches, None)
        if batch is None:
            break
        tokens += real_tokens(batch, pad_id)
        sampler.sample()
    seconds = time.perf_counter() - started
    del batches
    return PhaseResult("data", micro_batches, seconds, tokens, peak_rss=sampler.peak), sampler.peak - before


def run_steps(name: str, batches: Iterator[dict[str, torch.Tensor]], steps: int, skip_steps: int, step_fn: Any,
              accumulation: int, pad_id: int, on_gpu: bool) -> PhaseResult:
    """`skip_steps` untimed steps, then `steps` timed ones; the time spent in `next(batches)` is data wait."""
    from lowmem.train.step import take

    sampler = RssSampler()
    result = PhaseResult(name, 0, 0.0, 0)
    for index in range(skip_steps + steps):
        if index == skip_steps:
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            result = PhaseResult(name, 0, 0.0, 0)
        waited = time.perf_counter()
        micro_batches = take(batches, accumulation)
        result.data_wait_seconds += time.perf_counter() - waited
        if len(micro_batches) < accumulation:
            break
        step_fn(micro_batches)  # returns after the step's loss reached the host: the GPU has finished
        result.tokens += sum(real_tokens(batch, pad_id) for batch in micro_batches)
        result.steps += 1
        sampler.sample()
    if result.steps == 0:
        raise RuntimeError(
            f"The data ran out before the timed steps of phase {name}: use a larger file or fewer steps.")
    result.seconds = time.perf_counter() - started
    result.peak_rss = sampler.peak
    if on_gpu:
        result.peak_gpu_bytes = torch.cuda.max_memory_allocated()
    return result


def bench_train(config: TrainConfig, steps: int = 20, skip_steps: int = 3, data_file: str | None = None, rows: int = 0,
                peak_tflops: float = 0.0, pipeline: bool = True) -> str:
    """Run the three phases on every rank and return the table (rank 0's view, all ranks combined).

    Args:
        config: a TrainConfig (overrides applied).
        steps: timed optimizer steps per training phase.
        skip_steps: untimed steps before them (allocator warm-up, torch.compile).
        data_file: parquet rows to train on (default: the config's train_file).
        rows: when > 0, generate a file of this many synthetic rows instead.
        peak_tflops: the GPU's dense bf16 peak for MFU (default: looked up from the GPU's name).
        pipeline: run the pipeline phase too; without it the ceiling's steps are the only training (what
            `bench_memory` needs: the model's high-water RSS, sooner).
    """
    from accelerate.utils import gather_object

    from lowmem.bench.data_bench import generate_file, machine_line
    from lowmem.distributed.accelerator import create_accelerator
    from lowmem.distributed.collectives import all_reduce_sum, broadcast_from_main
    from lowmem.model import IGNORE_INDEX
    from lowmem.config import validate_config
    from lowmem.train.setup import (build_model, ensure_tokenizer, make_loader, prepare_for_training,
                                    shared_memory_settings)
    from lowmem.memory.plan import STEP, plan_memory
    from lowmem.train.memory_fit import layout_of, measure_base_bytes, plan_inputs
    from lowmem.train.step import train_step

    validate_config(config)
    accelerator = create_accelerator(config.gradient_accumulation_steps, config.bf16,
                                     config.process_group_timeout_minutes, bf16_on_cpu=config.bf16_on_cpu)
    on_gpu = accelerator.device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="lowmem-bench-train-") as folder:
        if rows > 0:
            data_file = broadcast_from_main(
                accelerator, lambda: str(generate_file(Path(folder) / "rows.parquet", rows)))
        config = dataclasses.replace(config, train_file=data_file or config.train_file)
        if rows > 0 and config.text_column:
            config = dataclasses.replace(config, text_column="response")  # the synthetic rows' longer column
        tokenizer, _ = ensure_tokenizer(config, accelerator)
        settings = shared_memory_settings(config, accelerator)
        collate = TokenizingCollate(tokenizer, config.max_seq_len, data_columns(config), response_only(config),
                                    pack=config.pack_rows)
        loader = make_loader(config.train_file, config, accelerator, collate, settings, shuffle=True)
        accumulation = config.gradient_accumulation_steps
        micro_batches = (skip_steps + steps) * accumulation

        base = measure_base_bytes()  # the interpreter and libraries, as the plan takes them before the model
        data, data_rss = measure_data_phase(loader, micro_batches, tokenizer.pad_id)
        in_memory = list(_first(loader, micro_batches))  # the same batches the pipeline phase will see

        plain_model = build_model(config, tokenizer.vocab_size)  # as training builds and prepares it
        flops_per_token = plain_model.estimate_flops_per_token()
        n_params = plain_model.num_params()
        model, optimizer = prepare_for_training(plain_model, config, accelerator, settings)

        def step(batches: list[dict[str, torch.Tensor]]) -> None:
            tokens = sum(float((batch["targets"] != IGNORE_INDEX).sum()) for batch in batches)
            [global_tokens] = all_reduce_sum(accelerator, [tokens])  # as in training: one small collective per step
            loss_sum, _, _ = train_step(model, optimizer, accelerator, batches, global_tokens, config.grad_clip)
            float(loss_sum)  # wait for the device, so that each timed step is a finished step

        ceiling = run_steps("ceiling", iter(in_memory), steps, skip_steps, step, accumulation, tokenizer.pad_id, on_gpu)
        del in_memory
        through_pipeline = (run_steps("pipeline", iter(loader), steps, skip_steps, step, accumulation,
                                      tokenizer.pad_id, on_gpu) if pipeline else None)
        # The plan samples the data file, which must still exist when rows were generated.
        inputs, _ = plan_inputs(config, layout_of(accelerator), base, tokenizer)
        predicted = plan_memory(inputs).high_water(accelerator.is_main_process, phases=(STEP,))
    per_rank = gather_object([{"data": data, "data_rss": data_rss, "ceiling": ceiling, "pipeline": through_pipeline,
                               "high_water": own_high_water(), "predicted": predicted}])
    if not accelerator.is_main_process:
        return ""
    device = torch.cuda.get_device_name() if on_gpu else machine_line()
    peak = peak_tflops or (peak_bf16_tflops(device) if on_gpu else 0.0)
    header = describe_run(config, accelerator, settings, n_params, device, steps, skip_steps)
    return header + "\n" + format_table(per_rank, flops_per_token, peak)


def describe_run(config: TrainConfig, accelerator: Any, settings: Any, n_params: int, device: str, steps: int,
                 skip_steps: int) -> str:
    """The table's first line: the model, the processes and strategy, the device, and every setting that
    changes what a step costs."""
    from lowmem.distributed.strategy import describe

    return (f"bench_train: {n_params / 1e6:.1f} M parameters, {accelerator.num_processes} process(es) on "
            f"{accelerator.device.type} ({device}), {describe(accelerator)}, batch {config.batch_size_per_gpu} x "
            f"{config.gradient_accumulation_steps} per process, max_seq_len {config.max_seq_len}, "
            f"pack_rows={config.pack_rows}, compile={config.compile}, loss_chunk_tokens={config.loss_chunk_tokens}, "
            f"activation_checkpointing={config.activation_checkpointing}, "
            f"malloc_mmap_threshold_mb={config.malloc_mmap_threshold_mb}, "
            f"workers per process {settings.num_workers}, ultra_low_mem={settings.ultra_low_mem}; "
            f"{steps} timed steps after {skip_steps}; data: {config.train_file}")


def _first(loader: Any, count: int) -> Iterator[dict[str, torch.Tensor]]:
    for index, batch in enumerate(loader):
        if index == count:
            return
        yield batch


def format_table(per_rank: list[dict[str, Any]], flops_per_token: int, peak_tflops: float) -> str:
    """One line per phase, all ranks combined: tokens/s summed, time and data wait of the slowest rank."""
    def combined(name: str) -> tuple[float, float, list[int], int]:
        phases = [rank[name] for rank in per_rank]
        seconds = max(phase.seconds for phase in phases)
        tokens_per_second = sum(phase.tokens for phase in phases) / max(seconds, 1e-9)
        wait = max(phase.data_wait_seconds / max(phase.seconds, 1e-9) for phase in phases)
        return tokens_per_second, wait, [phase.peak_rss for phase in phases], max(p.peak_gpu_bytes for p in phases)

    ceiling_rate = combined("ceiling")[0]
    lines = ["| phase | tokens/s | vs ceiling | data wait | peak RSS per process MB | peak GPU MB | MFU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    labels = {"data": "data pipeline alone", "ceiling": "(a) batches in memory (ceiling)",
              "pipeline": "(b) real pipeline"}
    phases = ("data", "ceiling", "pipeline") if per_rank[0]["pipeline"] is not None else ("data", "ceiling")
    for name in phases:
        rate, wait, rss, gpu = combined(name)
        training = name != "data"
        mfu = (f"{rate * flops_per_token / (peak_tflops * 1e12 * len(per_rank)):.1%}"
               if training and peak_tflops else "-")
        lines.append(
            f"| {labels[name]} | {rate:,.0f} | {rate / ceiling_rate:.2f} | {f'{wait:.2%}' if training else '-'} | "
            f"{' / '.join(f'{value / DECIMAL_MB:,.0f}' for value in rss)} | "
            f"{f'{gpu / DECIMAL_MB:,.0f}' if gpu else '-'} | {mfu} |"
        )
    share = " / ".join(f"{rank['data_rss'] / DECIMAL_MB:,.0f}" for rank in per_rank)
    high_water = " / ".join(f"{rank['high_water'] / DECIMAL_MB:,.0f}" for rank in per_rank)
    lines.append("")
    total_high_water = sum(rank["high_water"] for rank in per_rank) / DECIMAL_MB
    ratio = f"(b)/(a) = {combined('pipeline')[0] / ceiling_rate:.3f}; " if "pipeline" in phases else ""
    predicted = " / ".join(f"{rank['predicted'] / DECIMAL_MB:,.0f}" for rank in per_rank if rank.get("predicted"))
    lines.append(f"{ratio}RSS the data pipeline adds per process: {share} MB; "
                 f"process high-water RSS: {high_water} MB (sum {total_high_water:,.0f} MB)"
                 + (f"; predicted by the memory plan: {predicted} MB" if predicted else ""))
    return "\n".join(lines)
