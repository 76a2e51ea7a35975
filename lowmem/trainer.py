"""The training loop: ParquetStream → tokenizing collate → GPT on Accelerate (1..N processes, CPU or GPU)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from lowmem.data import ParquetStream, StreamLoader
from lowmem.data.collate import IGNORE_INDEX, TokenizingCollate
from lowmem.data.sources import resolve_data_files
from lowmem.evaluate import METRIC_MODES, EvalResult, evaluate
from lowmem.inference import answer
from lowmem.distributed import (all_reduce_max, all_reduce_sum, broadcast_from_main, check_shared_folder,
                                create_accelerator, local_processes)
from lowmem.errors import ConfigError, DataError
from lowmem.memory.log import MemoryLogger, new_run_id
from lowmem.memory.monitor import MemoryMonitor
from lowmem.memory.settings import MemorySettings, decide_memory_settings
from lowmem.memory.watchdog import MemoryWatchdog
from lowmem.model import GPT, GPTConfig
from lowmem.schedule import get_lr
from lowmem.settings import check_data_files, validate_config
from lowmem.tokenizer import Tokenizer, train_tokenizer
from lowmem.checkpoint import CheckpointManager
from lowmem.signals import GracefulStop
from lowmem.model_io import export_checkpoint, export_model
from lowmem.parallelism import describe, model_for_eval, prepare_model_and_optimizer
from lowmem.performance import enable_tf32, maybe_compile
from lowmem.instrumentation import TestHooks, TrainingTrace
from lowmem.train_state import TrainState, check_resume, checkpoint_writer, load_checkpoint, read_trainer_state
from lowmem.train_log import setup_training_log

logger = logging.getLogger(__name__)
MB = 1024**2
LOG_DIR = "logs"


@dataclass
class LogWindow:
    """Sums over the optimizer steps since the last log line, on this rank."""

    loss_sum: float = 0.0
    target_tokens: int = 0
    input_tokens: int = 0
    grad_norm_sum: float = 0.0
    steps: int = 0
    started: float = dataclasses.field(default_factory=time.perf_counter)


# ----- set-up ---------------------------------------------------------------------------------------------
def model_config_for(config: Any, vocab_size: int) -> GPTConfig:
    """The GPT sizes a training config asks for."""
    return GPTConfig(vocab_size=vocab_size, max_seq_len=config.max_seq_len, n_layer=config.n_layer,
                     n_head=config.n_head, n_embd=config.n_embd, dropout=config.dropout)


def train_tokenizer_for(config: Any) -> Tokenizer:
    """Train the tokenizer a config asks for; with too little text for `vocab_size`, a smaller one, said so."""
    train_tokenizer(resolve_data_files(config.train_file), config.tokenizer_dir, vocab_size=config.vocab_size,
                    columns=(config.prompt_column, config.response_column),
                    max_sentences=config.tokenizer_max_sentences, seed=config.seed, hard_vocab_limit=False)
    tokenizer = Tokenizer.load(config.tokenizer_dir)
    if tokenizer.vocab_size < config.vocab_size:
        logger.warning("The training text supports %d tokenizer pieces, fewer than vocab_size=%d: using %d.",
                       tokenizer.vocab_size, config.vocab_size, tokenizer.vocab_size)
    return tokenizer


def ensure_tokenizer(config: Any, accelerator: Accelerator) -> Tokenizer:
    """Load the tokenizer, training it first (on the main process, while the others wait) if it is missing."""
    model_path = Path(config.tokenizer_dir) / "tokenizer.model"
    if not model_path.is_file() and accelerator.is_main_process:
        logger.info("No tokenizer at %s: training one on %s (vocab_size=%d).", model_path, config.train_file,
                    config.vocab_size)
        train_tokenizer_for(config)
    accelerator.wait_for_everyone()
    tokenizer = Tokenizer.load(config.tokenizer_dir)
    if tokenizer.vocab_size != config.vocab_size:
        logger.info("The tokenizer at %s has %d pieces (vocab_size is %d); retrain it with `python train_low_mem.py "
                    "tokenizer --vocab_size=...` to change that.", model_path, tokenizer.vocab_size, config.vocab_size)
    return tokenizer


def shared_memory_settings(config: Any, accelerator: Accelerator) -> MemorySettings:
    """Rank 0 decides from the memory budget and broadcasts, so no two ranks run with different settings."""
    return broadcast_from_main(accelerator, lambda: decide_memory_settings(
        config.ultra_low_mem, config.dataloader_num_workers, config.ultra_low_mem_threshold_gb,
        local_processes=local_processes(accelerator),
        on_gpu=accelerator.device.type == "cuda", budget_gb=config.memory_budget_gb,
    ))


def shared_run_id(accelerator: Accelerator) -> str:
    """The run's id (a timestamp), chosen by rank 0 so that every rank's memory log carries the same one."""
    return broadcast_from_main(accelerator, new_run_id)


def make_memory_monitor(config: Any, accelerator: Accelerator, settings: MemorySettings, run_id: str) -> MemoryMonitor:
    """Cleanups, memory records and the watchdog for this rank, on the budget share rank 0 decided."""
    share = settings.per_process_bytes
    memory_logger = MemoryLogger(LOG_DIR, run_id, accelerator.process_index, accelerator.num_processes, share)
    watchdog = MemoryWatchdog(share, fraction=config.memory_watchdog_fraction)
    return MemoryMonitor(memory_logger, watchdog, on_gpu=accelerator.device.type == "cuda",
                         cleanup_steps=config.cleanup_steps, memory_log_steps=config.memory_log_steps)


def make_loader(files: str, config: Any, accelerator: Accelerator, collate: TokenizingCollate,
                settings: MemorySettings, shuffle: bool) -> StreamLoader:
    """A StreamLoader over this rank's share of `files`."""
    stream = ParquetStream(
        files, columns=(config.prompt_column, config.response_column), buffer_size=config.dataloader_buffer_size,
        shuffle=shuffle, seed=config.seed, rank=accelerator.process_index, world_size=accelerator.num_processes,
        ultra_low_mem=settings.ultra_low_mem, ultra_low_mem_threshold_gb=config.ultra_low_mem_threshold_gb,
    )
    return StreamLoader(stream, batch_size=config.batch_size_per_gpu, collate_fn=collate, num_workers=settings.num_workers,
                        pin_memory=settings.pin_memory)


