"""Fitting a run to its memory budget before anything is built: the plan, the savers it needs, the resume.

`settle_memory` runs right after the Accelerator exists and before any file is written (logs, lock,
tokenizer): rank 0 measures what it can (its own RSS, a sample of the training rows, the footers), plans
(`lowmem.memory.plan`), turns on the memory savers the plan needs (`lowmem.memory.levers`) and broadcasts
the decision, so every rank runs with the same settings. With nothing that fits, every rank stops with one
paragraph (exit code 2) and nothing on disk.

The savers chosen are part of the run: they are saved with every checkpoint, and `--is_keep_training=True`
applies the same ones again (the batches, and so the resume, stay exact), saying so when the budget changed.

What the plan decided on the way is handed to the Trainer with the decision, which decides none of it again:
the speed settings and the data settings (every rank), and what rank 0 read to plan (`Measured`: the tokenizer,
the training data's index and the sample of its row lengths), which rank 0 goes on with.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection

import psutil
import torch

from lowmem.config import TokenizerConfig, TrainConfig
from lowmem.config.columns import data_columns, is_preference
from lowmem.preference.reference import COPY, copy_bytes, reference_mode
from lowmem.config.train_sources import training_paths
from lowmem.data.lengths import WHOLE_SHARE, cut_rows_line, rows_cut
from lowmem.data.collate import FixedShapes
from lowmem.data.sizing import BatchSizes, data_pipeline_bytes, sample_batch_sizes
from lowmem.data.sources import RowGroupIndex, build_row_group_index
from lowmem.tokenization.text_tokenizer import TextTokenizer, has_tokenizer, load_tokenizer
from lowmem.distributed.performance import SpeedSettings
from lowmem.errors import ConfigError, LowmemError
from lowmem.memory.budget import budget_source
from lowmem.memory.data_settings import MemorySettings, decide_memory_settings
from lowmem.memory.largest import largest_line, largest_models
from lowmem.memory.levers import LEVER_FIELDS, SaverChoice, choose_savers, no_fit_message, plan_inputs_of_levers
from lowmem.memory.plan import (CUDA_CONTEXT_DEVICE_BYTES, DDP, DEEPSPEED, FSDP, SINGLE, MemoryPlan, ModelShape,
                                PlanInputs, format_plan, plan_memory)
from lowmem.program import command_line, launch_line
from lowmem.source.load import load_slice_bytes
from lowmem.source.settle import StartingPoint
from lowmem.units import GIB, gib_text

logger = logging.getLogger(__name__)

# Where a checkpoint's trainer state keeps the savers the run chose (with the budget they were chosen for).
SAVED_KEY = "memory_savers"


def model_shape(config: TrainConfig, vocab_size: int, start: StartingPoint | None = None) -> ModelShape:
    """The GPT's sizes and parameter counts, from a model built on the meta device (no memory, no time): the one
    `config` asks for, or the model a run starts from (`start`)."""
    from lowmem.model import GPT
    from lowmem.train.setup import model_config_for

    from lowmem.adapters.lora import ADAPTER_MARK, LoRASpec, adapter_layers, add_adapters

    with torch.device("meta"):
        model = GPT(model_config_for(config, vocab_size, start))
    params, block_params = model.num_params(), sum(p.numel() for p in model.blocks[0].parameters())
    spec = LoRASpec.of(config)
    if spec is not None:
        add_adapters(model, spec)  # on the meta device too: only the counts are read
    adapters = sum(p.numel() for name, p in model.named_parameters() if ADAPTER_MARK in name)
    # With dropout, each adapted Linear keeps its input's dropped-out copy (float32) and mask (1 B) per part.
    dropout_bytes = 0 if spec is None or not spec.dropout else sum(
        5 * layer.in_features * len(layer.lora_A) for _, layer in adapter_layers(model))
    gpt = model.config
    return ModelShape(n_layer=gpt.n_layer, n_embd=gpt.n_embd, n_head=gpt.n_head, mlp_hidden=gpt.mlp_hidden,
                      padded_vocab=gpt.padded_vocab_size, max_seq_len=gpt.max_seq_len, architecture=gpt.architecture,
                      params=params, block_params=block_params, adapter_params=adapters,
                      adapter_dropout_bytes=dropout_bytes, tied_head=gpt.tie_embeddings)


def measure_base_bytes() -> int:
    """This process's RSS now: the interpreter and libraries, before the model exists."""
    return psutil.Process().memory_info().rss


