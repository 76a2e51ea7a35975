"""The commands that train: `train` (the model) and `tokenizer` (the SentencePiece tokenizer)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from lowmem.cli.common import build_config


def train(use_large_config: bool = False, is_keep_training: bool = False, allow_config_change: bool = False,
          overwrite: bool = False, **overrides: Any) -> None:
    """Train a GPT on the training file's prompt/response rows (the packaged demo data set by default).

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
        overrides: any config field, as --<field>=<value>; the options above list them with their defaults.
    """
    _train(use_large_config, is_keep_training, allow_config_change, overrides, callbacks=(), overwrite=overwrite)


def _train(use_large_config: bool, is_keep_training: bool, allow_config_change: bool, overrides: dict[str, Any],
           callbacks: Sequence[Any], overwrite: bool = False) -> None:
    from lowmem.config import given_fields
    from lowmem.train.trainer import run_training

    config = build_config(use_large_config, overrides)
    run_training(config, is_keep_training=is_keep_training, allow_config_change=allow_config_change,
                 callbacks=callbacks, given=given_fields(config, overrides), overwrite=overwrite)


def train_with(callbacks: Sequence[Any]) -> Callable[..., None]:
    """The train command with `callbacks` handed to the Trainer (for programs that embed the command line)."""

    @functools.wraps(train)
    def train_command(use_large_config: bool = False, is_keep_training: bool = False,
                      allow_config_change: bool = False, overwrite: bool = False, **overrides: Any) -> None:
        _train(use_large_config, is_keep_training, allow_config_change, overrides, callbacks, overwrite)

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
    from lowmem.train.setup import train_tokenizer_for

    config = build_config(use_large_config, overrides)
    validate_config(config)
    tokenizer = train_tokenizer_for(config)
    print(f"Tokenizer with {tokenizer.vocab_size} pieces saved to {config.tokenizer_dir}")