# ----- steps ----------------------------------------------------------------------------------------------
def take(batches: Iterator[dict[str, torch.Tensor]], count: int) -> list[dict[str, torch.Tensor]]:
    """Up to `count` next batches (fewer at the end of the epoch)."""
    taken = []
    for batch in batches:
        taken.append(batch)
        if len(taken) == count:
            break
    return taken


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, accelerator: Accelerator,
               micro_batches: list[dict[str, torch.Tensor]], global_target_tokens: float,
               grad_clip: float) -> tuple[float, float]:
    """One optimizer step over `micro_batches`; returns (this rank's summed token loss, gradient norm).

    Each micro-batch's loss is its token sum divided by the number of target tokens in the whole step on
    all ranks, so the update is the mean over every token of the step however the tokens fall into
    micro-batches and ranks. `accelerator.accumulate` skips the gradient all-reduce on all but the last
    micro-batch and divides by the number of micro-batches; DDP averages over ranks: the factor
    `micro-batches × ranks` undoes both.
    """
    scale = len(micro_batches) * accelerator.num_processes / max(global_target_tokens, 1.0)
    loss_sum = torch.zeros((), device=accelerator.device)
    grad_norm = torch.zeros(())
    for batch in micro_batches:
        with accelerator.accumulate(model):
            input_ids = batch["input_ids"].to(accelerator.device, non_blocking=True)  # (B, T)
            targets = batch["targets"].to(accelerator.device, non_blocking=True)  # (B, T)
            segment_ids = batch.get("segment_ids")  # (B, T) when rows are packed
            if segment_ids is not None:
                segment_ids = segment_ids.to(accelerator.device, non_blocking=True)
            _, mean_loss = model(input_ids, targets, segment_ids=segment_ids)
            batch_loss_sum = mean_loss * (targets != IGNORE_INDEX).sum()
            accelerator.backward(batch_loss_sum * scale)
            loss_sum += batch_loss_sum.detach()
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
                # DeepSpeed clips inside its engine and returns None here; its engine knows the norm.
                grad_norm = norm if norm is not None else _engine_grad_norm(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return float(loss_sum), float(grad_norm)


def _engine_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The gradient norm a DeepSpeed engine measured at its last step (0 when it has none)."""
    get_norm = getattr(model, "get_global_grad_norm", None)
    norm = get_norm() if callable(get_norm) else None
    return torch.as_tensor(0.0 if norm is None else float(norm))


def _log_line(state: TrainState, total_steps: int, window: LogWindow, lr: float, accelerator: Accelerator) -> None:
    """One readable line: loss over the window and all ranks, learning rate, tokens/s, grad norm, RSS."""
    loss_sum, target_tokens, input_tokens = all_reduce_sum(
        accelerator, [window.loss_sum, window.target_tokens, window.input_tokens])
    rss = psutil.Process().memory_info().rss
    [rss_max] = all_reduce_max(accelerator, [rss])
    elapsed = time.perf_counter() - window.started
    logger.info(
        "step %d/%d | epoch %d | loss %.4f | lr %.2e | grad_norm %.3f | tokens/s %s | rss %.0f MB (max over ranks %.0f MB)",
        state.step, total_steps, state.epoch, loss_sum / max(target_tokens, 1), lr,
        window.grad_norm_sum / max(window.steps, 1), f"{input_tokens / max(elapsed, 1e-9):,.0f}", rss / MB, rss_max / MB,
    )


# ----- the loop -------------------------------------------------------------------------------------------
def find_resume_point(manager: CheckpointManager, accelerator: Accelerator) -> Path | None:
    """The latest complete checkpoint, chosen (and verified) by the main process for every rank."""
    return broadcast_from_main(accelerator, manager.latest_complete)


def train(config: Any, is_keep_training: bool = False, allow_config_change: bool = False) -> dict[str, Any]:
    """Train a GPT as `config` says; returns the run's summary (validation losses, steps, tokens, seconds).

    Args:
        config: a TrainConfig (or subclass), already validated or not.
        is_keep_training: continue from the latest complete checkpoint in `config.output_dir`.
        allow_config_change: resume even when settings that decide the data order, batches or schedule changed.
    """
    validate_config(config)
    check_data_files(config)
    accelerator = create_accelerator(config.gradient_accumulation_steps, config.bf16)
    log_path = setup_training_log(accelerator.process_index, accelerator.is_main_process, LOG_DIR)
    check_shared_folder(accelerator, config.output_dir)  # several machines: checkpoints need a shared folder
    set_seed(config.seed)
    started = time.perf_counter()
    rank, is_main = accelerator.process_index, accelerator.is_main_process

    tokenizer = ensure_tokenizer(config, accelerator)
    settings = shared_memory_settings(config, accelerator)
    run_id = shared_run_id(accelerator)
    logger.info("Processes: %d on %s, mixed precision: %s.", accelerator.num_processes, accelerator.device,
                accelerator.mixed_precision)
    # Every rank says what it runs with: the settings rank 0 decided, the same everywhere.
    logger.info("Memory settings (decided by rank 0): %s.", settings.reason, extra={"all_ranks": True})

    model = GPT(model_config_for(config, tokenizer.vocab_size))
    logger.info("Model: %.2f M parameters (%.2f M without embeddings).", model.num_params() / 1e6,
                model.num_params(exclude_embeddings=True) / 1e6)
    # The optimizer, the wrapping and (below) checkpoints and the model to evaluate depend on how accelerate
    # was launched (DDP, DeepSpeed, FSDP): lowmem.parallelism handles each.
    model, optimizer = prepare_model_and_optimizer(model, config, accelerator)
    logger.info("Parallelism: %s.", describe(accelerator))
    if enable_tf32(accelerator.device.type == "cuda"):
        logger.info("TF32 matmuls on: float32 work runs on the tensor cores.")
    model = maybe_compile(model, config)

    columns = (config.prompt_column, config.response_column)
    collate = TokenizingCollate(tokenizer, config.max_seq_len, columns, config.loss_on_response_only,
                                pack=config.pack_rows)
    train_loader = make_loader(config.train_file, config, accelerator, collate, settings, shuffle=True)
    steps_per_epoch = len(train_loader) // config.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"The training data gives each process {len(train_loader.stream)} rows: not enough for one optimizer "
            f"step of {config.batch_size_per_gpu} x {config.gradient_accumulation_steps} rows. Lower "
            "--batch_size_per_gpu or --gradient_accumulation_steps, or add data."
        )
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps:
        total_steps = min(total_steps, config.max_steps)

    def all_ok(ok: bool) -> bool:
        return all_reduce_max(accelerator, [0.0 if ok else 1.0])[0] == 0.0

    manager = CheckpointManager(config.output_dir, keep_best_n=config.keep_latest_n_ckp, metric=config.best_metric,
                                mode=METRIC_MODES[config.best_metric], is_main=is_main,
                                barrier=accelerator.wait_for_everyone, all_ok=all_ok)
    run_facts = {"world_size": accelerator.num_processes, "workers_per_rank": max(1, settings.num_workers)}
    state = TrainState()
    resume_dir = find_resume_point(manager, accelerator) if is_keep_training else None
    if is_keep_training and resume_dir is None:
        logger.info("No complete checkpoint in %s: starting fresh.", config.output_dir)
    if resume_dir is not None:
        saved = read_trainer_state(resume_dir)
        changes = check_resume(resume_dir, saved, config, run_facts, allow_config_change)
        data_state = load_checkpoint(resume_dir, model, optimizer, accelerator)
        state.load_state_dict(saved["train"])
        try:
            train_loader.load_state_dict(data_state)
        except DataError as error:
            if not changes:
                raise
            logger.warning("The saved data position does not fit the changed settings (%s): epoch %d restarts.",
                           error, state.epoch)
        logger.info("Resumed from %s: epoch %d, step %d, %s tokens seen%s.", resume_dir, state.epoch, state.step,
                    f"{state.tokens_seen:,}", f" (changed: {'; '.join(changes)})" if changes else "")
    logger.info("Training: %d rows per process per epoch, %d optimizer steps per epoch, %d steps in all.",
                len(train_loader.stream), steps_per_epoch, total_steps)

    def save(score: float | None, data_state: dict[str, Any]) -> Path:
        write_parts = checkpoint_writer(model, optimizer, accelerator, data_state, state, config, run_facts)

        def write(folder: Path) -> None:
            write_parts(folder)
            hooks.during_save()

        return manager.save(state.step, write, score=score, info={"epoch": state.epoch, "tokens_seen": state.tokens_seen})

    def validate(with_bleu: bool = True) -> EvalResult:
        with model_for_eval(model, accelerator) as eval_model:
            result = evaluate(eval_model, tokenizer, config.validation_file, accelerator,
                              batch_size=config.batch_size_per_gpu, max_seq_len=config.max_seq_len, columns=columns,
                              bleu_samples=config.eval_bleu_samples if with_bleu else 0,
                              max_new_tokens=config.eval_max_new_tokens, max_batches=config.eval_batches,
                              response_only=config.loss_on_response_only,
                              no_repeat_ngram_size=config.eval_no_repeat_ngram_size)
        logger.info("Validation at step %d: %s", state.step, result.describe())
        return result

    trace = TrainingTrace(rank)
    if resume_dir is None:
        state.val_loss_start = validate(with_bleu=False).loss
    val_loss_end = state.val_loss_start
    last_eval: EvalResult | None = None
    memory = make_memory_monitor(config, accelerator, settings, run_id)
    memory.start(state.epoch, state.step)
    hooks = TestHooks()
    stopper = GracefulStop().install()
    stopped_by = None
    last_saved = state.step if resume_dir is not None else -1
    ranks_out = 0.0

    progress = tqdm(total=total_steps, initial=state.step, desc="train", unit="step", disable=not is_main,
                    dynamic_ncols=True)
    window = LogWindow()
    lr = get_lr(state.step, config.learn_rate, config.warmup_steps, total_steps, config.min_lr_ratio)
    try:
        while state.step < total_steps and state.epoch < config.epochs:
            train_loader.set_epoch(state.epoch)
            batches = iter(train_loader)
            while state.step < total_steps:
                position = train_loader.state_dict()  # before this step's batches: what a stop-time save needs
                micro_batches = take(batches, config.gradient_accumulation_steps)
                target_tokens = sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in micro_batches)
                input_tokens = sum(int((b["input_ids"] != tokenizer.pad_id).sum()) for b in micro_batches)
                # One small collective per step carries the step's token counts, whether any rank ran out of
                # data (rows with empty values make shares uneven) and whether any rank was asked to stop,
                # so that every rank ends the epoch, or stops, at the same step.
                global_tokens, global_inputs, ranks_out, stop = all_reduce_sum(accelerator, [
                    target_tokens, input_tokens, float(len(micro_batches) < config.gradient_accumulation_steps),
                    float(stopper.requested(state.step))])
                if stop:
                    stopped_by = stopper.requested_by or "another process"
                    save(None, position)
                    last_saved = state.step
                    break
                if ranks_out:
                    break
                lr = get_lr(state.step, config.learn_rate, config.warmup_steps, total_steps, config.min_lr_ratio)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum, grad_norm = train_step(model, optimizer, accelerator, micro_batches, global_tokens,
                                                 config.grad_clip)
                for batch in micro_batches:
                    trace.record_batch(batch["input_ids"], tokenizer.pad_id, batch.get("segment_ids"))
                if trace.enabled:
                    step_loss, step_tokens = all_reduce_sum(accelerator, [loss_sum, target_tokens])
                    trace.record_loss(state.step + 1, step_loss / max(step_tokens, 1.0))
                hooks.after_step()
                state.step += 1
                state.tokens_seen += int(global_inputs)
                window.loss_sum += loss_sum
                window.target_tokens += target_tokens
                window.input_tokens += input_tokens
                window.grad_norm_sum += grad_norm
                window.steps += 1
                progress.update(1)
                memory.after_step(state.epoch, state.step)
                if state.step % config.logging_steps == 0 or state.step == total_steps:
                    _log_line(state, total_steps, window, lr, accelerator)
                    window = LogWindow()
                due_eval = config.eval_steps and state.step % config.eval_steps == 0
                if due_eval or state.step % config.save_steps == 0:
                    last_eval = validate()
                    val_loss_end = last_eval.loss
                if state.step % config.save_steps == 0:
                    save(last_eval.score(config.best_metric), train_loader.state_dict())
                    last_saved = state.step
            if stopped_by or (state.step >= total_steps and not ranks_out):
                break  # stopped, or the step budget ended inside this epoch
            state.epoch += 1
            logger.info("Epoch %d done at step %d.", state.epoch, state.step)
            last_eval = validate()
            val_loss_end = last_eval.loss
            save(last_eval.score(config.best_metric), train_loader.state_dict())
            last_saved = state.step
        if not stopped_by and last_saved != state.step:
            last_eval = validate()
            val_loss_end = last_eval.loss
            save(last_eval.score(config.best_metric), train_loader.state_dict())
    finally:
        stopper.uninstall()
        progress.close()
        memory.end(state.epoch, state.step)

    summary = {
        "val_loss_start": state.val_loss_start, "val_loss_end": val_loss_end, "steps": state.step,
        "bleu4_end": last_eval.score("bleu4") if last_eval is not None else None,
        "tokens_seen": state.tokens_seen, "seconds": time.perf_counter() - started,
        "processes": accelerator.num_processes, "log_file": str(log_path), "stopped_by": stopped_by,
    }
    if stopped_by:
        logger.info("Stopped by %s at step %d; the checkpoint is saved. Continue with --is_keep_training=True.",
                    stopped_by, state.step)
        accelerator.wait_for_everyone()
        return summary
    # Every rank enters together: under FSDP the whole model is gathered from the shards.
    with model_for_eval(model, accelerator) as final_model:
        trace.finish(final_model, state.step)
        logger.info("Validation loss %.4f at step 0 → %.4f at step %d (%.2f nats lower), %.0f s.",
                    state.val_loss_start, val_loss_end, state.step, state.val_loss_start - val_loss_end,
                    summary["seconds"])
        if is_main:
            out_dir = export_model(final_model, config, Path(config.output_dir) / "final",
                                   tokenizer_dir=config.tokenizer_dir)
            logger.info("Model saved to %s", out_dir)
            best = manager.manifest.get("best") or []
            if best:
                best_dir = export_checkpoint(Path(config.output_dir) / best[0], config,
                                             Path(config.output_dir) / "best", tokenizer_dir=config.tokenizer_dir)
                logger.info("Best checkpoint by %s (%s) exported to %s", config.best_metric, best[0], best_dir)
            first = next(iter(ParquetStream(config.validation_file, columns=columns, shuffle=False)))
            # Sampled rather than greedy: a small model's greedy answers fall into loops of one phrase.
            sampled = answer(final_model, tokenizer, first[config.prompt_column], config.sample_max_new_tokens,
                             temperature=0.8, top_k=40, seed=config.seed)
            logger.info("Sample\n  prompt:    %s\n  model:     %s\n  reference: %s", first[config.prompt_column],
                        sampled, first[config.response_column])
            summary["sample"] = {"prompt": first[config.prompt_column], "answer": sampled}
    accelerator.wait_for_everyone()
    return summary