def tokenizer_folder(config: TokenizerConfig, start: StartingPoint | None = None) -> Path:
    """Where the tokenizer the run will use is: that of the model it starts from (`start`), else `tokenizer_dir`."""
    return start.tokenizer_folder if start is not None and start.tokenizer_folder is not None else \
        Path(config.tokenizer_dir)


def existing_tokenizer(config: TokenizerConfig, start: StartingPoint | None = None) -> TextTokenizer | None:
    """The tokenizer the run will use (`tokenizer_folder`); None when none has been trained there yet."""
    folder = tokenizer_folder(config, start)
    if not has_tokenizer(folder):
        return None
    try:
        return load_tokenizer(folder)
    except LowmemError:
        return None


@dataclass
class Measured:
    """What rank 0 read to plan, which the run goes on with rather than reading it again: the tokenizer (and its
    folder; None when none existed yet), the training data's row-group index, and the sample of its row lengths
    (counted in the tokenizer's tokens when there was one, else estimated from characters). Never sent to other
    ranks."""

    tokenizer: TextTokenizer | None = None
    tokenizer_folder: Path | None = None
    index: RowGroupIndex | None = None
    sizes: BatchSizes | None = None

    def sample_if_tokenized(self) -> BatchSizes | None:
        """The sample of row lengths when it was counted in tokens (fixed shapes need real lengths)."""
        return self.sizes if self.tokenizer is not None else None


@dataclass(frozen=True)
class RunLayout:
    """How the run is spread: the strategy, the processes, the device."""

    strategy: str  # single, ddp, fsdp or deepspeed
    processes: int  # on this machine
    world_size: int
    device: str  # cpu or cuda
    bf16: bool = False
    deepspeed_offload: bool = False
    launcher: bool = False
    gpu_bytes: int = 0


def layout_of(accelerator: Any) -> RunLayout:
    """The layout an Accelerator was launched with."""
    from lowmem.distributed.accelerator import offloads_optimizer
    from lowmem.distributed.collectives import local_processes
    from lowmem.distributed.launcher_watch import started_by_a_launcher
    from lowmem.distributed.strategy import DEEPSPEED as ACCELERATE_DEEPSPEED, FSDP as ACCELERATE_FSDP, strategy

    kind = strategy(accelerator)
    name = {ACCELERATE_FSDP: FSDP, ACCELERATE_DEEPSPEED: DEEPSPEED}.get(kind, DDP if accelerator.num_processes > 1
                                                                      else SINGLE)
    on_gpu = accelerator.device.type == "cuda"
    gpu_bytes = 0
    if on_gpu:
        # What the device has free (another process may hold part of it), with this process's own context,
        # which the plan counts, given back.
        free, total = torch.cuda.mem_get_info(accelerator.device)
        gpu_bytes = min(total, free + CUDA_CONTEXT_DEVICE_BYTES)
    return RunLayout(strategy=name, processes=local_processes(accelerator), world_size=accelerator.num_processes,
                     device=accelerator.device.type, bf16=accelerator.mixed_precision == "bf16",
                     deepspeed_offload=offloads_optimizer(accelerator), launcher=started_by_a_launcher(),
                     gpu_bytes=gpu_bytes)


@dataclass
class Planned:
    """The plan's inputs, the largest micro-batch's positions for any number of rows (the levers need it for smaller
    micro-batches), and the settings decided on the way (`plan_inputs`)."""

    inputs: PlanInputs
    positions_for_rows: Callable[[int], int]
    speed: SpeedSettings
    settings: MemorySettings
    measured: Measured


