"""Building the parts a Trainer is made of: tokenizer, memory settings, model and optimizer, loader, monitor."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Collection

import torch
from accelerate import Accelerator

from lowmem.checkpoint.contents import RESUME_ONLY
from lowmem.checkpoint.folders import CheckpointManager
from lowmem.checkpoint.listing import CheckpointFolders
from lowmem.config import ModelConfig, OptimConfig, TrainConfig
from lowmem.config.columns import data_columns, response_only
from lowmem.config.settle import NEW_RUN_ARCHITECTURE
from lowmem.config.train_sources import Source, training_paths
from lowmem.data import ParquetStream, StreamLoader
from lowmem.data.mixture import MixedStream
from lowmem.data.collate import FixedShapes, TokenizingCollate
from lowmem.preference.collate import PreferenceCollate
from lowmem.data.loader import Collate
from lowmem.preference.reference import COPY, reference_mode
from lowmem.data.sizing import BatchSizes, sample_batch_sizes
from lowmem.data.sources import RowGroupIndex, build_row_group_index, resolve_data_files
from lowmem.data.stream_type import RowStream
from lowmem.tokenization.text_tokenizer import TextTokenizer, copy_tokenizer, has_tokenizer, load_tokenizer
from lowmem.tokenization.sentencepiece_tokenizer import TOKENIZER_FILE, Tokenizer, train_tokenizer
from lowmem.tokenization.identity import (describe_files, describe_identity, read_training_record,
                                            tokenizer_identity, trained_on_same_files)
from lowmem.distributed.accelerator import log_launcher_precision_note
from lowmem.distributed.collectives import broadcast_from_main, local_processes, run_on_main
from lowmem.eval.validation import METRIC_MODES
from lowmem.distributed.strategy import (DEEPSPEED, FSDP, describe, prepare_model_and_optimizer,
                                         strategy)
from lowmem.errors import ConfigError
from lowmem.memory.cleanup import set_malloc_mmap_threshold
from lowmem.memory.data_settings import MemorySettings, decide_memory_settings
from lowmem.disk_errors import writing
from lowmem.memory.log import MemoryLogger, new_run_id
from lowmem.memory.monitor import MemoryMonitor
from lowmem.memory.phases import PhaseMeter
from lowmem.memory.plan import LOAD, PHASES, MemoryPlan
from lowmem.memory.watchdog import MemoryWatchdog
from lowmem.model import GPT, GPTConfig
from lowmem.model.weights import unwrap_gpt
from lowmem.program import command_line
from lowmem.run_files import LAUNCH_LOG_DIR, run_log_dir
from lowmem.adapters.files import BASE_DIR, base_weights_file, finish_base
from lowmem.adapters.lora import ADAPTER_MARK, LoRASpec, add_adapters
from lowmem.source.load import LoadedWeights, empty_model, fill_model, write_source_weights
from lowmem.source.settle import StartingPoint
from lowmem.train.log import StepLog
from lowmem.distributed.performance import SpeedSettings, enable_tf32, maybe_compile, run_speed_settings

logger = logging.getLogger(__name__)



def model_config_for(config: ModelConfig, vocab_size: int, start: StartingPoint | None = None) -> GPTConfig:
    """The GPT sizes a training config asks for (its architecture settled, see `settle_architecture`), or those of
    the model the run starts from (`start`)."""
    if start is not None:
        return start.model_config
    return GPTConfig(vocab_size=vocab_size, max_seq_len=config.max_seq_len, n_layer=config.n_layer,
                     n_head=config.n_head, n_embd=config.n_embd, dropout=config.dropout,
                     architecture=config.architecture or NEW_RUN_ARCHITECTURE)


def train_tokenizer_for(config: TrainConfig) -> Tokenizer:
    """Train the tokenizer a config asks for; with too little text for `vocab_size`, a smaller one, said so."""
    train_tokenizer(resolve_data_files(training_paths(config)), config.tokenizer_dir, vocab_size=config.vocab_size,
                    columns=data_columns(config),
                    max_sentences=config.tokenizer_max_sentences, seed=config.seed, hard_vocab_limit=False,
                    bad_text=config.bad_text)
    tokenizer = Tokenizer.load(config.tokenizer_dir)
    if tokenizer.vocab_size < config.vocab_size:
        logger.warning("The training text supports %d tokenizer pieces, fewer than vocab_size=%d: using %d.",
                       tokenizer.vocab_size, config.vocab_size, tokenizer.vocab_size)
    return tokenizer


def check_tokenizer_data(config: TrainConfig, explicit: Collection[str]) -> None:
    """Before a new run writes anything: refuse a tokenizer trained on other files than the run's training data
    (its `tokenizer_training.json` says which), unless --tokenizer_dir was given, which keeps it knowingly. A
    tokenizer whose training data was not recorded passes."""
    folder = Path(config.tokenizer_dir)
    if "tokenizer_dir" in explicit or not (folder / TOKENIZER_FILE).is_file():
        return
    record = read_training_record(folder)
    if record is None:
        return
    files = [file.name if file.is_remote else file.path for file in resolve_data_files(training_paths(config))]
    if trained_on_same_files(record, files):
        return
    trained_on = record.get("files") or []
    raise ConfigError(
        f"The tokenizer in {folder} was trained on {describe_files(trained_on, record.get('file_count'))}, not on "
        f"this run's training data ({describe_files(files)}): its pieces were learned from other text. For a "
        f"tokenizer of this data, give a new folder, e.g. --tokenizer_dir={Path(config.output_dir) / 'tokenizer'} "
        f"(it is trained there when the run starts); to train with that tokenizer anyway, give it explicitly: "
        f"--tokenizer_dir={folder}. Nothing was written.")


def ensure_tokenizer(config: TrainConfig, accelerator: Accelerator, start: StartingPoint | None = None,
                     loaded: TextTokenizer | None = None,
                     loaded_from: Path | None = None) -> tuple[TextTokenizer, dict[str, Any]]:
    """Load the tokenizer, made first on the main process (while the others wait): a new run started from a model
    copies the model's into its run folder; any other run trains one if it is missing. The tokenizer the memory plan
    already loaded (`loaded`, from the folder `loaded_from`: `lowmem.train.memory_fit.Measured`) is the one used when
    it is the run's. Returns it with its identity (`tokenizer_identity`), logged in one line."""
    model_path = Path(config.tokenizer_dir) / TOKENIZER_FILE
    copy_from = start.tokenizer_folder if start is not None and start.source is not None else None

    def make_if_missing() -> bool:
        """Whether the run's tokenizer is another than the one read before (trained now, or copied)."""
        if copy_from is not None:  # the source's, copied afresh: the run needs no file of the source to resume
            with writing("the model's tokenizer", config.tokenizer_dir, option="--tokenizer_dir"):
                copy_tokenizer(copy_from, config.tokenizer_dir, came_with=_source_text(start))
            return loaded_from is None or Path(loaded_from) != Path(copy_from)
        if has_tokenizer(config.tokenizer_dir):
            return loaded_from is None or Path(loaded_from) != Path(config.tokenizer_dir)
        logger.info("No tokenizer at %s: training one on %s (vocab_size=%d).", model_path,
                    config.train_sources or config.train_file,
                    config.vocab_size)
        with writing("the tokenizer", config.tokenizer_dir, option="--tokenizer_dir"):
            train_tokenizer_for(config)
        return True

    made = run_on_main(accelerator, make_if_missing)  # a failure there (bad data, a full disk) stops every rank
    tokenizer = loaded if loaded is not None and made is False else load_tokenizer(config.tokenizer_dir)
    identity = {**tokenizer_identity(config.tokenizer_dir), "pieces": tokenizer.vocab_size}
    logger.info("Tokenizer: %d pieces, %s.", tokenizer.vocab_size, describe_identity(identity))
    if start is not None:  # the model's own: its size is the model's, not --vocab_size
        return tokenizer, identity
    if tokenizer.vocab_size != config.vocab_size:
        logger.info("The tokenizer at %s has %d pieces (vocab_size is %d); retrain it with `%s` to change that.",
                    model_path, tokenizer.vocab_size, config.vocab_size,
                    command_line(f"tokenizer --tokenizer_dir={config.tokenizer_dir} --vocab_size=..."))
    return tokenizer, identity


