"""The Trainer: ParquetStream → tokenizing collate → GPT on Accelerate (1..N processes, CPU or GPU).

A Trainer is made of small parts, each keeping its own state and saying itself when it is due:

    state        TrainState: epoch, step, tokens seen                       (checkpoint: shared)
    schedule     LearningRateSchedule: the learning rate of every step      (checkpoint: shared)
    checkpoints  CheckpointManager: atomic folders, retention, `due(step)`   (checkpoint: shared)
    data         LoaderPosition: the training loader and its exact position (checkpoint: per rank)
    rng          RngState: this process's random states                     (checkpoint: per rank)
    memory       MemoryMonitor: cleanups, memory records, phases, watchdog  (checkpoint: per rank)
    validator    Validator: validation loss and BLEU-4, `due(step)`
    step_log     StepLog: one readable line per logging step
    tracking     Tracking: the training curves (--report_to), from the main process
    stopper      GracefulStop: SIGINT/SIGTERM, or `request_stop(reason)`

A checkpoint is the model, the optimizer and the stateful parts (`TrainingCheckpoint`); a resume (`lowmem.train.resume`)
loads them back. `fit()` is the whole loop, a step at a time: take the step's batches, agree with every rank (a stop,
the end of the epoch), train, then validate and save when due.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from lowmem.atomic_files import write_json_atomic
from lowmem.checkpoint.contents import TrainingCheckpoint
from lowmem.config import TrainConfig, validate_config
from lowmem.config.read_only import read_only
from lowmem.config.settle import settled_config
from lowmem.config.columns import describe_loss_targets
from lowmem.config.train_sources import training_data
from lowmem.preference.evaluation import pair_scorer
from lowmem.preference.loss import preference_loss
from lowmem.disk_errors import writing
from lowmem.errors import DataError
from lowmem.distributed.accelerator import create_accelerator, ddp_settings
from lowmem.distributed.collectives import all_reduce_max, all_reduce_sum, run_on_main
from lowmem.distributed.peers import PeerWatch
from lowmem.distributed.performance import check_cuda_graphs, release_compile_workers, run_speed_settings
from lowmem.distributed.strategy import model_for_eval
from lowmem.eval.validation import EvalResult
from lowmem.eval.validator import Validator
from lowmem.memory.collector import freeze_set_up_objects
from lowmem.memory.plan import EXPORT, SAVE, STEP, VALIDATION
from lowmem.model.weights import unwrap_gpt
from lowmem.program import command_line
from lowmem.progress import progress_bar
from lowmem.run_files import tokenizer_record_file
from lowmem.train.callbacks import Callback
from lowmem.train.memory_fit import SAVED_KEY, MemoryDecision, log_decision, settle_memory
from lowmem.train.resume import (ResumeDecision, choose_checkpoint, data_position_to_load, decide_resume,
                                 epoch_may_restart, rescale_line, steps_after_rescale)
from lowmem.train.schedule import LearningRateSchedule, total_steps, warmup_kept_by
from lowmem.train.setup import (begin_load_phase, build_model_and_optimizer, ensure_tokenizer, keep_starting_model,
                                log_processes, make_checkpoint_manager, make_collate, make_loader, make_memory_monitor,
                                make_step_log, shared_memory_settings, steps_per_epoch)
from lowmem.source.settle import StartingPoint, describe_start
from lowmem.train.startup import SavedRun, settle_run
from lowmem.train.run_end import answer_sample, export_final, validation_losses_line
from lowmem.train.state import LoaderPosition, RngState, TrainState
from lowmem.train.step import (Batch, StepAgreement, StepResult, attention_pairs, compile_each_shape, count_rows,
                               count_tokens, train_step)
from lowmem.train.stop import GracefulStop
from lowmem.train.tracking import Tracking, tracker_arguments

logger = logging.getLogger(__name__)
# The most steps whose gradient norms stay unread on the device (see `Trainer.count_skipped_steps`).
UNREAD_NORMS_LIMIT = 1000


class Trainer:
    """Trains a GPT as a TrainConfig says; see the module's docstring for its parts.

    Args:
        config: the training configuration: as `run_training`'s start-up settled it when `saved_run` is given,
            else validated and settled here as a new run's (`lowmem.config.settle.settled_config`).
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
        if saved_run is None:  # not through run_training: settled here as a new run's, as `train` settles one
            validate_config(config)
            if start is None:  # never random weights where a model was named
                config, start = settle_run(config, given, SavedRun())
            config = read_only(settled_config(config, None, given))
        self.saved_run = saved_run or SavedRun()
        self.config, self.callbacks, self.given = config, list(callbacks), given
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
        phases = begin_load_phase(memory.plan, self.is_main)  # the model is built and filled next
        self.peers = PeerWatch.gather(self.accelerator, plan_line=memory.summary())
        measured = memory.measured  # what the memory plan decided on the way is the run's: nothing of it again here
        self.speed = memory.speed or run_speed_settings(config, self.accelerator)
        check_cuda_graphs(config, self.speed)
        logger.info("Speed settings: %s.", self.speed.describe())
        self.tokenizer, self.tokenizer_identity = ensure_tokenizer(config, self.accelerator, start, measured.tokenizer,
                                                                   measured.tokenizer_folder)
        settings = shared_memory_settings(config, self.accelerator, memory.settings)
        log_processes(self.accelerator, config)
        self.model, self.optimizer, loaded = build_model_and_optimizer(config, self.accelerator,
                                                                       self.tokenizer.vocab_size, settings, self.speed,
                                                                       start)
        if loaded is not None and start is not None and not start.resumed:
            logger.info(describe_start(start, loaded, unwrap_gpt(self.model).num_params(), self.tokenizer.describe()))
        keep_starting_model(self.model, config, self.accelerator, start)
        self.preference = preference_loss(config, self.model, self.accelerator, start)  # None unless DPO
        self.fixed_shapes, collate = make_collate(config, self.tokenizer, self.accelerator, self.speed,
                                                  measured.sample_if_tokenized(), measured.index,
                                                  preference=self.preference is not None)
        loader = make_loader(training_data(config), config, self.accelerator, collate, settings, shuffle=True,
                             index=measured.index)
        self.steps_per_epoch = steps_per_epoch(loader, config)
        planned_steps = total_steps(self.steps_per_epoch, config.epochs, config.max_steps)

        self.state = TrainState()
        self.schedule = LearningRateSchedule.from_config(config, planned_steps,
                                                         warmup_kept_by(config, given, planned_steps))
        self.checkpoints = make_checkpoint_manager(config, self.accelerator, self._all_ok, self.saved_run.folders)
        self.data, self.rng = LoaderPosition(loader), RngState()
        self.memory = make_memory_monitor(config, self.accelerator, settings,
                                          predicted_high_water=memory.predicted_high_water(self.is_main), phases=phases)
        self.validator = Validator(config, self.tokenizer, self.accelerator,
                                   pair_scorer(self.preference, self.tokenizer, self.accelerator, config))
        self.step_log = make_step_log(config, self.accelerator, unwrap_gpt(self.model), planned_steps)
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
                return self.finish()  # a rank that dies during the export is named too
            except Exception as error:
                # Still inside the signal handlers: the launcher's SIGTERM to the survivors cannot cut this short.
                self.peers.check(error)  # a rank of this machine died: one line instead of a traceback
                raise
            finally:
                self.end()
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
                                         agreed.global_target_tokens, config.grad_clip, self.preference)
        return StepResult(micro_batches, loss_sum, grad_norm, torch.isfinite(grad_norm), lr, agreed.target_tokens,
                          agreed.input_tokens, agreed.global_target_tokens, agreed.global_input_tokens,
                          attention_pairs(micro_batches, self.tokenizer.pad_id),
                          *(self.preference.step_figures(micro_batches) if self.preference else ()))

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
        with self.memory.phase(VALIDATION, self.state.epoch, self.state.step):
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

        with self.memory.phase(SAVE, self.state.epoch, self.state.step):
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
        decision = decide_resume(folder, self.saved_run.state_of(folder), self.checkpoints.marker_of(folder),
                                 self.config, self.tokenizer_identity,
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
        start (not after a resume, nor with --eval_on_start=False), the signal handlers and the progress bar."""
        def write_record() -> None:  # after a resume's checks: a refused resume leaves the record as it was
            with writing("the run's tokenizer record", self.config.output_dir):
                write_json_atomic(tokenizer_record_file(self.config.output_dir), self.tokenizer_identity)

        run_on_main(self.accelerator, write_record)
        warmup = self.schedule.warmup_line()  # after a resume: the warmup the run started with
        if warmup:
            logger.warning(warmup)
        # The set-up's memory, before the first validation and step: what a run started from a model holds loaded.
        self.memory.start(self.state.epoch, self.state.step)
        self.memory.enter_phase(STEP, self.state.epoch, self.state.step)  # the load (and a resume's) ends
        if self.resumed_from is None and self.config.eval_on_start:
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
        """After the last step and the export, or a failure: signal handlers back, progress bar closed, last memory
        record."""
        self.stopper.uninstall()
        if self.progress is not None:
            self.progress.close()
        self.memory.end(self.state.epoch, self.state.step)

    def _all_ok(self, ok: bool) -> bool:
        return all_reduce_max(self.accelerator, [0.0 if ok else 1.0])[0] == 0.0

    def summary(self) -> dict[str, Any]:
        """Validation losses, steps, tokens and seconds of the run so far, and what stopped it."""
        self.count_skipped_steps()
        last, state = self.validator.last, self.state
        return {"val_loss_start": state.val_loss_start, "steps": state.step, "tokens_seen": state.tokens_seen,
                "val_loss_end": last.loss if last is not None else state.val_loss_start,
                "bleu4_end": self.validator.last_score("bleu4"), "seconds": time.perf_counter() - self.started,
                "processes": self.accelerator.num_processes, "stopped_by": self.stopper.requested_by,
                "skipped_steps": state.skipped_steps, "rows_not_trained": state.rows_not_trained}

    def finish(self) -> dict[str, Any]:
        """After the loop; returns the summary. Stopped: say how to continue. Done: the callbacks see the model as
        evaluation runs it, final/ and best/ are exported and a sampled answer logged. Every rank enters together."""
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
            logger.info(validation_losses_line(summary, self.state.step))
            epoch, step = self.state.epoch, self.state.step
            with self.memory.phase(EXPORT, epoch, step):
                export_final(final_model, self.model, self.config, self.checkpoints.manifest, self.given,
                             self.accelerator)
            with self.memory.phase(VALIDATION, epoch, step):  # generation, as validation's
                summary["sample"] = answer_sample(final_model, self.model, self.tokenizer, self.config,
                                                  self.accelerator)
        self.accelerator.wait_for_everyone()  # every rank is here before any ends the process group
        return summary