def plan_inputs(config: TrainConfig, layout: RunLayout, base_bytes: int | None = None,
                tokenizer: TextTokenizer | None = None,
                start: StartingPoint | None = None, resuming: bool = False) -> Planned:
    """The plan's inputs for `config` run as `layout` (starting from `start`'s model when given, with `tokenizer`
    when one exists; `resuming` a checkpoint, whose optimizer state is loaded with the weights), and the speed and
    data settings decided on the way."""
    from lowmem.distributed.performance import compile_worker_processes, speed_settings

    speed = speed_settings(config, layout.device, sharded=layout.strategy in (FSDP, DEEPSPEED))
    index = build_row_group_index(training_paths(config), data_columns(config))
    preference = is_preference(config)  # two unpacked sequences per row, shaped to fit
    sizes: BatchSizes = sample_batch_sizes(index, config.max_seq_len, config.pack_rows and not preference,
                                           tokenizer=tokenizer, seed=config.seed)
    cache: dict[int, int] = {}

    def positions_for_rows(rows: int) -> int:
        if preference:
            return 2 * sizes.largest_positions(rows)
        if speed.static_shapes:  # the largest of the fixed shapes
            return FixedShapes.larger_positions(rows, config.max_seq_len)
        if rows not in cache:
            cache[rows] = sizes.largest_positions(rows)
        return cache[rows]

    vocab = tokenizer.vocab_size if tokenizer is not None else config.vocab_size
    settings = decide_memory_settings(config.ultra_low_mem, config.dataloader_num_workers,
                                      config.ultra_low_mem_threshold_gb, local_processes=layout.processes,
                                      on_gpu=layout.device == "cuda", budget_gb=config.memory_budget_gb)
    prompts = _generation_prompts(config, layout.world_size)
    shape = model_shape(config, vocab, start)
    inputs = PlanInputs(
        model=shape,
        micro_batch_positions=positions_for_rows(config.batch_size_per_gpu),
        # FlexAttention's block mask is a few kB: only SDPA's boolean mask grows with the positions.
        sequence_width=config.max_seq_len,
        masked_attention=config.pack_rows and not preference and speed.attention == "sdpa",
        micro_batch_rows=config.batch_size_per_gpu,  # a preference row's two sequences: in the positions
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        **plan_inputs_of_levers(config), strategy=layout.strategy,
        deepspeed_offload=layout.deepspeed_offload, processes=layout.processes, world_size=layout.world_size,
        device=layout.device, bf16=layout.bf16, workers=settings.num_workers,
        base_bytes=measure_base_bytes() if base_bytes is None else base_bytes,
        data_bytes=data_pipeline_bytes(index, config.dataloader_mix_row_groups, config.dataloader_buffer_size),
        eval_positions=config.batch_size_per_gpu * config.max_seq_len * (2 if preference else 1),
        generation_rows=min(config.batch_size_per_gpu, prompts), generation_prompts=prompts,
        generation_positions=config.max_seq_len,
        launcher=layout.launcher, gpu_bytes=layout.gpu_bytes, tokens_estimated=tokenizer is None,
        compiled=speed.compile, compile_workers=compile_worker_processes(settings.low_budget) if speed.compile else 0,
        load_chunk_bytes=load_slice_bytes(start.source) if start is not None and start.source is not None else 0,
        static_shapes=speed.static_shapes and not preference,
        reference_bytes=_reference_copy_bytes(config, layout, shape), resuming=resuming,
        mirrors_cuda=config.mirror_cuda and layout.device == "cpu",
    )
    measured = Measured(tokenizer=tokenizer, index=index, sizes=sizes)
    return Planned(inputs, positions_for_rows, speed, settings, measured)


def _reference_copy_bytes(config: TrainConfig, layout: RunLayout, shape: ModelShape) -> int:
    """A DPO run's frozen copy of its starting model (`lowmem.preference.reference`): the blocks' matrices in bf16
    where the run computes in bf16 autocast (the rule of `copy_in_bf16`), the rest in float32; 0 where the reference
    needs no copy."""
    if reference_mode(config) != COPY:
        return 0
    blocks = shape.n_layer * shape.block_params
    return copy_bytes(blocks, shape.params - blocks, half=layout.bf16)