def _source_text(start: StartingPoint | None) -> str | None:
    return start.source.description if start is not None and start.source is not None else None


def shared_memory_settings(config: TrainConfig, accelerator: Accelerator,
                           decided: MemorySettings | None = None) -> MemorySettings:
    """The data settings of the memory budget: those the memory plan decided (`decided`), else decided by rank 0
    and broadcast, so no two ranks run with different settings; said on every rank."""
    settings = decided or broadcast_from_main(accelerator, lambda: decide_memory_settings(
        config.ultra_low_mem, config.dataloader_num_workers, config.ultra_low_mem_threshold_gb,
        local_processes=local_processes(accelerator),
        on_gpu=accelerator.device.type == "cuda", budget_gb=config.memory_budget_gb,
    ))
    # Every rank says what it runs with: the settings rank 0 decided, the same everywhere.
    logger.info("Memory settings (decided by rank 0): %s.", settings.reason, extra={"all_ranks": True})
    return settings


def build_model(config: TrainConfig, vocab_size: int, start: StartingPoint | None = None,
                device: torch.device | None = None, bf16: bool = False) -> GPT:
    """The plain GPT a config asks for, with its memory savers (and the C allocator's threshold) set. A new run
    started from a model gets it unwritten, on `device` (the CPU by default), for its source to fill
    (`lowmem.source.load.empty_model`); the frozen base of adapters in a `bf16` run gets its matrices in bf16, the
    dtype they compute in (2 B a parameter; the adapters, norms and optimizer stay float32)."""
    if set_malloc_mmap_threshold(config.malloc_mmap_threshold_mb):
        logger.info("C allocations of %g MB or more are mapped apart and returned when freed "
                    "(--malloc_mmap_threshold_mb).", config.malloc_mmap_threshold_mb)
    model_config = model_config_for(config, vocab_size, start)
    empty = start is not None and start.source is not None
    halved = bf16 and bool(config.lora_rank)
    model = (empty_model(model_config, device, torch.bfloat16 if halved else None) if empty else GPT(model_config))
    model.use_memory_savers(config.loss_chunk_tokens, config.activation_checkpointing)
    logger.info("Model: %s architecture, %.2f M parameters (%.2f M without embeddings); loss: %s; "
                "activation checkpointing: %s.", model.config.architecture, model.num_params() / 1e6,
                model.num_params(exclude_embeddings=True) / 1e6,
                f"chunks of {config.loss_chunk_tokens} tokens" if config.loss_chunk_tokens else "whole logits",
                "on" if config.activation_checkpointing else "off")
    return model


