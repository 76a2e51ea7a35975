"""`lowmem train` as a composition: the start-up settles the run once (`lowmem.train.startup`), the memory plan fits
it to the budget (`lowmem.train.memory_fit`), the run folder is locked and made the run's, and a Trainer built from
what was settled trains it, resumed first when asked."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Sequence

from lowmem.checkpoint.run_lock import lock_run_folder, start_fresh_run
from lowmem.config import TrainConfig
from lowmem.distributed.accelerator import create_accelerator, ddp_settings
from lowmem.distributed.collectives import check_shared_folder, end_process_group, run_on_main
from lowmem.distributed.launcher_watch import stop_when_launcher_dies
from lowmem.run_files import LAUNCH_LOG_DIR, run_training_log
from lowmem.source.settle import write_source_record
from lowmem.preference.reference import check_preference_start
from lowmem.train.setup import check_adapters_strategy
from lowmem.train.callbacks import Callback
from lowmem.train.gpu_oom import is_out_of_memory, said_as_paragraph
from lowmem.train.log import attach_run_log, setup_training_log
from lowmem.config.overrides import explicit_fields
from lowmem.train.memory_fit import log_decision, settle_memory
from lowmem.source.stage import log_stage
from lowmem.train.startup import start_up
from lowmem.train.tracking import tracker_arguments
from lowmem.train.trainer import Trainer


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
    check_adapters_strategy(config, accelerator)  # before the run folder is touched
    check_preference_start(config, accelerator, start)
    config, memory = settle_memory(config, accelerator, explicit_fields(config, given),
                                   saved_run.memory_choice(allow_config_change), start)
    log_path = setup_training_log(accelerator.process_index, accelerator.is_main_process, LAUNCH_LOG_DIR)
    log_decision(memory)
    if start is not None and start.stage is not None and accelerator.is_main_process:
        log_stage(start.stage)
    check_shared_folder(accelerator, config.output_dir)  # several machines: checkpoints need a shared folder
    lock = lock_run_folder(accelerator, config.output_dir, "training")
    try:
        if not is_keep_training:
            start_fresh_run(accelerator, config.output_dir, overwrite)
        attach_run_log(run_training_log(config.output_dir))  # the folder is this run's now
        if start is not None and start.source is not None and not start.resumed:
            run_on_main(accelerator, lambda: write_source_record(start, config))
        trainer = Trainer(config, accelerator, callbacks, memory=memory, given=given, saved_run=saved_run,
                          start=start)
        if is_keep_training:
            trainer.resume(allow_config_change, resume_from=resume_from)
        try:
            summary = trainer.fit()
        except Exception as error:
            if is_out_of_memory(error):  # one paragraph and exit code 2 instead of CUDA's traceback
                raise said_as_paragraph(error, config, memory.plan, is_keep_training) from error
            raise
        # This run made the process group: it ends it while every rank is still there (fit's last step is a
        # barrier), rather than leaving gloo's connections to the exit of processes that end one after another.
        end_process_group()
        return {**summary, "log_file": str(log_path), "run_log_file": str(run_training_log(config.output_dir))}
    finally:
        if lock is not None:
            lock.release()

