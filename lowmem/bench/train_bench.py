"""The training benchmark: the same model and optimizer fed from memory (the ceiling), from the pipeline, and by
the training loop itself, against a plain PyTorch loop.

Phases, in one process per rank (run it under `accelerate launch` for several):
    data       the pipeline alone (ParquetStream → tokenizing collate → DataLoader), before the model
               exists: its tokens/s and the RSS it adds (its workers included) are the data pipeline's share
    ceiling    `steps` optimizer steps on batches collated beforehand and held in memory: no data work at all
    pipeline   the same `steps` steps through the real pipeline; the time spent waiting for the next batch
               is the data wait
    trainer    the real training loop, `Trainer.fit`, on the same rows from the same pipeline, every default on:
               a log line every --logging_steps, the cleanups and memory records, the agreement of the ranks; no
               checkpoint and no validation fall within its timed steps (the run's one save comes after them)
    reference  lowmem's model and optimizer freed, a fresh model of the same configuration trained by a plain
               PyTorch loop on the ceiling's batches: whole logits, no accelerate, each rank on its own, the same
               attention (the packed rows' document masks); (a)/(r) is what lowmem's step costs or saves
               against what anyone would write, (t)/(r) what the users' command pays against it

The training phases see the same batches (the pipeline's first ones), so any difference in speed is the cost of
producing them on the fly, of the loop around the step, or of lowmem's step itself. Every phase is timed from one
synchronisation of the device to another, over every timed step: no step reads a result back to the host, as
training never does. Tokens are real (non-padding) input tokens.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from lowmem.config import OptimConfig, TrainConfig
from lowmem.config.columns import data_columns, response_only
from lowmem.config.overrides import explicit_fields
from lowmem.data.collate import FixedShapes, TokenizingCollate
from lowmem.distributed.performance import (SpeedSettings, inference_autocast, mfu, peak_bf16_tflops,
                                            run_speed_settings)
from lowmem.memory.probe import own_high_water
from lowmem.train.callbacks import Callback
from lowmem.units import DECIMAL_MB

# The table's label of each phase, in the order of its rows.
PHASE_LABELS = {"data": "data pipeline alone", "ceiling": "(a) batches in memory (ceiling)",
                "pipeline": "(b) real pipeline", "trainer": "(t) the training loop (Trainer.fit)",
                "reference": "(r) plain PyTorch loop (reference)"}
# Timed steps by default: a GPU's step of the large preset takes ~20 ms, so a few hundred are needed for a steady
# figure; the CPU's are hundreds of times slower.
DEFAULT_STEPS = {"cuda": 200, "cpu": 20}


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
    attention_pairs: int = 0  # (query, key) pairs over the rows' real lengths, for the MFU


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
    """`skip_steps` untimed steps, then `steps` timed ones, from one synchronisation of the device to another (no
    step waits for its result, as in training); the time spent in `next(batches)` is data wait."""
    from lowmem.train.step import attention_pairs, take

    sampler = RssSampler()
    result = PhaseResult(name, 0, 0.0, 0)
    for index in range(skip_steps + steps):
        if index == skip_steps:
            _synchronize(on_gpu, new_peak=True)
            started = time.perf_counter()
            result = PhaseResult(name, 0, 0.0, 0)
        waited = time.perf_counter()
        micro_batches = take(batches, accumulation)
        result.data_wait_seconds += time.perf_counter() - waited
        if len(micro_batches) < accumulation:
            break
        step_fn(micro_batches)  # queued on the device: nothing is read back
        result.tokens += sum(real_tokens(batch, pad_id) for batch in micro_batches)
        result.attention_pairs += attention_pairs(micro_batches, pad_id)
        result.steps += 1
        sampler.sample()
    if result.steps == 0:
        raise RuntimeError(
            f"The data ran out before the timed steps of phase {name}: use a larger file or fewer steps.")
    _synchronize(on_gpu)  # the last step finished on the device
    result.seconds = time.perf_counter() - started
    result.peak_rss = sampler.peak
    if on_gpu:
        result.peak_gpu_bytes = torch.cuda.max_memory_allocated()
    return result


def _synchronize(on_gpu: bool, new_peak: bool = False) -> None:
    """Wait for the device's queued work (a timed phase starts and ends here); with `new_peak`, the GPU's peak
    memory counts from here."""
    if on_gpu:
        torch.cuda.synchronize()
        if new_peak:
            torch.cuda.reset_peak_memory_stats()


def bench_train(config: TrainConfig, steps: int | None = None, skip_steps: int = 3, data_file: str | None = None,
                rows: int = 0, peak_tflops: float = 0.0, pipeline: bool = True, reference: bool = True,
                trainer: bool = True) -> str:
    """Run the phases on every rank and return the table (rank 0's view, all ranks combined).

    Args:
        config: a TrainConfig (overrides applied).
        steps: timed optimizer steps per training phase (default: `DEFAULT_STEPS` of the device).
        skip_steps: untimed steps before them (allocator warm-up, torch.compile).
        data_file: parquet rows to train on (default: the config's train_file).
        rows: when > 0, generate a file of this many synthetic rows instead.
        peak_tflops: the GPU's dense bf16 peak for MFU (default: looked up from the GPU's name).
        pipeline: run the pipeline phase too; without it the ceiling's steps are the only training (what
            `bench_memory` needs: the model's high-water RSS, sooner).
        reference: run the plain PyTorch loop (r) after lowmem's phases, and print (a)/(r).
        trainer: run the training loop (t) after (a) and (b), and print (t)/(r).
    """
    from accelerate.utils import gather_object

    from lowmem.bench.data_bench import config_on_data
    from lowmem.distributed.accelerator import create_accelerator, ddp_settings
    from lowmem.distributed.collectives import broadcast_from_main, end_process_group
    from lowmem.config import validate_config
    from lowmem.train.setup import decide_fixed_shapes, ensure_tokenizer, make_loader, shared_memory_settings
    from lowmem.memory.plan import STEP, plan_memory
    from lowmem.train.memory_fit import layout_of, measure_base_bytes, plan_inputs, settle_memory

    validate_config(config)
    accelerator = create_accelerator(config.gradient_accumulation_steps, config.bf16,
                                     config.process_group_timeout_minutes, bf16_on_cpu=config.bf16_on_cpu,
                                     ddp=ddp_settings(config))
    on_gpu = accelerator.device.type == "cuda"
    steps = steps or DEFAULT_STEPS[accelerator.device.type if on_gpu else "cpu"]
    with tempfile.TemporaryDirectory(prefix="lowmem-bench-train-") as folder:
        config = config_on_data(config, accelerator, Path(folder), data_file, rows)
        split = ""
        if on_gpu:  # the micro-batches training would take on this GPU (the fewest that fit, `settle_memory`)
            config, decision = settle_memory(config, accelerator, explicit_fields(config))
            split = "; " + " ".join(line for line in decision.lines if not line.startswith("Memory plan"))
        tokenizer, _ = ensure_tokenizer(config, accelerator)
        settings = shared_memory_settings(config, accelerator)
        speed = run_speed_settings(config, accelerator)
        shapes = (broadcast_from_main(accelerator, lambda: decide_fixed_shapes(config, tokenizer))
                  if speed.static_shapes else None)  # the batches training would make
        collate = TokenizingCollate(tokenizer, config.max_seq_len, data_columns(config), response_only(config),
                                    pack=config.pack_rows, fixed_shapes=shapes)
        loader = make_loader(config.train_file, config, accelerator, collate, settings, shuffle=True)
        micro_batches = (skip_steps + steps) * config.gradient_accumulation_steps

        base = measure_base_bytes()  # the interpreter and libraries, as the plan takes them before the model
        data, data_rss = measure_data_phase(loader, micro_batches, tokenizer.pad_id)
        in_memory = list(_first(loader, micro_batches))  # the same batches the pipeline phase will see
        ceiling, through_pipeline, (flops_per_token, attention_flops), n_params = measure_lowmem_phases(
            config, accelerator, settings, tokenizer.vocab_size, in_memory, loader if pipeline else None, steps,
            skip_steps, tokenizer.pad_id, shapes)
        # The plan samples the data file, which must still exist when rows were generated.
        inputs = plan_inputs(config, layout_of(accelerator), base, tokenizer).inputs
        predicted = plan_memory(inputs).high_water(accelerator.is_main_process, phases=(STEP,))
        high_water = own_high_water()  # before the reference's whole logits: the plan predicts lowmem's phases
        free_training_state(config, accelerator)
        loop = measure_trainer_phase(config, accelerator, Path(folder), steps, skip_steps,
                                     tokenizer.pad_id) if trainer else None
        plain_loop = (measure_reference_phase(config, accelerator, tokenizer.vocab_size, in_memory, steps, skip_steps,
                                              tokenizer.pad_id, shapes) if reference else None)
        del in_memory
    per_rank = gather_object([{"data": data, "data_rss": data_rss, "ceiling": ceiling, "pipeline": through_pipeline,
                               "trainer": loop, "reference": plain_loop, "reference_ran": reference,
                               "high_water": high_water, "predicted": predicted}])
    # Ended while every rank is still here (the gather is a collective), as `train` ends the group it made, rather
    # than leaving gloo's connections to the exit of processes that end one after another.
    end_process_group()
    if not accelerator.is_main_process:
        return ""
    header = describe_run(config, accelerator, settings, n_params, _device_name(on_gpu), steps, skip_steps)
    shape_text = f"; batch shapes {shapes.describe()}" if shapes is not None else ""
    peak = peak_tflops or (peak_bf16_tflops(_device_name(on_gpu)) if on_gpu else 0.0)
    return header + shape_text + split + "\n" + format_table(per_rank, flops_per_token, peak, attention_flops,
                                                             config.max_seq_len)


def _device_name(on_gpu: bool) -> str:
    """The GPU's name, or the CPU machine's line, for the table's header."""
    from lowmem.bench.data_bench import machine_line

    return torch.cuda.get_device_name() if on_gpu else machine_line()


def measure_lowmem_phases(config: TrainConfig, accelerator: Any, settings: Any, vocab_size: int,
                          in_memory: list[dict[str, torch.Tensor]], loader: Any, steps: int, skip_steps: int,
                          pad_id: int, shapes: FixedShapes | None = None
                          ) -> tuple[PhaseResult, PhaseResult | None, tuple[int, int], int]:
    """(a) and (b): lowmem's model and optimizer, built and prepared as training does, on the batches held in
    memory, then through `loader` (None: no (b)). With fixed `shapes` and compile, every shape is compiled
    before the first step, as training does.

    Returns the two phases, the model's FLOPs per token (attention over max_seq_len) and attention's per (query,
    key) pair, and its parameter count. The model and optimizer are let go on return (`free_training_state` frees
    what accelerate and torch.compile still hold of them).
    """
    from lowmem.distributed.collectives import all_reduce_sum
    from lowmem.model import IGNORE_INDEX
    from lowmem.train.setup import build_model, prepare_for_training
    from lowmem.train.step import compile_each_shape, train_step

    torch.manual_seed(config.seed)  # the reference builds its model from the same seed: the same initial weights
    plain_model = build_model(config, vocab_size)  # as training builds and prepares it
    flops = (plain_model.estimate_flops_per_token(), plain_model.attention_flops_per_pair())
    n_params = plain_model.num_params()
    model, optimizer = prepare_for_training(plain_model, config, accelerator, settings)
    on_gpu = accelerator.device.type == "cuda"
    if shapes is not None and run_speed_settings(config, accelerator).compile:
        compile_each_shape(model, optimizer, accelerator, shapes, pad_id, config.pack_rows)

    def step(batches: list[dict[str, torch.Tensor]]) -> None:
        tokens = sum(float((batch["targets"] != IGNORE_INDEX).sum()) for batch in batches)  # host tensors
        [global_tokens] = all_reduce_sum(accelerator, [tokens])  # as in training: one small collective per step
        train_step(model, optimizer, accelerator, batches, global_tokens, config.grad_clip)  # nothing read back

    accumulation = config.gradient_accumulation_steps
    ceiling = run_steps("ceiling", iter(in_memory), steps, skip_steps, step, accumulation, pad_id, on_gpu)
    through_pipeline = (run_steps("pipeline", iter(loader), steps, skip_steps, step, accumulation, pad_id, on_gpu)
                        if loader is not None else None)
    return ceiling, through_pipeline, flops, n_params


class _LoopTimer(Callback):
    """Times `Trainer.fit`'s steps after the first `skip_steps`, up to `last`, from one synchronisation of the
    device to another: every log line, cleanup and memory record that falls in between is in the time."""

    def __init__(self, skip_steps: int, last: int, pad_id: int, on_gpu: bool) -> None:
        self.skip_steps, self.last, self.pad_id, self.on_gpu = skip_steps, last, pad_id, on_gpu
        self.result = PhaseResult("trainer", 0, 0.0, 0)
        self.sampler = RssSampler()
        self.started: float | None = None

    def on_train_start(self, trainer: Any) -> None:
        self.last = min(self.last, trainer.total_steps)
        if self.skip_steps == 0:
            self._start()

    def on_step_end(self, trainer: Any, result: Any) -> None:
        step = trainer.state.step
        if step == self.skip_steps:
            self._start()
        elif self.skip_steps < step <= self.last:
            self.result.tokens += result.input_tokens
            self.result.attention_pairs += result.attention_pairs
            self.result.steps += 1
            self.sampler.sample()
            if step == self.last and self.started is not None:
                _synchronize(self.on_gpu)
                self.result.seconds = time.perf_counter() - self.started
                self.result.peak_rss = self.sampler.peak
                self.result.peak_gpu_bytes = torch.cuda.max_memory_allocated() if self.on_gpu else 0

    def _start(self) -> None:
        _synchronize(self.on_gpu, new_peak=True)
        self.started = time.perf_counter()


def measure_trainer_phase(config: TrainConfig, accelerator: Any, folder: Path, steps: int, skip_steps: int,
                          pad_id: int) -> PhaseResult:
    """(t): the training loop itself, `Trainer.fit`, on the same rows (the same file, seed and processes: the
    pipeline's first batches), with every default of the loop on, into a run folder in `folder`. Its steps are
    timed as the other phases' are (`_LoopTimer`); the validation at step 0, the one checkpoint (saves fall after
    the timed steps) and the final export are outside the time. Its model and optimizer are freed on return."""
    from lowmem.run_files import LAUNCH_LOG_DIR
    from lowmem.train.trainer import Trainer

    total = skip_steps + steps
    run = dataclasses.replace(config, output_dir=str(folder / "trainer-run"), max_steps=total, save_steps=10 * total,
                              eval_steps=0, eval_batches=1, eval_bleu_samples=0, sample_max_new_tokens=1,
                              progress=False)
    timer = _LoopTimer(skip_steps, total, pad_id, accelerator.device.type == "cuda")
    trainer = Trainer(run, accelerator, callbacks=[timer])
    trainer.fit()
    link = Path(LAUNCH_LOG_DIR) / trainer.memory.memory_logger.path.name  # a link into a folder about to go
    if link.is_symlink():
        link.unlink()
    del trainer
    free_training_state(config, accelerator)
    if timer.result.steps == 0:
        raise RuntimeError("The data ran out before the timed steps of phase (t): use a larger file or fewer steps.")
    return timer.result


def free_training_state(config: TrainConfig, accelerator: Any) -> None:
    """Free lowmem's model and optimizer, which nothing of the caller refers to any more, so that the reference
    phase starts from the same empty device."""
    accelerator.free_memory()  # accelerate keeps every model and optimizer it prepared (and DeepSpeed's engine)
    if run_speed_settings(config, accelerator).compile:
        torch._dynamo.reset()  # the compiled graphs, and the memory pools of any CUDA graphs they recorded
    gc.collect()
    if accelerator.device.type == "cuda":
        torch.cuda.empty_cache()


def measure_reference_phase(config: TrainConfig, accelerator: Any, vocab_size: int,
                            in_memory: list[dict[str, torch.Tensor]], steps: int, skip_steps: int,
                            pad_id: int, shapes: FixedShapes | None = None) -> PhaseResult | None:
    """(r): lowmem's models and optimizers freed (`free_training_state`, by the caller), a fresh model of the same
    configuration and seed trained on the ceiling's batches by `plain_loop_step`, with the same number of untimed
    and timed steps (and, compiled, both fixed `shapes` compiled first, as lowmem's).

    It runs on every rank on its own (no collective: a per-device reference) with the whole model and its
    optimizer state on the device, which a sharded (FSDP, DeepSpeed) run may not have room for: returns None
    when the GPU runs out of memory.
    """
    try:
        return _train_plain_loop(config, accelerator.device, vocab_size, in_memory, steps, skip_steps, pad_id,
                                 run_speed_settings(config, accelerator), shapes)
    except torch.cuda.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return None


def _train_plain_loop(config: TrainConfig, device: torch.device, vocab_size: int,
                      in_memory: list[dict[str, torch.Tensor]], steps: int, skip_steps: int,
                      pad_id: int, speed: SpeedSettings, shapes: FixedShapes | None) -> PhaseResult:
    from lowmem.train.setup import build_model

    # A plain loop computes the whole logits and keeps every activation: lowmem's memory savers off (in the
    # config, so that the model's log line says so too).
    config = dataclasses.replace(config, loss_chunk_tokens=0, activation_checkpointing=False)
    torch.manual_seed(config.seed)  # lowmem's model was built from the same seed: the same initial weights
    model = build_model(config, vocab_size).to(device)
    betas = (config.adam_beta1, config.adam_beta2)
    # The fused AdamW on a GPU, as lowmem's.
    optimizer = model.configure_optimizer(config.weight_decay, config.learn_rate, betas, device_type=device.type)
    trained = compile_like_training(model, config, speed)
    if speed.compile and shapes is not None:
        # As lowmem's step compiled every shape before its first step: neither phase times a compilation.
        compile_plain_loop_shapes(trained, optimizer, config, device, shapes, pad_id)

    def step(batches: list[dict[str, torch.Tensor]]) -> None:
        plain_loop_step(trained, optimizer, batches, config, device)  # nothing read back, as lowmem's step

    return run_steps("reference", iter(in_memory), steps, skip_steps, step, config.gradient_accumulation_steps,
                     pad_id, device.type == "cuda")


def compile_plain_loop_shapes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: OptimConfig,
                              device: torch.device, shapes: FixedShapes, pad_id: int) -> None:
    """A forward and backward pass of padding in each fixed shape (no target counts, no step, gradients dropped,
    random state restored): the compiled plain loop's graphs, made before its timed steps."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for input_ids, targets in shapes.padding_batches(pad_id):
            # Packed rows attend through segment ids, as the timed steps will (padding only: it attends to padding).
            segment_ids = torch.zeros_like(input_ids).to(device) if config.pack_rows else None
            with inference_autocast(device, config.bf16, config.bf16_on_cpu):
                loss = model(input_ids.to(device), targets.to(device), segment_ids=segment_ids)[1]
            loss.backward()
            optimizer.zero_grad(set_to_none=True)


def compile_like_training(model: torch.nn.Module, config: OptimConfig, speed: SpeedSettings) -> torch.nn.Module:
    """`torch.compile(model)` with the backend of lowmem's model when training compiles it (`speed`), else `model`.

    For fixed batch shapes the graph is compiled for exactly those shapes, as lowmem's is; the compile mode
    stays torch's default, as a plain loop writes it.
    """
    if not speed.compile:
        return model
    # torch types compile's result as a plain callable; given a Module it returns an OptimizedModule (a Module).
    return torch.compile(model, backend=config.compile_backend,  # type: ignore[return-value]
                         dynamic=False if speed.static_shapes else None)


def plain_loop_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    micro_batches: list[dict[str, torch.Tensor]], config: OptimConfig,
                    device: torch.device) -> torch.Tensor:
    """One optimizer step as a plain PyTorch loop writes it: forward under training's autocast, the mean loss
    over the step's counted tokens, backward, clip, AdamW step. No accelerate; the same attention as lowmem's step
    (each packed row within itself, through the batch's segment ids, as any loop that packs rows must).

    Returns the step's mean token loss, on the device.
    """
    from lowmem.model import IGNORE_INDEX

    # Counted on the host, where the batches are: no wait for the device.
    counted = [int((batch["targets"] != IGNORE_INDEX).sum()) for batch in micro_batches]
    step_tokens = max(sum(counted), 1)
    loss_sum = torch.zeros((), device=device)
    for batch, batch_tokens in zip(micro_batches, counted):
        input_ids = batch["input_ids"].to(device, non_blocking=True)  # (B, T)
        targets = batch["targets"].to(device, non_blocking=True)  # (B, T)
        segment_ids = batch["segment_ids"].to(device, non_blocking=True) if "segment_ids" in batch else None
        with inference_autocast(device, config.bf16, config.bf16_on_cpu):  # bf16 exactly where training uses it
            loss = model(input_ids, targets, segment_ids=segment_ids)[1] * batch_tokens / step_tokens  # its share
        loss.backward()
        loss_sum += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip if config.grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum


def describe_run(config: TrainConfig, accelerator: Any, settings: Any, n_params: int, device: str, steps: int,
                 skip_steps: int) -> str:
    """The table's first line: the model, the processes and strategy, the device, and every setting that
    changes what a step costs."""
    from lowmem.distributed.strategy import describe

    return (f"bench_train: {n_params / 1e6:.1f} M parameters, {accelerator.num_processes} process(es) on "
            f"{accelerator.device.type} ({device}), {describe(accelerator)}, batch {config.batch_size_per_gpu} x "
            f"{config.gradient_accumulation_steps} per process, max_seq_len {config.max_seq_len}, "
            f"pack_rows={config.pack_rows}, compile={run_speed_settings(config, accelerator).compile}, "
            f"loss_chunk_tokens={config.loss_chunk_tokens}, "
            f"activation_checkpointing={config.activation_checkpointing}, "
            f"malloc_mmap_threshold_mb={config.malloc_mmap_threshold_mb}, "
            f"workers per process {settings.num_workers}, ultra_low_mem={settings.ultra_low_mem}; "
            f"{steps} timed steps after {skip_steps}; data: {config.train_file}")


def _first(loader: Any, count: int) -> Iterator[dict[str, torch.Tensor]]:
    for index, batch in enumerate(loader):
        if index == count:
            return
        yield batch


def format_table(per_rank: list[dict[str, Any]], flops_per_token: int, peak_tflops: float,
                 attention_flops_per_pair: int = 0, max_seq_len: int = 0) -> str:
    """One line per phase, all ranks combined: tokens/s summed, time and data wait of the slowest rank, the MFU
    with attention over the rows' real lengths (with `attention_flops_per_pair` and `max_seq_len`; else over
    max_seq_len, as `flops_per_token` counts it); then lowmem's step and loop against the plain loop's, and the
    memory figures."""
    def combined(name: str) -> tuple[float, float, list[int], int]:
        phases = [rank[name] for rank in per_rank]
        seconds = max(phase.seconds for phase in phases)
        tokens_per_second = sum(phase.tokens for phase in phases) / max(seconds, 1e-9)
        wait = max(phase.data_wait_seconds / max(phase.seconds, 1e-9) for phase in phases)
        return tokens_per_second, wait, [phase.peak_rss for phase in phases], max(p.peak_gpu_bytes for p in phases)

    def flops_per_token_of(name: str) -> float:
        tokens = sum(rank[name].tokens for rank in per_rank)
        pairs = sum(getattr(rank[name], "attention_pairs", 0) for rank in per_rank)
        if not (attention_flops_per_pair and max_seq_len and tokens and pairs):
            return flops_per_token
        return flops_per_token - attention_flops_per_pair * max_seq_len + attention_flops_per_pair * pairs / tokens

    ceiling_rate = combined("ceiling")[0]
    lines = ["| phase | tokens/s | vs ceiling | data wait | peak RSS per process MB | peak GPU MB | MFU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    # A rank whose reference ran out of GPU memory has none: the row would compare unequal work.
    out_of_memory = [index for index, rank in enumerate(per_rank)
                     if rank.get("reference_ran") and rank["reference"] is None]
    phases = [name for name in PHASE_LABELS
              if name not in ("pipeline", "trainer", "reference") or all(rank.get(name) for rank in per_rank)]
    for name in phases:
        rate, wait, rss, gpu = combined(name)
        training = name != "data"
        utilisation = mfu(rate, flops_per_token_of(name), peak_tflops, devices=len(per_rank)) if training else None
        lines.append(
            f"| {PHASE_LABELS[name]} | {rate:,.0f} | {rate / ceiling_rate:.2f} | "
            f"{f'{wait:.2%}' if name in ('ceiling', 'pipeline', 'reference') else '-'} | "
            f"{' / '.join(f'{value / DECIMAL_MB:,.0f}' for value in rss)} | "
            f"{f'{gpu / DECIMAL_MB:,.0f}' if gpu else '-'} | {'-' if utilisation is None else f'{utilisation:.1%}'} |"
        )
    lines.append("")
    if "reference" in phases:
        lines.append(f"lowmem's step / plain loop: (a)/(r) = {ceiling_rate / combined('reference')[0]:.2f} "
                     "(same batches, same model, same attention)")
        if "trainer" in phases:
            lines.append(f"the training loop / plain loop: (t)/(r) = "
                         f"{combined('trainer')[0] / combined('reference')[0]:.2f} (what the users' command pays, "
                         "its log lines, cleanups and memory records included, against a plain loop)")
    elif out_of_memory:
        lines.append(f"(r) plain PyTorch loop: out of GPU memory on rank(s) {', '.join(map(str, out_of_memory))} "
                     "(the whole model, its AdamW state and the whole logits on each device); --reference=False "
                     "skips it")
    share = " / ".join(f"{rank['data_rss'] / DECIMAL_MB:,.0f}" for rank in per_rank)
    high_water = " / ".join(f"{rank['high_water'] / DECIMAL_MB:,.0f}" for rank in per_rank)
    total_high_water = sum(rank["high_water"] for rank in per_rank) / DECIMAL_MB
    ratio = f"(b)/(a) = {combined('pipeline')[0] / ceiling_rate:.3f}; " if "pipeline" in phases else ""
    predicted = " / ".join(f"{rank['predicted'] / DECIMAL_MB:,.0f}" for rank in per_rank if rank.get("predicted"))
    lines.append(f"{ratio}RSS the data pipeline adds per process: {share} MB; "
                 f"process high-water RSS: {high_water} MB (sum {total_high_water:,.0f} MB)"
                 + (f"; predicted by the memory plan: {predicted} MB" if predicted else ""))
    return "\n".join(lines)
