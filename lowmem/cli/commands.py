"""lowmem's command line: `python train_low_mem.py COMMAND [--flag=value ...]`, also under `accelerate launch`.

Commands:
    train       train a GPT on parquet rows (the demo data set by default)
    tokenizer   train the SentencePiece tokenizer on the training files
    evaluate    score a trained model on the test file: loss, perplexity, BLEU-4
    generate    answer a prompt (or each line typed) with a trained model
    memlog      summarise a run's memory logs: growth per rank and a leak verdict
    repack      rewrite parquet files into small row groups
    bench_data  benchmark the data pipeline against a plain pyarrow read
    bench_train benchmark training steps through the pipeline against in-memory batches

`python train_low_mem.py COMMAND --help` documents each one.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Any, Callable, Sequence

import fire

from lowmem.errors import LowmemError


def _config(use_large_config: bool, overrides: dict[str, Any]) -> Any:
    from lowmem.config import TrainConfig, TrainConfigPretrainLarge
    from lowmem.config import apply_overrides

    return apply_overrides(TrainConfigPretrainLarge() if use_large_config else TrainConfig(), overrides)


def train(use_large_config: bool = False, is_keep_training: bool = False, allow_config_change: bool = False,
          **overrides: Any) -> None:
    """Train a GPT on the training file's prompt/response rows (the demo data set in data/ by default).

    Run it alone for one process, or under `accelerate launch --num_processes N` for N (on a machine
    without GPUs add `--multi_gpu` and set ACCELERATE_USE_CPU=1). The tokenizer is trained first if
    it is missing.

    Args:
        use_large_config: start from TrainConfigPretrainLarge (3 GPUs, 12 GB RAM host) instead of TrainConfig.
        is_keep_training: continue from the latest complete checkpoint of the run folder (output_dir).
        allow_config_change: with is_keep_training, continue even though settings that decide the data order,
            batches or learning-rate schedule changed since the checkpoint (the run is then not exact).
        overrides: any config field, as --<field>=<value>; OPTIONS below lists them with their defaults.
    """
    _train(use_large_config, is_keep_training, allow_config_change, overrides, callbacks=())


def _train(use_large_config: bool, is_keep_training: bool, allow_config_change: bool, overrides: dict[str, Any],
           callbacks: Sequence[Any]) -> None:
    from lowmem.train.trainer import run_training

    config = _config(use_large_config, overrides)
    run_training(config, is_keep_training=is_keep_training, allow_config_change=allow_config_change,
                 callbacks=callbacks)


def _train_with(callbacks: Sequence[Any]) -> Callable[..., None]:
    """The train command with `callbacks` handed to the Trainer (for programs that embed the command line)."""

    @functools.wraps(train)
    def train_command(use_large_config: bool = False, is_keep_training: bool = False,
                      allow_config_change: bool = False, **overrides: Any) -> None:
        _train(use_large_config, is_keep_training, allow_config_change, overrides, callbacks)

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

    config = _config(use_large_config, overrides)
    validate_config(config)
    tokenizer = train_tokenizer_for(config)
    print(f"Tokenizer with {tokenizer.vocab_size} pieces saved to {config.tokenizer_dir}")


def _document_options() -> None:
    """Append every config field, with its default and comment, to the help of the commands that take them."""
    from lowmem.config import TrainConfig
    from lowmem.config import describe_fields

    options = describe_fields(TrainConfig()).replace("\n", "\n        ")
    for command in (train, tokenizer):
        # Before "Args:", where fire's help still shows it.
        head, args = command.__doc__.split("    Args:", 1)
        command.__doc__ = f"{head}    Options (TrainConfig defaults):\n        {options}\n\n    Args:{args}"


def repack(inputs: str, output: str, row_group_rows: int = 10_000) -> None:
    """Rewrite parquet files into row groups of `row_group_rows` rows, keeping every row, column and their order.

    Memory stays near one output row group however large the input's row groups are, and each output
    is written to a temporary file and renamed when complete.

    Args:
        inputs: a parquet file, a directory (every *.parquet below it) or a glob.
        output: a .parquet path for one input, otherwise a directory that receives each file by name.
        row_group_rows: rows per output row group; 10,000 keeps reads small and shuffling good.
    """
    from lowmem.data.repack import repack as repack_files

    for result in repack_files(inputs, output, row_group_rows):
        print(f"{result.source} → {result.target}: {result.rows:,} rows, "
              f"{result.row_groups_before} → {result.row_groups_after} row groups")


def evaluate(use_large_config: bool = False, checkpoint: str | None = None, test_file: str | None = None,
             bleu_samples: int = -1, **overrides: Any) -> None:
    """Score a trained model on the test file: loss, perplexity and BLEU-4 (sacrebleu), with a baseline.

    Loads the run's best/ model (else final/), or --checkpoint. Writes <output_dir>/eval/test_summary.json
    and test_generations.jsonl (prompt, reference, generation per line). Works under `accelerate launch`
    too: each process scores its share, every sample once.

    Args:
        use_large_config: take output_dir and the other settings from TrainConfigPretrainLarge.
        checkpoint: a checkpoint-<step>, best/ or final/ folder to evaluate instead.
        test_file: the rows to score (default: the config's test_file).
        bleu_samples: how many test prompts to answer for BLEU-4 (-1: all of them).
        overrides: config fields, e.g. --output_dir=..., --batch_size_per_gpu=..., --eval_max_new_tokens=...
    """
    from lowmem.eval.commands import evaluate_command

    summary = evaluate_command(_config(use_large_config, overrides), checkpoint, test_file, bleu_samples)
    if summary.get("summary_file"):
        print(json.dumps(summary, indent=2, ensure_ascii=False))


def generate(prompt: str | None = None, use_large_config: bool = False, checkpoint: str | None = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, **overrides: Any) -> None:
    """Answer a prompt with a trained model; without --prompt, answer each line typed (empty line or Ctrl+D ends).

    Loads the run's best/ model (else final/), or --checkpoint.

    Args:
        prompt: the prompt; leave it out for an interactive loop.
        use_large_config: take output_dir from TrainConfigPretrainLarge.
        checkpoint: a checkpoint-<step>, best/ or final/ folder to use instead.
        max_new_tokens: the longest answer, in tokens.
        temperature: 0 for greedy answers; above 0 samples (0.8 is a good start).
        top_k: sample among the k most likely tokens only.
        top_p: sample among the most likely tokens whose probabilities add up to top_p.
        seed: seed for sampling, for repeatable answers.
        overrides: config fields, e.g. --output_dir=model_save/demo.
    """
    from lowmem.eval.commands import generate_command

    generate_command(_config(use_large_config, overrides), prompt, checkpoint, max_new_tokens, temperature, top_k,
                     top_p, seed)


def memlog(path: str | None = None, plot: str | None = None, json: bool = False, log_dir: str = "logs") -> None:
    """Summarise a run's memory logs: per rank start/peak/end RSS, growth per 1,000 steps, and a leak verdict.

    For each rank: start, peak and end RSS, the growth in MB per 1,000 steps after warm-up (a least-squares
    slope), peak GPU memory, the lowest system available memory and what the cleanups freed; then FLAT, or
    GROWING with the step at which the budget would run out. Partly written logs are read up to the damage.

    Args:
        path: a run id, a memory log file, or a folder; by default the newest run in log_dir.
        plot: also draw RSS (and GPU memory) per rank against the step, with the budget line, into this PNG
            (needs matplotlib: pip install "lowmem[plot]").
        json: print the same data as JSON instead of a table.
        log_dir: where the memory logs are.
    """
    from lowmem.memory.report import memlog_command

    print(memlog_command(path, plot=plot, json_output=json, log_dir=log_dir))


def bench_data(*files: str, rows: int = 2_000_000, buffer_size: int = 5000) -> None:
    """Benchmark reading: a plain pyarrow read against ParquetStream (normal, ultra-low-mem, resume).

    Each case runs in a fresh process and the table shows rows/s, peak RSS, and the seconds from a
    resume at 90% of the epoch to its first row.

    Args:
        files: parquet files to read; with none, a file of `rows` generated rows is written to a temporary folder.
        rows: rows of the generated file.
        buffer_size: ParquetStream's shuffle buffer, in rows.
    """
    from lowmem.bench.data_bench import bench_data as run_bench

    print(run_bench(list(files) or None, rows=rows, buffer_size=buffer_size))


def bench_train(use_large_config: bool = False, steps: int = 20, skip_steps: int = 3, data_file: str | None = None,
                rows: int = 0, peak_tflops: float = 0.0, **overrides: Any) -> None:
    """Benchmark training: the same model and optimizer on in-memory batches (the ceiling) and through the pipeline.

    Prints one table: tokens/s of each, their ratio, the share of step time spent waiting for data, peak RSS
    per process and, on a GPU, peak GPU memory and MFU. Run it under `accelerate launch` to measure
    several processes.

    Args:
        use_large_config: benchmark TrainConfigPretrainLarge instead of TrainConfig.
        steps: timed optimizer steps in each phase.
        skip_steps: untimed steps before them (warm-up; torch.compile compiles here).
        data_file: parquet rows to train on (default: the config's train_file).
        rows: generate a parquet file of this many synthetic rows instead.
        peak_tflops: the GPU's dense bf16 peak in TFLOP/s for MFU (default: from the GPU's name).
    """
    from lowmem.bench.train_bench import bench_train as run_bench

    table = run_bench(_config(use_large_config, overrides), steps=steps, skip_steps=skip_steps, data_file=data_file,
                      rows=rows, peak_tflops=peak_tflops)
    if table:
        print(table)


_document_options()

COMMANDS = {
    "train": train,
    "tokenizer": tokenizer,
    "evaluate": evaluate,
    "generate": generate,
    "memlog": memlog,
    "repack": repack,
    "bench_data": bench_data,
    "bench_train": bench_train,
}


def main(argv: list[str] | None = None, callbacks: Sequence[Any] = ()) -> int:
    """Run one command; errors the user can fix are printed as one message, without a traceback.

    Args:
        argv: the command and its flags (default: the process's arguments).
        callbacks: `lowmem.train.callbacks.Callback`s for the train command.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and any(arg in ("--help", "-h") for arg in argv[1:]):
        # Commands that take **overrides would read --help as an option: ask fire for the help itself.
        argv = [argv[0], "--", "--help"]
    try:
        commands = {**COMMANDS, "train": _train_with(callbacks)} if callbacks else COMMANDS
        fire.Fire(commands, command=argv, name="train_low_mem.py")
    except LowmemError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0

