"""The commands that train: `train` (the model), `tokenizer` (the SentencePiece tokenizer) and `dpo_reference` (the
reference log-probabilities of preference training, computed ahead)."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Sequence

from lowmem.cli.common import build_config, resolve_config
from lowmem.config import TrainConfig
from lowmem.errors import ConfigError

if TYPE_CHECKING:  # torch is imported by the commands that use it, not by the CLI's start
    import torch

    from lowmem.preference.precompute import Share


def train(use_large_config: bool = False, is_keep_training: bool = False, allow_config_change: bool = False,
          overwrite: bool = False, resume_from_checkpoint: str | None = None, **overrides: Any) -> None:
    """Train a GPT on the training file's prompt/response rows (the packaged demo data set by default), or on one
    column of text with --text_column=NAME.

    Run it alone for one process, or under `accelerate launch --num_processes N` for N (on a machine
    without GPUs add `--multi_gpu` and set ACCELERATE_USE_CPU=1). The tokenizer is trained first if
    it is missing.

    Args:
        use_large_config: start from TrainConfigPretrainLarge (3 GPUs, 12 GB RAM host) instead of TrainConfig.
        is_keep_training: continue from the latest complete checkpoint of the run folder (output_dir).
        allow_config_change: with is_keep_training, continue even though settings that decide the data order,
            batches or learning-rate schedule changed since the checkpoint (the run is then not exact).
        overwrite: start a new run in an output_dir that holds an earlier run's checkpoints, deleting them
            first (without it, such a run is refused: --is_keep_training=True continues the earlier one).
        resume_from_checkpoint: continue from this checkpoint-<step> folder instead of the run's newest (its
            parent is the run folder; newer checkpoints are moved aside into superseded-<time>/, not deleted).
        overrides: any config field, as --<field>=<value>; the options above list them with their defaults.
    """
    _train(use_large_config, is_keep_training, allow_config_change, overrides, callbacks=(), overwrite=overwrite,
           resume_from_checkpoint=resume_from_checkpoint)


def resume_target(config: TrainConfig, given: Collection[str], checkpoint: str) -> TrainConfig:
    """`config` with the run folder of `checkpoint` (its parent), after a quick check that it is a complete
    checkpoint (every rank makes it before anything is launched; the main process hashes its files when it
    resumes, `CheckpointManager.resume_from`) and that a given --output_dir agrees."""
    from lowmem.checkpoint.folders import verify_checkpoint

    folder = Path(str(checkpoint))
    if not folder.is_dir():
        raise ConfigError(f"--resume_from_checkpoint={checkpoint}: no such folder. Pass one of the run folder's "
                          "checkpoint-<step> folders.")
    run_dir = folder.resolve().parent
    if "output_dir" in given and Path(config.output_dir).resolve() != run_dir:
        raise ConfigError(f"--resume_from_checkpoint={checkpoint} belongs to the run folder {run_dir}, but "
                          f"--output_dir={config.output_dir}: leave --output_dir out, or pass a checkpoint of it.")
    problems = verify_checkpoint(folder, check_hashes=False)
    if problems:
        raise ConfigError(f"--resume_from_checkpoint={checkpoint} cannot be resumed from: {'; '.join(problems)}. "
                          "Choose another checkpoint-<step> folder.")
    return dataclasses.replace(config, output_dir=str(folder.parent))


def _train(use_large_config: bool, is_keep_training: bool, allow_config_change: bool, overrides: dict[str, Any],
           callbacks: Sequence[Any], overwrite: bool = False, resume_from_checkpoint: str | None = None) -> None:
    from lowmem.train.run import run_training

    config, given = resolve_config(use_large_config, overrides, settle_for_print=lambda config, given: (
        _settled_printout(config, given, is_keep_training or bool(resume_from_checkpoint))))
    if resume_from_checkpoint:
        config, is_keep_training = resume_target(config, given, resume_from_checkpoint), True
    run_training(config, is_keep_training=is_keep_training, allow_config_change=allow_config_change,
                 callbacks=callbacks, given=given, overwrite=overwrite,
                 resume_from=str(resume_from_checkpoint) if resume_from_checkpoint else None)


def _settled_printout(config: TrainConfig, given: frozenset[str], is_keep_training: bool
                      ) -> tuple[dict[str, Any], list[str]]:
    """`--print_config`: the config the run will use, planned for the processes and strategy it was launched with."""
    from lowmem.cli.planning import planned_layout
    from lowmem.cli.print_config import launched_layout, settled_printout

    processes, strategy = launched_layout()
    return settled_printout(config, given, is_keep_training, planned_layout(config, processes, strategy))


def train_with(callbacks: Sequence[Any]) -> Callable[..., None]:
    """The train command with `callbacks` handed to the Trainer (for programs that embed the command line)."""

    @functools.wraps(train)
    def train_command(use_large_config: bool = False, is_keep_training: bool = False,
                      allow_config_change: bool = False, overwrite: bool = False,
                      resume_from_checkpoint: str | None = None, **overrides: Any) -> None:
        _train(use_large_config, is_keep_training, allow_config_change, overrides, callbacks, overwrite,
               resume_from_checkpoint)

    return train_command


def tokenizer(use_large_config: bool = False, **overrides: Any) -> None:
    """Train the SentencePiece tokenizer on the training file(s) and save it to tokenizer_dir.

    Text is streamed from parquet, a capped, shuffled sample of it is used, on all cores. `train` runs
    this by itself when no tokenizer exists; run it to retrain (for example with another --vocab_size).

    Args:
        use_large_config: take train_file, vocab_size and tokenizer_dir from TrainConfigPretrainLarge.
        overrides: config fields, e.g. --train_file=..., --vocab_size=8000, --tokenizer_dir=...
    """
    from lowmem.config import validate_config
    from lowmem.data.path_checks import check_data_files
    from lowmem.train.setup import train_tokenizer_for

    config = build_config(use_large_config, overrides)
    validate_config(config)
    check_data_files(config, ("train_file",))
    tokenizer = train_tokenizer_for(config)
    print(f"Tokenizer with {tokenizer.vocab_size} pieces saved to {config.tokenizer_dir}")


def dpo_reference(use_large_config: bool = False, device: str = "", **overrides: Any) -> None:
    """Compute the reference model's log-probabilities of every preference row of --train_file and
    --validation_file in one streaming pass, written beside each (`data/pairs.parquet` → `data/pairs.reference/`),
    so that `train --objective=dpo --dpo_reference=precomputed` fine-tunes every weight without a second model in
    memory. A pass that stops resumes where it stopped when run again with the same flags. Under `accelerate launch`
    each process computes its share of the rows with a whole copy of the model, into the same folders (a pass
    resumes on any number of processes), in the numerics the same launch trains in (under FSDP2 in bf16, its
    policy's): run it with the launcher the training run will use.

    Args:
        use_large_config: start from TrainConfigPretrainLarge, as `train --use_large_config=True`.
        device: cpu or cuda (default: cuda when a GPU is visible).
        overrides: config fields: --init_from (the model DPO will start from), --train_file, --validation_file,
            --prompt_column, --chosen_column, --rejected_column, --max_seq_len (as the training run's),
            --batch_size_per_gpu.
    """
    import torch

    from lowmem.distributed.accelerator import bf16_for
    from lowmem.distributed.collectives import end_process_group
    from lowmem.distributed.precision import AUTOCAST, FLOAT32
    from lowmem.preference.precompute import Share, precompute_reference, reference_folder
    from lowmem.source.locate import find_source

    config, given = resolve_config(use_large_config, overrides, demo_data=False)
    if device not in ("", "cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda (it is {device!r}).")
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    alone = AUTOCAST if bf16_for(chosen, config.bf16, config.bf16_on_cpu) else FLOAT32
    share, chosen, precision = shared_pass(config) if several else (Share(), chosen, alone)
    try:
        source = find_source(config.init_from) if config.init_from else None  # both passes' source: read once
        folders = [precompute_reference(config, files, reference_folder(files), chosen, given, share, precision,
                                        source)
                   for files in dict.fromkeys((config.train_file, config.validation_file))]
    finally:
        if several:
            end_process_group()
    train_folder, validation_folder = folders[0], folders[-1]
    length = f" --max_seq_len={config.max_seq_len}" if "max_seq_len" in given else ""
    if share.rank == 0:
        print(f"Train with: train --objective=dpo --init_from={config.init_from} --dpo_reference=precomputed "
              f"--train_file={train_folder} --validation_file={validation_folder}{length}")


def shared_pass(config: TrainConfig) -> tuple[Share, torch.device, str]:
    """Under `accelerate launch`: this process's `Share` of a reference pass (a barrier and a sum over the processes),
    the device the launcher gave it and the numerics a training run of the same launch computes in
    (`lowmem.distributed.precision`)."""
    import torch

    from lowmem.distributed.accelerator import create_accelerator
    from lowmem.distributed.precision import launch_precision
    from lowmem.preference.precompute import Share

    accelerator = create_accelerator(1, config.bf16, config.process_group_timeout_minutes,
                                     bf16_on_cpu=config.bf16_on_cpu)

    def total(count: int) -> int:
        return int(accelerator.reduce(torch.tensor([count], device=accelerator.device), "sum").item())

    return Share(accelerator.process_index, accelerator.num_processes, accelerator.wait_for_everyone,
                 total), accelerator.device, launch_precision(accelerator)
