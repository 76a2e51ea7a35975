"""lowmem's command line: `lowmem COMMAND [--flag=value ...]` (or `python train_low_mem.py COMMAND ...`), also
under `accelerate launch`.

Commands:
    train       train a GPT on parquet rows (the demo data set by default)
    plan        the memory plan of a train command: high-water per process by part, the savers it needs
    tokenizer   train the SentencePiece tokenizer on the training files
    evaluate    score a trained model on the test file: loss, perplexity, BLEU-4
    generate    answer a prompt (or each line typed) with a trained model
    export      write a trained model as a folder transformers loads (AutoModelForCausalLM, AutoTokenizer)
    memlog      summarise a run's memory logs: growth per rank and a leak verdict
    repack      rewrite parquet files into small row groups
    convert     convert JSON Lines, JSON, CSV, TSV or text files into parquet
    bench_data  benchmark the data pipeline against a plain pyarrow read
    bench_mixing how many row groups a batch mixes, against memory and speed, for each mix_row_groups
    bench_train benchmark training steps through the pipeline against in-memory batches
    bench_memory the memory table: high-water RSS and tokens/s of DDP and FSDP with each memory saver
    bench_attention attention over packed rows against one causal sequence, forward and backward
    gpu_check   every GPU path in one command, stage by stage (--device=cpu: the same, reduced, on the CPU)
    gpu_bundle  the wheels and script that run gpu_check on a GPU machine without network

`lowmem COMMAND --help` documents each one. The commands themselves live in `training` (train, tokenizer),
`planning` (plan),
`evaluation` (evaluate, generate, export), `tools` (memlog, repack, convert, bench_*) and `gpu` (gpu_check,
gpu_bundle).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import fire

from lowmem.cli.common import ConfigPrinted, strict_flags
from lowmem.cli.evaluation import evaluate, export, generate
from lowmem.cli.gpu import gpu_bundle, gpu_check
from lowmem.cli.help_text import join_args_of
from lowmem.cli.planning import plan
from lowmem.cli.tools import (bench_attention, bench_data, bench_memory, bench_mixing, bench_train, convert, memlog,
                              repack)
from lowmem.cli.training import dpo_reference, tokenizer, train, train_with
from lowmem.errors import LowmemError
from lowmem.program import program_name


_HELP_TEXTS = {command: command.__doc__ for command in (train, tokenizer, plan)}


def document_options(preset: type | None = None) -> None:
    """Append the config sources and every config field, with its value in `preset` (TrainConfig by default) and
    its help, to the help of the commands that take them."""
    from lowmem.config import TrainConfig, describe_fields
    from lowmem.config.sources import SOURCE_FLAGS

    preset = preset or TrainConfig
    sources = "\n".join(f"--{name}: {text}" for name, text in SOURCE_FLAGS.items())
    options = f"{sources}\n{describe_fields(preset())}".replace("\n", "\n        ")
    for command, text in _HELP_TEXTS.items():
        # Before "Args:", where fire's help still shows it.
        assert text is not None  # every command in _HELP_TEXTS has a docstring
        head, args = text.split("    Args:", 1)
        command.__doc__ = f"{head}    Options ({preset.__name__} defaults):\n        {options}\n\n    Args:{args}"
    join_args_of(_HELP_TEXTS)


def _preset_asked(argv: list[str]) -> type | None:
    """The preset a command line names (`--preset=large`, `--use_large_config=True`), for its --help; None when
    it names none or names it wrongly (the command itself then says what is wrong)."""
    from lowmem.config.overrides import parse_bool
    from lowmem.config.sources import choose_preset

    values = dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    try:
        return choose_preset(parse_bool("use_large_config", values.get("use_large_config", False)),
                             values.get("preset"))
    except LowmemError:
        return None


document_options()

COMMANDS: dict[str, Callable[..., Any]] = {
    "train": train,
    "plan": plan,
    "tokenizer": tokenizer,
    "dpo_reference": dpo_reference,
    "evaluate": evaluate,
    "generate": generate,
    "export": export,
    "memlog": memlog,
    "repack": repack,
    "convert": convert,
    "bench_data": bench_data,
    "bench_mixing": bench_mixing,
    "bench_train": bench_train,
    "bench_memory": bench_memory,
    "bench_attention": bench_attention,
    "gpu_check": gpu_check,
    "gpu_bundle": gpu_bundle,
}
join_args_of(COMMANDS.values())  # fire prints each option's help whole


def main(argv: list[str] | None = None, callbacks: Sequence[Any] = ()) -> int:
    """Run one command; errors the user can fix are printed as one message, without a traceback.

    Args:
        argv: the command and its flags (default: the process's arguments).
        callbacks: `lowmem.train.callbacks.Callback`s for the train command.
    """
    from lowmem.log_format import console_handler  # one format of log lines, before training and during it
    logging.basicConfig(level=logging.INFO, handlers=[console_handler()])
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--help"], ["-h"]):
        argv = ["--", "--help"]  # the list of commands, without fire's note on how it reads a help flag
    elif argv and any(arg in ("--help", "-h") for arg in argv[1:]):
        document_options(_preset_asked(argv[1:]))  # `train --preset=large --help` shows the preset's values
        # Commands that take **overrides would read --help as an option: ask fire for the help itself.
        argv = [argv[0], "--", "--help"]
    try:
        commands = {**COMMANDS, "train": train_with(callbacks)} if callbacks else COMMANDS
        fire.Fire({name: strict_flags(command) for name, command in commands.items()}, command=argv,
                  name=program_name())
    except ConfigPrinted:
        return 0
    except LowmemError as error:
        if str(error):  # a rank that only follows the main process's decision has nothing to add
            print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        described = _disk_failure(error)
        if described is None:
            raise
        print(f"error: {described}", file=sys.stderr)
        return 2
    return 0


def _disk_failure(error: Exception) -> Exception | None:
    """The one-paragraph message for a file Python could not write for want of space (a full disk, a quota, a
    file-size limit) where no part of the command said more about it; None for any other error, which keeps
    its traceback. The writes of checkpoints, models and the tokenizer say more themselves."""
    from lowmem.disk_errors import SPACE_ERRNOS, disk_write_error

    if not isinstance(error, OSError) or error.errno not in SPACE_ERRNOS or not error.filename:
        return None
    return disk_write_error(error, str(error.filename), Path(error.filename).parent, option=None,
                            kept="Files written before were not changed by this failure.")
