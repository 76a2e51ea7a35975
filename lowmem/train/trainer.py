"""The Trainer: ParquetStream → tokenizing collate → GPT on Accelerate (1..N processes, CPU or GPU).

A Trainer is made of small parts, each keeping its own state and saying itself when it is due:

    state        TrainState: epoch, step, tokens seen                       (checkpoint: shared)
    schedule     LearningRateSchedule: the learning rate of every step      (checkpoint: shared)
    checkpoints  CheckpointManager: atomic folders, retention, `due(step)`   (checkpoint: shared)
    data         LoaderPosition: the training loader and its exact position (checkpoint: per rank)
    rng          RngState: this process's random states                     (checkpoint: per rank)
    memory       MemoryMonitor: cleanups, memory records, the watchdog      (checkpoint: per rank)
    validator    Validator: validation loss and BLEU-4, `due(step)`
    step_log     StepLog: one readable line per logging step
    tracking     Tracking: the training curves (--report_to), from the main process
    stopper      GracefulStop: SIGINT/SIGTERM, or `request_stop(reason)`

A checkpoint is the model, the optimizer and the dict of the stateful parts (`TrainingCheckpoint`); a resume
(`lowmem.train.resume`) loads them back. `fit()` is the whole loop, one step at a time: take the step's batches,
agree with every rank (a stop, the end of the epoch), train, then validate and save when due.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from lowmem.atomic_files import write_json_atomic
from lowmem.checkpoint.contents import RESUME_ONLY, TrainingCheckpoint
from lowmem.checkpoint.export import export_checkpoint, export_model
from lowmem.checkpoint.folders import CheckpointManager
from lowmem.checkpoint.run_lock import lock_run_folder, start_fresh_run
from lowmem.config import TrainConfig, validate_config
from lowmem.config.columns import data_columns, describe_loss_targets, response_only
from lowmem.config.train_sources import training_data
from lowmem.data import ParquetStream, StreamLoader
from lowmem.data.collate import TokenizingCollate
from lowmem.disk_errors import writing
from lowmem.errors import DataError
from lowmem.distributed.accelerator import create_accelerator, ddp_settings, log_launcher_precision_note
from lowmem.distributed.collectives import (all_reduce_max, all_reduce_sum, broadcast_from_main, check_shared_folder,
                                           end_process_group, run_on_main)
from lowmem.distributed.launcher_watch import stop_when_launcher_dies
from lowmem.distributed.peers import PeerWatch
from lowmem.distributed.performance import check_cuda_graphs, release_compile_workers, run_speed_settings
from lowmem.distributed.strategy import model_for_eval
from lowmem.eval.commands import answer
from lowmem.eval.validation import METRIC_MODES, EvalResult
from lowmem.eval.validator import Validator
from lowmem.memory.collector import freeze_set_up_objects
from lowmem.model.weights import WEIGHTS_FILE, unwrap_gpt
from lowmem.program import command_line
from lowmem.progress import progress_bar
from lowmem.run_files import LAUNCH_LOG_DIR, run_training_log, tokenizer_record_file
from lowmem.train.callbacks import Callback
from lowmem.train.log import StepLog, attach_run_log, setup_training_log
from lowmem.train.memory_fit import SAVED_KEY, MemoryDecision, explicit_fields, log_decision, settle_memory
from lowmem.train.resume import (ResumeDecision, choose_checkpoint, data_position_to_load, decide_resume,
                                 epoch_may_restart, rescale_line, steps_after_rescale)
from lowmem.train.schedule import LearningRateSchedule, total_steps
from lowmem.train.setup import (build_model_and_optimizer, decide_fixed_shapes, ensure_tokenizer, make_loader,
                                make_memory_monitor, shared_memory_settings, steps_per_epoch)
from lowmem.source.settle import StartingPoint, describe_start, settle_source, write_source_record
from lowmem.train.startup import SavedRun, settled_config, start_up
from lowmem.train.state import RngState, TrainState
from lowmem.train.step import (Batch, StepResult, attention_pairs, compile_each_shape, count_rows, count_tokens, take,
                               train_step)
from lowmem.train.stop import GracefulStop
from lowmem.train.tracking import Tracking, tracker_arguments

logger = logging.getLogger(__name__)
# The most steps whose gradient norms stay unread on the device (see `Trainer.count_skipped_steps`).
UNREAD_NORMS_LIMIT = 1000


class LoaderPosition:
    """The training loader as a checkpoint part: its position, except at a stop, where the batches taken for
    a step that was not trained are given back (the position before them is saved)."""

    def __init__(self, loader: StreamLoader) -> None:
        self.loader = loader
        self._before_step: dict[str, Any] | None = None
        self._untrained = False

    def epoch_batches(self, epoch: int) -> Iterator[Batch]:
        self.loader.set_epoch(epoch)
        return iter(self.loader)

    def take(self, batches: Iterator[Batch], count: int) -> list[Batch]:
        """The next `count` batches, remembering the position before them."""
        self._before_step = self.loader.state_dict()
        return take(batches, count)

    def give_back_last_batches(self) -> None:
        self._untrained = True

    def state_dict(self) -> dict[str, Any]:
        if self._untrained:
            assert self._before_step is not None  # batches were taken before any could be given back
            return self._before_step
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def allow_changed_content(self, allow: bool) -> None:
        """Whether a saved position over data files rewritten since the save loads (read on from it) or is refused."""
        self.loader.stream.allow_changed_content = allow


@dataclass
class StepAgreement:
    """What every rank learned in the one small collective at the start of a step."""

    target_tokens: int  # this rank's tokens the loss counts
    input_tokens: int  # this rank's real input tokens
    global_target_tokens: float  # over every rank
    global_input_tokens: float
    ranks_out: bool  # some rank ran out of rows: the epoch ends here for all
    stop: bool  # some rank was asked to stop
    global_rows: int  # rows of this step's micro-batches on every rank: not trained when the epoch ends here


def warmup_kept_by(config: TrainConfig, given: Collection[str] | None, planned_steps: int) -> str | None:
    """The flag that keeps --warmup_steps as it is even when it does not fit the run (`fitted_warmup`): the warmup
    given itself, or a --max_steps given that cuts the run short; None when neither was."""
    explicit = explicit_fields(config, given)
    if "warmup_steps" in explicit:
        return "--warmup_steps"
    return "--max_steps" if "max_steps" in explicit and planned_steps == config.max_steps else None


class Trainer:
    """Trains a GPT as a TrainConfig says; see the module's docstring for its parts.

    Args:
        config: the training configuration: as `run_training`'s start-up settled it when `saved_run` is given,
            else validated and settled here as a new run's (`lowmem.train.startup.settled_config`).
        accelerator: the run's Accelerator (default: one on the GPUs if there are any, else the CPU).
        callbacks: hooks run on every rank at fixed points (see `lowmem.train.callbacks`).
        memory: the memory plan and savers `run_training` settled (`settle_memory`); without it the config runs
            as given, and its plan is only logged.
        given: the fields set on the command line; with those that differ from the config class's defaults, they
            are kept as given (a --warmup_steps over a quarter of the run is shortened only when neither it nor a
            --max_steps that cuts the run short was given: `warmup_kept_by`).
        saved_run: what the start-up read of the run folder (`lowmem.train.startup.start_up`), with `config`
            settled from it; `resume` takes the trainer state read there.
        start: the model the run starts from, as the start-up settled it (`lowmem.source.settle`): a new run fills
            its model with the source's weights and copies its tokenizer; None trains from random weights.
    """

    def __init__(self, config: TrainConfig, accelerator: Accelerator | None = None,
                 callbacks: Sequence[Callback] = (), memory: MemoryDecision | None = None,
                 given: Collection[str] | None = None, saved_run: SavedRun | None = None,
                 start: StartingPoint | None = None) -> None:
        if saved_run is None:  # not through run_training: a new run's values (checkpoints record concrete ones)
            validate_config(config)
            if config.init_from and start is None:  # never random weights where a model was named
                config, start = settle_source(config, explicit_fields(config, given), None, None)
            config = settled_config(config, SavedRun())
        self.saved_run = saved_run or SavedRun()
        self.config, self.callbacks = config, list(callbacks)
        self.accelerator = accelerator or create_accelerator(config.gradient_accumulation_steps, config.bf16,
                                                             config.process_group_timeout_minutes,
                                                             bf16_on_cpu=config.bf16_on_cpu, ddp=ddp_settings(config),
                                                             **tracker_arguments(config.report_to))
        self.is_main = self.accelerator.is_main_process
        self.tracking = Tracking(self.accelerator, config)  # first: it checks the accelerator has the trackers
        self.validated_step: int | None = None  # the step of the last full validation (BLEU-4 included)
        set_seed(config.seed)
        self.started = time.perf_counter()
        if memory is None:
            _, memory = settle_memory(dataclasses.replace(config, memory_savers="off"), self.accelerator, explicit=())
            log_decision(memory)
        self.memory_decision = memory
        self.peers = PeerWatch.gather(self.accelerator, plan_line=memory.summary())
        self.speed = run_speed_settings(config, self.accelerator)
        check_cuda_graphs(config, self.speed)
        logger.info("Speed settings: %s.", self.speed.describe())
        self.tokenizer, self.tokenizer_identity = ensure_tokenizer(config, self.accelerator, start)
        settings = shared_memory_settings(config, self.accelerator)
        logger.info("Processes: %d on %s, mixed precision: %s.", self.accelerator.num_processes,
                    self.accelerator.device, self.accelerator.mixed_precision)
        log_launcher_precision_note(self.accelerator, config.bf16, config.bf16_on_cpu)  # the launcher's "'no'" note
        self.model, self.optimizer, loaded = build_model_and_optimizer(config, self.accelerator,
                                                                       self.tokenizer.vocab_size, settings, self.speed,
                                                                       start)
        if loaded is not None and start is not None:
            logger.info(describe_start(start, loaded, unwrap_gpt(self.model).num_params(), self.tokenizer.describe()))
        # The main process samples the rows (the same choice everywhere, and one reading of the sample).
        self.fixed_shapes = (broadcast_from_main(self.accelerator, lambda: decide_fixed_shapes(config, self.tokenizer))
                             if self.speed.static_shapes else None)
        collate = TokenizingCollate(self.tokenizer, config.max_seq_len, data_columns(config), response_only(config),
                                    pack=config.pack_rows, fixed_shapes=self.fixed_shapes)
        loader = make_loader(training_data(config), config, self.accelerator, collate, settings, shuffle=True)
        self.steps_per_epoch = steps_per_epoch(loader, config)
        planned_steps = total_steps(self.steps_per_epoch, config.epochs, config.max_steps)

        self.state = TrainState()
        self.schedule = LearningRateSchedule(config.learn_rate, config.warmup_steps, config.min_lr_ratio,
                                             planned_steps, warmup_kept_by=warmup_kept_by(config, given, planned_steps))
        self.checkpoints = CheckpointManager(
            config.output_dir, keep_best_n=config.keep_latest_n_ckp, metric=config.best_metric,
            mode=METRIC_MODES[config.best_metric], is_main=self.is_main, barrier=self.accelerator.wait_for_everyone,
            all_ok=self._all_ok, save_every=config.save_steps, resume_only=RESUME_ONLY,
            keep_resumable_n=config.keep_optimizer_n_ckp)
        self.data, self.rng = LoaderPosition(loader), RngState()
        self.memory = make_memory_monitor(config, self.accelerator, settings,
                                          predicted_high_water=memory.predicted_high_water(self.is_main))
        self.validator = Validator(config, self.tokenizer, self.accelerator)
        self.step_log = StepLog(self.accelerator, planned_steps, config.logging_steps,
                                flops_per_token=unwrap_gpt(self.model).estimate_flops_per_token(),
                                peak_tflops=config.peak_tflops,
                                attention_flops_per_pair=unwrap_gpt(self.model).attention_flops_per_pair(),
                                max_seq_len=unwrap_gpt(self.model).config.max_seq_len)
        self.stopper = GracefulStop()
        self.checkpoint_parts = TrainingCheckpoint(
            self.model, self.optimizer, self.accelerator,
            shared={"train": self.state, "schedule": self.schedule, "checkpoints": self.checkpoints},
            per_rank={"rng": self.rng, "data": self.data, "memory": self.memory}, config=config,
            run_facts={"world_size": self.accelerator.num_processes, "workers_per_rank": max(1, settings.num_workers),
                       SAVED_KEY: memory.saved_record(), "tokenizer": self.tokenizer_identity})
        self.resumed_from: Path | None = None
        self.stopped = False  # a stop every rank agreed on ended the loop
        self.saved_step: int | None = None  # the step this Trainer last saved (not one it resumed from)
        # (step, gradient norm on the device) of the steps whose norms were not read yet: see count_skipped_steps.
        self.unread_norms: list[tuple[int, torch.Tensor | float]] = []
        self.progress: tqdm | None = None
        logger.info("Training: %d rows per process per epoch, %d optimizer steps per epoch, %d steps in all; %s.",
                    len(loader.stream), self.steps_per_epoch, self.total_steps, describe_loss_targets(config))

    # ----- the loop ---------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to the end of the epochs or of `max_steps`, or until a stop; returns the run's summary."""
        self.tracking.start(self.state.step, resumed=self.resumed_from is not None)
        try:
            self.begin()
            try:
                batches: Iterator[Batch] | None = None
                while self.steps_remain:
                    if batches is None:
                        batches = self.data.epoch_batches(self.state.epoch)
                    micro_batches = self.data.take(batches, self.config.gradient_accumulation_steps)
                    agreed = self.agree(micro_batches)  # one small collective: every rank decides alike
                    if agreed.stop:
                        self.stop_and_save()  # the batches just taken go back: saved where the last step left off
                        break
                    if agreed.ranks_out:
                        # Training a last step of fewer micro-batches would not be safe: under FSDP every forward
                        # is a collective (ranks may hold different numbers), and the schedule counts whole steps.
                        batches = None  # the epoch's reader (workers, buffer) ends before the validation and save
                        self.end_epoch(rows_not_trained=agreed.global_rows)  # validates and saves
                        continue
                    result = self.optimizer_step(micro_batches, agreed)
                    self.after_step(result)  # count, callbacks, memory schedule, log line
                    self.validate_and_save_when_due()
                batches = None  # the reader ends before the last validation, save and export
                if not self.stopped:  # agreed by every rank: a signal during the last step changes nothing here
                    self.validate_and_save_when_due(final=True)
            except Exception as error:
                # Still inside the signal handlers: the launcher's SIGTERM to the survivors cannot cut this short.
                self.peers.check(error)  # a rank of this machine died: one line instead of a traceback
                raise
            finally:
                self.end()
            return self.finish()
        finally:
            self.tracking.end()  # stopped or failed too: the curves so far are flushed and closed

    @property
    def steps_remain(self) -> bool:
        """Steps and epochs are left (the same on every rank: a stop is agreed at the next step instead)."""
        return self.state.step < self.total_steps and self.state.epoch < self.config.epochs

    @property
    def running(self) -> bool:
        return not self.stopper.requested and self.steps_remain

    @property
    def total_steps(self) -> int:
        """The run's optimizer steps in all, as the schedule plans them."""
        return self.schedule.total_steps

    @total_steps.setter
    def total_steps(self, total: int) -> None:
        self.schedule.total_steps = self.step_log.total_steps = total

    def agree(self, micro_batches: list[Batch]) -> StepAgreement:
        """One small collective per step carries the step's token counts, whether any rank ran out of data
        (rows with empty values make shares uneven) and whether any rank was asked to stop, so that every
        rank ends the epoch, or stops, at the same step."""
        targets, inputs = count_tokens(micro_batches, self.tokenizer.pad_id)
        short = len(micro_batches) < self.config.gradient_accumulation_steps
        # Every rank sends its rows, short or not: when one rank is short, the micro-batches of all are dropped.
        total_targets, total_inputs, ranks_out, stop, rows = all_reduce_sum(
            self.accelerator, [targets, inputs, float(short), float(self.stopper.requested),
                               float(count_rows(micro_batches, self.tokenizer.pad_id))])
        return StepAgreement(targets, inputs, total_targets, total_inputs, bool(ranks_out), bool(stop), int(rows))

    def optimizer_step(self, micro_batches: list[Batch], agreed: StepAgreement) -> StepResult:
        """One optimizer step at the scheduled learning rate."""
        config = self.config
        lr = self.schedule.lr(self.state.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum, grad_norm = train_step(self.model, self.optimizer, self.accelerator, micro_batches,
                                         agreed.global_target_tokens, config.grad_clip)
        return StepResult(micro_batches, loss_sum, grad_norm, torch.isfinite(grad_norm), lr, agreed.target_tokens,
                          agreed.input_tokens, agreed.global_target_tokens, agreed.global_input_tokens,
                          attention_pairs(micro_batches, self.tokenizer.pad_id))

    def after_step(self, result: StepResult) -> None:
        """Count the step, run the callbacks and the memory schedule, and write the log line when due."""
        self.state.step += 1
        self.state.tokens_seen += int(result.global_input_tokens)
        self.unread_norms.append((self.state.step, result.grad_norm))
        if len(self.unread_norms) >= UNREAD_NORMS_LIMIT:  # log lines far apart: one wait per so many steps
            self.count_skipped_steps()
        for callback in self.callbacks:
            callback.on_step_end(self, result)
        self.step_log.add(result)
        assert self.progress is not None  # made by begin()
        self.progress.update(1)
        record = self.memory.after_step(self.state.epoch, self.state.step)
        if record is not None:  # its GPU peak ends with it: the log line's peak of the run takes it first
            self.step_log.note_gpu_peak(record.get("cuda_peak"))
        if self.step_log.due(self.state.step):
            self.count_skipped_steps()
            figures = self.step_log.write(self.state.step, self.state.epoch, result.lr)
            self.tracking.log_line(self.state.step, figures)

    def count_skipped_steps(self) -> None:
        """Read the gradient norms of the steps since the last read (one wait for the device) and count, with a
        warning each, the steps whose norm was not finite: the optimizer skipped them on the device.

        Called when a log line, a checkpoint or the summary needs the count: reading each step's norm as it
        comes would make the host wait for the device at every step."""
        if not self.unread_norms:
            return
        steps = [step for step, _ in self.unread_norms]
        norms = torch.stack([torch.as_tensor(norm, dtype=torch.float32).to(self.accelerator.device)
                             for _, norm in self.unread_norms]).tolist()
        self.unread_norms = []
        for step, norm in zip(steps, norms):
            if math.isfinite(norm):
                continue
            self.state.skipped_steps += 1
            logger.warning("Step %d: the gradient norm is %s, so the update was skipped on every rank (weights and "
                           "optimizer state unchanged; %d skipped so far).%s", step, norm,
                           self.state.skipped_steps, self._skip_advice(), extra={"all_ranks": True})

    def _skip_advice(self) -> str:
        if self.state.skipped_steps < 3:
            return ""
        return (" Repeated non-finite steps mean the run is diverging: lower --learn_rate, keep --grad_clip on, "
                "or resume from an earlier checkpoint.")

    def validate_and_save_when_due(self, epoch_end: bool = False, final: bool = False) -> None:
        """Validate when the validator or a save asks for it, then save when a checkpoint is due.

        At an epoch's end and at the end of training both are due. A step already saved is not saved again.
        """
        step = self.state.step
        due = self.checkpoints.due(step) or epoch_end or final
        save = due and self.checkpoints.last_saved_step != step
        # The last loop step is often due itself: the final call then saves nothing and validates nothing again.
        with self.step_log.paused():
            if (save or self.validator.due(step)) and self.validated_step != step:
                self.validate()
            if save:
                self.save(score=self.validator.last_score(self.config.best_metric))

    def validate(self, with_bleu: bool = True) -> EvalResult:
        """Validate at the current step (every rank together); the result goes to the training curves too."""
        result = self.validator.run(self.model, self.state.step, with_bleu=with_bleu)
        if with_bleu:
            self.validated_step = self.state.step
        self.tracking.log_validation(self.state.step, result)
        return result

    # ----- epochs, stops and saves ------------------------------------------------------------------------
    def end_epoch(self, rows_not_trained: int = 0) -> None:
        """Some rank ran out of rows: every rank counts the epoch as done, validates and saves. `rows_not_trained`:
        the rows, on every rank, of the short last step that was not taken."""
        self.state.epoch += 1
        if rows_not_trained:
            self.state.rows_not_trained += rows_not_trained
            logger.info("Epoch %d done at step %d: %s rows of a last, short accumulation step (fewer than %d "
                        "micro-batches on some process) were not trained in this epoch.", self.state.epoch,
                        self.state.step, f"{rows_not_trained:,}", self.config.gradient_accumulation_steps)
        else:
            logger.info("Epoch %d done at step %d.", self.state.epoch, self.state.step)
        self.validate_and_save_when_due(epoch_end=True)

    def request_stop(self, reason: str) -> None:
        """Ask for a stop after this step, as SIGTERM would: every rank saves at the next step and returns."""
        self.stopper.request(reason)

    def stop_and_save(self) -> None:
        """A stop was agreed: save where the last trained step left off (the batches just taken go back), unless
        this Trainer saved that step already (at an epoch's end, or when a save was due): that checkpoint keeps
        its score."""
        self.stopper.request("another process")  # when the request came from another rank
        self.stopped = True
        self.data.give_back_last_batches()
        if self.saved_step != self.state.step:
            self.save(score=None)

    def save(self, score: float | None) -> Path:
        """Save a checkpoint of every part at the current step; every rank calls it."""
        self.count_skipped_steps()  # the checkpoint's count is exact

        def write(folder: Path) -> None:
            self.checkpoint_parts.write(folder)
            for callback in self.callbacks:
                callback.on_checkpoint_write(self, folder)

        folder = self.checkpoints.save(self.state.step, write, score=score,
                                       info={"epoch": self.state.epoch, "tokens_seen": self.state.tokens_seen})
        self.saved_step = self.state.step
        return folder

    def resume(self, allow_config_change: bool = False, resume_from: str | Path | None = None) -> Path | None:
        """Continue from the latest complete checkpoint in the run folder (or from `resume_from`, one of its
        checkpoints, the newer ones set aside), if there is one; returns it. Every rank calls it.

        Settings that decide the data order, batches or schedule must match the checkpoint's unless
        `allow_config_change`; then a data position that no longer fits restarts the epoch, data files rewritten
        since the save are read on from the saved position, and a checkpoint kept for its score only (no optimizer
        state) resumes with a fresh optimizer. Checkpoints that exist but are all damaged stop the resume. What
        may continue is decided by `lowmem.train.resume`; each part loads its own state (`TrainingCheckpoint`).
        """
        folder = choose_checkpoint(self.checkpoints, self.accelerator, allow_config_change, resume_from)
        if folder is None:
            logger.info("No complete checkpoint in %s: starting fresh.", self.config.output_dir)
            return None
        run_facts = self.checkpoint_parts.run_facts
        decision = decide_resume(folder, self.saved_run.state_of(folder), self.config, self.tokenizer_identity,
                                 run_facts, self.steps_per_epoch, allow_config_change, self.is_main,
                                 self.checkpoints.damage)
        planned_total = self.total_steps  # this run's length, before the checkpoint's schedule replaces it
        self.checkpoint_parts.load(folder, decision.saved, skip=("data",), with_optimizer=decision.with_optimizer)
        self._resume_data_position(decision, allow_config_change)
        if decision.rescaled:
            total = steps_after_rescale(self.config, self.state.step, self.state.epoch, len(self.data.loader),
                                        self.steps_per_epoch)
            self.schedule.stretch(self.state.step, total)
            self.total_steps = total
            logger.info(rescale_line(decision.saved, self.config, run_facts, len(self.data.loader.stream),
                                     total - self.state.step))
        else:  # a stretched schedule keeps the total it planned; otherwise this run's length stands
            self.total_steps = self.schedule.total_steps if self.schedule.stretched else planned_total
        self.checkpoints.last_saved_step = self.state.step
        self.resumed_from = folder
        state, changes = self.state, decision.changes
        logger.info("Resumed from %s: epoch %d, step %d, %s tokens seen%s.", folder, state.epoch, state.step,
                    f"{state.tokens_seen:,}", f" (changed: {'; '.join(changes)})" if changes else "")
        return folder

    def _resume_data_position(self, decision: ResumeDecision, allow_config_change: bool) -> None:
        """This rank's data position from the checkpoint: its own, or every old rank's merged when the readers'
        layout changed. Data files rewritten since the save are refused, or read on from the saved position with
        `allow_config_change`; a position that no longer fits changed settings restarts the epoch."""
        self.data.allow_changed_content(allow_config_change)
        try:
            merged = data_position_to_load(decision, self.config, self.checkpoint_parts.run_facts)
            if merged is not None:
                self.data.load_state_dict(merged)
            else:
                self.checkpoint_parts.load_part(decision.folder, "data")
        except DataError as error:
            if not epoch_may_restart(error, decision):
                raise
            logger.warning("The saved data position does not fit the changed settings (%s): epoch %d restarts.",
                           error, self.state.epoch)

    # ----- start and end ----------------------------------------------------------------------------------
    def begin(self) -> None:
        """Before the first step: the record of the tokenizer, the first memory record, the validation loss at the
        start (not after a resume), the signal handlers and the progress bar."""
        def write_record() -> None:  # after a resume's checks: a refused resume leaves the record as it was
            with writing("the run's tokenizer record", self.config.output_dir):
                write_json_atomic(tokenizer_record_file(self.config.output_dir), self.tokenizer_identity)

        run_on_main(self.accelerator, write_record)
        warmup = self.schedule.warmup_line()  # after a resume: the warmup the run started with
        if warmup:
            logger.warning(warmup)
        # The set-up's memory, before the first validation and step (and, under FSDP, the whole replica a
        # validation gathers): what a run started from a model holds once it is loaded.
        self.memory.start(self.state.epoch, self.state.step)
        if self.resumed_from is None:
            self.state.val_loss_start = self.validate(with_bleu=False).loss
        if self.speed.compile and self.fixed_shapes is not None:
            compile_each_shape(self.model, self.optimizer, self.accelerator, self.fixed_shapes,
                               self.tokenizer.pad_id, self.config.pack_rows)
            if release_compile_workers():  # every shape is compiled: the pool's processes only hold memory now
                logger.info("torch.compile's worker processes shut down: every batch shape is compiled.")
        # The set-up's objects (modules, compiled graphs, libraries) out of the collector's walks from here on.
        logger.debug("%d Python objects of the set-up frozen.", freeze_set_up_objects())
        self.stopper.install()
        self.progress = progress_bar(total=self.total_steps, initial=self.state.step, desc="train", unit="step",
                                     enabled=self.is_main and self.config.progress, dynamic_ncols=True)
        for callback in self.callbacks:
            callback.on_train_start(self)
        self.step_log.reset()  # the first line's tokens/s counts from here, not from the set-up and step 0's validation

    def end(self) -> None:
        """After the last step, or a failure: signal handlers back, progress bar closed, last memory record."""
        self.stopper.uninstall()
        if self.progress is not None:
            self.progress.close()
        self.memory.end(self.state.epoch, self.state.step)

    def _all_ok(self, ok: bool) -> bool:
        return all_reduce_max(self.accelerator, [0.0 if ok else 1.0])[0] == 0.0

    def summary(self) -> dict[str, Any]:
        """Validation losses, steps, tokens and seconds of the run so far, and what stopped it."""
        self.count_skipped_steps()
        last = self.validator.last
        summary = {
            "val_loss_start": self.state.val_loss_start,
            "val_loss_end": last.loss if last is not None else self.state.val_loss_start,
            "steps": self.state.step, "bleu4_end": self.validator.last_score("bleu4"),
            "tokens_seen": self.state.tokens_seen, "seconds": time.perf_counter() - self.started,
            "processes": self.accelerator.num_processes, "stopped_by": self.stopper.requested_by,
            "skipped_steps": self.state.skipped_steps, "rows_not_trained": self.state.rows_not_trained,
        }
        return summary

    def finish(self) -> dict[str, Any]:
        """After the loop; returns the summary. Stopped: say how to continue. Done: the callbacks see the whole
        model, the main process exports final/ and best/ and logs a sampled answer. Every rank enters
        together: under FSDP the model is gathered."""
        summary = self.summary()
        if self.stopped:
            logger.info("Stopped by %s at step %d; the checkpoint is saved. Continue with `%s` (your flags, and "
                        "that one).", self.stopper.requested_by, self.state.step,
                        command_line("train ... --is_keep_training=True"))
            self.accelerator.wait_for_everyone()
            return summary
        with model_for_eval(self.model, self.accelerator) as final_model:
            for callback in self.callbacks:
                callback.on_train_end(self, final_model)
            logger.info("Validation loss %.4f at step 0 → %.4f at step %d (%.2f nats lower), %.0f s.",
                        summary["val_loss_start"], summary["val_loss_end"], self.state.step,
                        summary["val_loss_start"] - summary["val_loss_end"], summary["seconds"])
            def export_and_sample() -> None:  # a full disk there stops every rank, not the main process only
                self.export(final_model)
                summary["sample"] = self.sample_answer(final_model)

            run_on_main(self.accelerator, export_and_sample)
        self.accelerator.wait_for_everyone()  # every rank is here before any ends the process group
        return summary

    def export(self, final_model: Any) -> None:
        """final/: the model as trained; best/: the best checkpoint's model by `best_metric` (main process)."""
        config, output_dir = self.config, Path(self.config.output_dir)
        # The checkpoints hold the trained weights: a failed export loses nothing, and can be made again.
        manifest = self.checkpoints.manifest
        latest = output_dir / str(manifest.get("latest"))
        weights = latest / WEIGHTS_FILE
        needed = weights.stat().st_size if weights.is_file() else None
        kept = f"The checkpoints in {output_dir} are complete; the partial folder was removed."

        def then(checkpoint: Path) -> str:
            return f"then export it with `{command_line(f'export --out=FOLDER --checkpoint={checkpoint}')}`"

        with writing("the final model", output_dir / "final", needed=needed, then=then(latest), kept=kept):
            out_dir = export_model(final_model, config, output_dir / "final", tokenizer_dir=config.tokenizer_dir)
        logger.info("Model saved to %s", out_dir)
        best = manifest.get("best") or []
        if best:
            with writing("the best model", output_dir / "best", needed=needed, then=then(output_dir / best[0]),
                         kept=kept):
                best_dir = export_checkpoint(output_dir / best[0], config, output_dir / "best",
                                             tokenizer_dir=config.tokenizer_dir)
            logger.info("Best checkpoint by %s (%s) exported to %s", config.best_metric, best[0], best_dir)

    def sample_answer(self, final_model: Any) -> dict[str, str]:
        """The model's answer to the first validation prompt, logged beside the reference; with one text column,
        its continuation of the first third of the first validation text, beside the rest."""
        config = self.config
        first = next(iter(ParquetStream(config.validation_file, columns=data_columns(config), shuffle=False,
                                        bad_text=config.bad_text)))
        if config.text_column:
            text = first[config.text_column]
            prompt, reference = text[: len(text) // 3], text[len(text) // 3:]
        else:
            prompt, reference = first[config.prompt_column], first[config.response_column]
        # Sampled rather than greedy: a small model's greedy answers fall into loops of one phrase.
        sampled = answer(final_model, self.tokenizer, prompt, config.sample_max_new_tokens, temperature=0.8, top_k=40,
                         seed=config.seed, bf16=config.bf16, bf16_on_cpu=config.bf16_on_cpu,
                         continue_text=bool(config.text_column))
        logger.info("Sample\n  prompt:    %s\n  model:     %s\n  reference: %s", prompt, sampled, reference)
        return {"prompt": prompt, "answer": sampled}


def run_training(config: TrainConfig, is_keep_training: bool = False, allow_config_change: bool = False,
                 callbacks: Sequence[Callback] = (), given: Collection[str] | None = None,
                 overwrite: bool = False, resume_from: str | Path | None = None) -> dict[str, Any]:
    """Train as `config` says, with the training log set up; what `lowmem train` runs.

    Before anything is written, the memory is planned and, with `memory_savers="auto"`, the savers the budget
    needs are turned on (`lowmem.train.memory_fit`); a run that fits nowhere stops there.

    Args:
        config: a TrainConfig (or a preset of it), validated here.
        is_keep_training: continue from the latest complete checkpoint in `config.output_dir`.
        allow_config_change: resume even when settings that decide the data order, batches or schedule changed.
        callbacks: hooks run on every rank (see `lowmem.train.callbacks`).
        given: the fields set on the command line; with the fields that differ from the config class's defaults,
            these are the settings the memory savers never change.
        overwrite: a new run (not `is_keep_training`) into a folder that holds an earlier run's checkpoints
            deletes them first; without it such a run is refused.
        resume_from: with `is_keep_training`, the checkpoint folder of `config.output_dir` to continue from
            instead of the newest (the newer ones are moved aside, not deleted).
    """
    config, saved_run, start = start_up(config, given, is_keep_training, resume_from)  # the saved run, read once
    stop_when_launcher_dies()
    accelerator = create_accelerator(config.gradient_accumulation_steps, config.bf16,
                                     config.process_group_timeout_minutes, bf16_on_cpu=config.bf16_on_cpu,
                                     ddp=ddp_settings(config), **tracker_arguments(config.report_to))
    config, memory = settle_memory(config, accelerator, explicit_fields(config, given),
                                   saved_run.memory_choice(allow_config_change), start)
    log_path = setup_training_log(accelerator.process_index, accelerator.is_main_process, LAUNCH_LOG_DIR)
    log_decision(memory)
    check_shared_folder(accelerator, config.output_dir)  # several machines: checkpoints need a shared folder
    lock = lock_run_folder(accelerator, config.output_dir, "training")
    try:
        if not is_keep_training:
            start_fresh_run(accelerator, config.output_dir, overwrite)
        attach_run_log(run_training_log(config.output_dir))  # the folder is this run's now
        if start is not None and start.source is not None:
            run_on_main(accelerator, lambda: write_source_record(start, config))
        trainer = Trainer(config, accelerator, callbacks, memory=memory, given=given, saved_run=saved_run,
                          start=start)
        if is_keep_training:
            trainer.resume(allow_config_change, resume_from=resume_from)
        summary = trainer.fit()
        # This run made the process group: it ends it while every rank is still there (fit's last step is a
        # barrier), rather than leaving gloo's connections to the exit of processes that end one after another.
        end_process_group()
        return {**summary, "log_file": str(log_path), "run_log_file": str(run_training_log(config.output_dir))}
    finally:
        if lock is not None:
            lock.release()