def prepare_for_training(model: GPT, config: TrainConfig, accelerator: Accelerator, settings: MemorySettings,
                         speed: SpeedSettings | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """`model` and its AdamW, prepared for how accelerate was launched (DDP, DeepSpeed, FSDP), with the attention
    kernel and compilation of the run's speed settings (`speed`, decided here when not given; the compiler's
    worker pool bounded on a low memory budget)."""
    speed = speed or run_speed_settings(config, accelerator)
    model.use_attention(speed.attention)
    prepared, optimizer = prepare_model_and_optimizer(model, config, accelerator)
    logger.info("Parallelism: %s.", describe(accelerator, config))
    if enable_tf32(accelerator.device.type == "cuda"):
        logger.info("TF32 matmuls on: float32 work runs on the tensor cores.")
    return maybe_compile(prepared, config, settings, speed), optimizer


def build_model_and_optimizer(config: TrainConfig, accelerator: Accelerator, vocab_size: int,
                              settings: MemorySettings, speed: SpeedSettings | None = None,
                              start: StartingPoint | None = None
                              ) -> tuple[torch.nn.Module, torch.optim.Optimizer, LoadedWeights | None]:
    """`build_model`, then `prepare_for_training`; a new run started from a model fills it with the model's
    weights (`lowmem.source.load.fill_model`): before the strategy wraps it, or under FSDP after, each rank its own
    shards. Returns what this process loaded, if anything."""
    source = start.source if start is not None else None
    sharded = strategy(accelerator) == FSDP
    # Unsharded, the model is built where it trains, so that the host never holds a copy a GPU will hold; FSDP
    # shards it from the CPU, where the unwritten storage takes no memory.
    model = build_model(config, vocab_size, start, torch.device("cpu") if sharded else accelerator.device,
                        bf16=accelerator.mixed_precision == "bf16")
    loaded = None
    if start is not None and source is not None and not sharded:
        loaded = fill_model(model, source, start.weights)
    spec = LoRASpec.of(config)
    if spec is not None:  # before the strategy wraps the model: DDP and FSDP see the adapters and the frozen base
        check_adapters_strategy(config, accelerator)
        add_adapters(model, spec)
    prepared, optimizer = prepare_for_training(model, config, accelerator, settings, speed)
    if start is not None and source is not None and sharded:
        loaded = fill_model(prepared, source, start.weights)
    return prepared, optimizer, loaded


def check_adapters_strategy(config: ModelConfig, accelerator: Accelerator) -> None:
    """Adapters train with one process, DDP or FSDP2: a DeepSpeed launch is refused (before the run folder is
    touched, by `run_training`)."""
    refuse_adapters_under_deepspeed(config, strategy(accelerator) == DEEPSPEED)


def refuse_adapters_under_deepspeed(config: ModelConfig, deepspeed: bool) -> None:
    """The refusal of `check_adapters_strategy`, also for `plan --strategy=deepspeed`."""
    if config.lora_rank and deepspeed:
        raise ConfigError("Adapters (--lora_rank) train with one process, DDP or FSDP2, not under DeepSpeed, whose "
                          "engine keeps optimizer state for every weight: launch without the DeepSpeed config (the "
                          "adapters' optimizer state is small enough that no offload is needed).")


def keep_starting_model(model: torch.nn.Module, config: TrainConfig, accelerator: Accelerator,
                        start: StartingPoint | None) -> None:
    """A run that trains adapters, or a DPO run whose reference is a frozen copy: when it starts, write the model it
    starts from once into `<run>/base` (`lowmem.adapters.files`), which a resume reads instead of the source (every
    rank calls it, FSDP gathers the weights for the main process); say what trains."""
    spec = LoRASpec.of(config)
    if spec is None and reference_mode(config) != COPY:
        return
    plain = unwrap_gpt(model)
    base = Path(config.output_dir) / BASE_DIR
    if start is not None and start.source is not None and not start.resumed:
        source, run_dir = start.source, Path(config.output_dir)
        def write() -> None:  # from the source's files, as the model was filled: no model is gathered or copied
            write_source_weights(base_weights_file(run_dir), source, start.weights, plain.config)
            finish_base(run_dir, plain.config, source.description, source.folder)

        with writing("the adapters' base model" if spec is not None else "the DPO run's reference model", base):
            run_on_main(accelerator, write)
    if spec is None:
        logger.info("DPO: the starting model is kept once in %s, the frozen reference a resume reads (the source "
                    "may then be gone).", base)
        return
    trainable = sum(parameter.numel() for name, parameter in plain.named_parameters() if ADAPTER_MARK in name)
    total = sum(parameter.numel() for parameter in plain.parameters())
    logger.info("Adapters (LoRA): %s; %s parameters train (%.2f%% of %s), the base's are frozen (no gradients, "
                "no optimizer state). The base is kept once in %s; checkpoints hold the adapters only, best/ and "
                "final/ the merged model and the adapters in peft's files.", spec.describe(), f"{trainable:,}",
                100 * trainable / max(total, 1), f"{total:,}", base)


def make_loader(files: "str | list[Source]", config: TrainConfig, accelerator: Accelerator,
                collate: Collate, settings: MemorySettings, shuffle: bool,
                index: RowGroupIndex | None = None) -> StreamLoader:
    """A StreamLoader over this rank's share of `files`: a path (whose row-group `index` the memory plan may have
    built already), or sources to mix by weight (`training_data`)."""
    arguments = dict(
        columns=data_columns(config), buffer_size=config.dataloader_buffer_size,
        seed=config.seed, rank=accelerator.process_index, world_size=accelerator.num_processes,
        ultra_low_mem=settings.ultra_low_mem, ultra_low_mem_threshold_gb=config.ultra_low_mem_threshold_gb,
        mix_row_groups=config.dataloader_mix_row_groups, bad_text=config.bad_text,
    )
    if isinstance(files, list):
        mixture = MixedStream(files, shuffle=shuffle, **arguments)
        logger.info("Training sources: %s.", mixture.describe())
        stream: RowStream[Any] = mixture
    else:
        stream = ParquetStream(files, shuffle=shuffle, index=index, **arguments)
    return StreamLoader(stream, batch_size=config.batch_size_per_gpu, collate_fn=collate,
                        num_workers=settings.num_workers, pin_memory=settings.pin_memory)


def decide_fixed_shapes(config: TrainConfig, tokenizer: TextTokenizer, sample: BatchSizes | None = None,
                        index: RowGroupIndex | None = None) -> FixedShapes:
    """The shapes of the run's micro-batches (`FixedShapes`), from a sample of the training rows tokenized as
    training will (`sample`, when the memory plan took it with this tokenizer; else taken from `index`, or from
    the training files); said in one line."""
    sizes = sample
    if sizes is None:
        index = index or build_row_group_index(training_paths(config), data_columns(config))
        sizes = sample_batch_sizes(index, config.max_seq_len, config.pack_rows, tokenizer=tokenizer, seed=config.seed)
    shapes = sizes.fixed_shapes(config.batch_size_per_gpu)
    logger.info("Batch shapes: %s (sequences x tokens), fixed for the run so that compiled kernels never meet a new "
                "one; the padding they add is never attended to or counted (--static_shapes=False shapes each "
                "batch to fit).", shapes.describe())
    return shapes


def make_collate(config: TrainConfig, tokenizer: TextTokenizer, accelerator: Accelerator, speed: SpeedSettings,
                 sample: BatchSizes | None, index: RowGroupIndex | None,
                 preference: bool) -> tuple[FixedShapes | None, Collate]:
    """(the fixed batch shapes where the speed settings ask for them, how rows become batches). The main process
    samples the rows for the shapes (the same choice everywhere, and one reading of the sample; `sample` and
    `index` are what the memory plan read already, if anything). Pairs of answers (`preference`) are not packed:
    their batches are shaped to fit."""
    if preference:
        return None, PreferenceCollate(tokenizer, config.max_seq_len, data_columns(config))
    shapes = None if not speed.static_shapes else broadcast_from_main(
        accelerator, lambda: decide_fixed_shapes(config, tokenizer, sample, index))
    return shapes, TokenizingCollate(tokenizer, config.max_seq_len, data_columns(config), response_only(config),
                                     pack=config.pack_rows, fixed_shapes=shapes)


def steps_per_epoch(loader: StreamLoader, config: OptimConfig) -> int:
    """Optimizer steps in one epoch of `loader`; an error that says what to change when there is not one."""
    steps = len(loader) // config.gradient_accumulation_steps
    if steps == 0:
        raise ConfigError(
            f"The training data gives each process {len(loader.stream)} rows: not enough for one optimizer "
            f"step of {config.batch_size_per_gpu} x {config.gradient_accumulation_steps} rows. Lower "
            "--batch_size_per_gpu or --gradient_accumulation_steps, or add data."
        )
    return steps


def begin_load_phase(plan: MemoryPlan | None, is_main: bool) -> PhaseMeter:
    """The meter of this process's phases, the load begun (each phase's peak goes to the memory log beside the plan's
    figure for it: `lowmem.memory.phases`)."""
    phases = PhaseMeter({phase: plan.phase_high_water(phase, is_main) for phase in PHASES} if plan is not None else {})
    phases.enter(LOAD)
    return phases


def make_memory_monitor(config: TrainConfig, accelerator: Accelerator, settings: MemorySettings,
                        predicted_high_water: int | None = None, phases: PhaseMeter | None = None) -> MemoryMonitor:
    """Cleanups, memory records and the watchdog for this rank, on the budget share rank 0 decided.

    The run id (a timestamp) is chosen by rank 0, so that every rank's memory log carries the same one; every
    record carries the memory plan's prediction for this rank's high-water beside the measured one. The logs are
    written in the run folder's logs/, and linked from the launch folder's.
    """
    run_id = broadcast_from_main(accelerator, new_run_id)
    share = settings.per_process_bytes
    memory_logger = MemoryLogger(run_log_dir(config.output_dir), run_id, accelerator.process_index,
                                 accelerator.num_processes, share, predicted_high_water=predicted_high_water,
                                 link_dir=LAUNCH_LOG_DIR)
    watchdog = MemoryWatchdog(share, fraction=config.memory_watchdog_fraction)
    return MemoryMonitor(memory_logger, watchdog, on_gpu=accelerator.device.type == "cuda",
                         cleanup_steps=config.cleanup_steps, memory_log_steps=config.memory_log_steps, phases=phases)


def make_checkpoint_manager(config: TrainConfig, accelerator: Accelerator, all_ok: Callable[[bool], bool],
                            folders: CheckpointFolders | None = None) -> CheckpointManager:
    """The run's checkpoint folders: saved every --save_steps, the latest and the best --keep_latest_n_ckp by
    --best_metric kept, the optimizer state in the newest --keep_optimizer_n_ckp; going on with the start-up's
    listing of the run folder (`folders`) when a resume made one."""
    return CheckpointManager(
        config.output_dir, keep_best_n=config.keep_latest_n_ckp, metric=config.best_metric,
        mode=METRIC_MODES[config.best_metric], is_main=accelerator.is_main_process,
        barrier=accelerator.wait_for_everyone, all_ok=all_ok, save_every=config.save_steps, resume_only=RESUME_ONLY,
        keep_resumable_n=config.keep_optimizer_n_ckp, folders=folders)


def make_step_log(config: TrainConfig, accelerator: Accelerator, model: GPT, planned_steps: int) -> StepLog:
    """The log line every --logging_steps, with the model's FLOPs per token for its MFU."""
    return StepLog(accelerator, planned_steps, config.logging_steps, flops_per_token=model.estimate_flops_per_token(),
                   peak_tflops=config.peak_tflops, attention_flops_per_pair=model.attention_flops_per_pair(),
                   max_seq_len=model.config.max_seq_len)


def log_processes(accelerator: Accelerator, config: TrainConfig) -> None:
    """One line: the processes, their device and mixed precision (and the launcher's note on precision)."""
    logger.info("Processes: %d on %s, mixed precision: %s.", accelerator.num_processes, accelerator.device,
                accelerator.mixed_precision)
    log_launcher_precision_note(accelerator, config.bf16, config.bf16_on_cpu)  # the launcher's "'no'" note