def _generation_prompts(config: TrainConfig, world_size: int) -> int:
    """A rank's share of the prompts BLEU-4 answers (none for one text column, which has no prompts to answer);
    a generation batch holds at most batch_size_per_gpu of them."""
    samples = 0 if config.text_column else config.eval_bleu_samples
    if samples < 0:
        try:
            samples = build_row_group_index(config.validation_file, data_columns(config)).num_rows
        except LowmemError:
            samples = config.batch_size_per_gpu * world_size
    return -(-samples // world_size)


@dataclass
class MemoryDecision:
    """What rank 0 decided, for every rank: the config changes, the plan, the speed and data settings, the lines to
    log, or why to stop; and, on rank 0 only, what it read to decide (`measured`)."""

    changes: dict[str, Any] = field(default_factory=dict)
    plan: MemoryPlan | None = None
    budget_bytes: int = 0
    lines: list[str] = field(default_factory=list)  # logged at start, after the training log exists
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    speed: SpeedSettings | None = None
    settings: MemorySettings | None = None
    measured: Measured = field(default_factory=Measured)

    def __getstate__(self) -> dict[str, Any]:
        """What other ranks receive: the decision, not what rank 0 read to make it (each reads its own once)."""
        return {**self.__dict__, "measured": Measured()}

    def predicted_high_water(self, main: bool) -> int | None:
        return None if self.plan is None else self.plan.high_water(main)

    def summary(self) -> str:
        """One sentence with the plan's figures, for messages about memory."""
        if self.plan is None:
            return ""
        main, total = self.plan.high_water(True), self.plan.machine_total
        return (f"The memory plan predicted {main / 2**20:,.0f} MB per process and {total / 2**20:,.0f} MB for this "
                f"machine against a {gib_text(self.budget_bytes)} budget (`{command_line('plan ...')}` with the "
                "same flags shows it part by part).")

    def saved_record(self) -> dict[str, Any]:
        """What a checkpoint keeps of the decision, so that a resume makes the same one."""
        return {"changes": self.changes, "budget": self.budget_bytes,
                "predicted_high_water": self.predicted_high_water(True)}


def decide(config: TrainConfig, layout: RunLayout, explicit: Collection[str],
           saved_choice: dict[str, Any] | None = None, base_bytes: int | None = None,
           start: StartingPoint | None = None, largest: bool = False) -> MemoryDecision:
    """Plan the run and choose its memory savers (rank 0's work in `settle_memory`); errors come back as data.
    A resume keeps `saved_choice`, the choice saved with the checkpoint it continues from
    (`lowmem.train.startup.SavedRun.memory_choice`); a run started from a model plans that model (`start`). With
    `largest`, and under FSDP always, the plan says the largest model of these proportions the host trains."""
    try:
        return _decide(config, layout, explicit, saved_choice, base_bytes, start, largest)
    except LowmemError as error:
        return MemoryDecision(error=str(error))


def _largest_line(config: TrainConfig, planned: Planned, budget: int, explicit: Collection[str],
                  start: StartingPoint | None) -> str:
    """`lowmem.memory.largest`'s line for this run: its model scaled, trained in full and with adapters (the run's
    own, else rank 16 on every projection), the savers chosen for each size."""
    inputs = planned.inputs
    rank = config.lora_rank or 16
    if inputs.model.adapter_params:
        adapters = inputs.model
    else:
        tokenizer = planned.measured.tokenizer
        vocab = tokenizer.vocab_size if tokenizer is not None else config.vocab_size
        adapters = model_shape(dataclasses.replace(config, lora_rank=rank), vocab, start)
    found = largest_models(inputs, adapters, rank, budget, explicit, planned.positions_for_rows)
    return largest_line(found, inputs.model.architecture)


def _decide(config: TrainConfig, layout: RunLayout, explicit: Collection[str], saved: dict[str, Any] | None,
            base_bytes: int | None, start: StartingPoint | None = None, largest: bool = False) -> MemoryDecision:
    budget = int(config.memory_budget_gb * GIB) if config.memory_budget_gb > 0 else None
    if budget is None:
        from lowmem.memory.budget import memory_budget_bytes

        budget = memory_budget_bytes()
    source = budget_source(config.memory_budget_gb)
    decision = MemoryDecision(budget_bytes=budget)
    if config.memory_savers == "auto" and saved is not None:
        # A resumed run keeps the savers it chose, whatever this host's budget: the batches stay the same.
        decision.changes = {name: value for name, value in saved.get("changes", {}).items()
                            if name in LEVER_FIELDS and name not in explicit}
        config = dataclasses.replace(config, **decision.changes)
    planned = plan_inputs(config, layout, base_bytes, existing_tokenizer(config, start), start,
                          resuming=saved is not None)
    inputs, positions_for_rows = planned.inputs, planned.positions_for_rows
    decision.speed, decision.settings, decision.measured = planned.speed, planned.settings, planned.measured
    decision.measured.tokenizer_folder = tokenizer_folder(config, start)
    if config.memory_savers == "off" or saved is not None:
        decision.plan = plan_memory(inputs)
        if saved is not None:
            decision.lines.append(_resume_line(saved, decision, budget))
        if not decision.plan.fits(budget):
            decision.warnings.append(
                f"The memory plan predicts {decision.plan.machine_total / 2**20:,.0f} MB for this machine, more than "
                f"the {gib_text(budget)} budget ({source}) less 10%: the run may be OOM-killed."
                + (" --memory_savers=auto chooses savers that fit." if config.memory_savers == "off" else
                   " Resume with --allow_config_change=True to choose the memory savers again for this budget."))
    else:
        choice: SaverChoice = choose_savers(inputs, budget, explicit, positions_for_rows)
        decision.plan, decision.changes = choice.plan, choice.changes
        if choice.fits:
            decision.lines.append(choice.line())
        else:
            launch = launch_line(f"--config_file configs/accelerate/fsdp.yaml --num_processes {inputs.processes}",
                                 "train ...") + " (your flags)"
            decision.error = no_fit_message(choice, explicit, launch, positions_for_rows)
    decision.lines.insert(0, format_plan(decision.plan, budget, source))
    if largest or layout.strategy == FSDP:
        decision.lines.insert(1, _largest_line(config, planned, budget, explicit, start))
    _say_rows_cut(decision, config.max_seq_len)
    return decision


def _say_rows_cut(decision: MemoryDecision, max_seq_len: int) -> None:
    """The sampled rows --max_seq_len cuts (counted in tokens only): a warning above 1 - WHOLE_SHARE of them, a line
    below."""
    sizes = decision.measured.sizes
    if sizes is None or sizes.estimated:
        return
    line = cut_rows_line(sizes.lengths, max_seq_len)
    if line is not None:
        many = rows_cut(sizes.lengths, max_seq_len) > (1 - WHOLE_SHARE) * len(sizes.lengths)
        (decision.warnings if many else decision.lines).append(line)


def _resume_line(saved: dict[str, Any], decision: MemoryDecision, budget: int) -> str:
    """What the resume keeps of the run's memory savers, and what changed with the budget."""
    changes = ", ".join(f"--{name}={value}" for name, value in saved.get("changes", {}).items()) or "none"
    old = int(saved.get("budget") or 0)
    text = f"Memory savers of the run kept for an exact resume: {changes}"
    if old and abs(old - budget) >= 2**20:
        text += (f". They were chosen for a {gib_text(old)} budget; this host gives {gib_text(budget)} "
                 "(--allow_config_change=True chooses them again, and the batches may then differ)")
    return text + "."


def settle_memory(config: TrainConfig, accelerator: Any, explicit: Collection[str],
                  saved_choice: dict[str, Any] | None = None,
                  start: StartingPoint | None = None) -> tuple[TrainConfig, MemoryDecision]:
    """Rank 0 plans and chooses the memory savers; every rank gets the same decision and config (a resume:
    `saved_choice`, the choice saved with the checkpoint it continues from; a run started from a model: `start`).

    Raises ConfigError (on every rank; only the main process's says why) when nothing fits.
    """
    from lowmem.distributed.collectives import broadcast_from_main

    layout = layout_of(accelerator)
    decision = broadcast_from_main(accelerator, lambda: decide(config, layout, explicit, saved_choice, start=start))
    if decision.error is not None:
        raise ConfigError(decision.error if accelerator.is_main_process else "")
    if decision.changes:
        config = dataclasses.replace(config, **decision.changes)
        accelerator.gradient_accumulation_steps = config.gradient_accumulation_steps
    return config, decision


def log_decision(decision: MemoryDecision) -> None:
    """The plan's table and the savers' line, once (main process), and any warning."""
    for line in decision.lines:
        logger.info(line)
    for warning in decision.warnings:
        logger.warning(warning)

