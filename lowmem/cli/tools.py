"""Tools around training: `memlog` (memory-log reports), `repack` (parquet row groups), `convert` (text formats to
parquet) and the benchmarks."""

from __future__ import annotations

from typing import Any

from lowmem.cli.common import build_config


def memlog(path: str | None = None, plot: str | None = None, json: bool = False, log_dir: str = "logs",
           use_large_config: bool = False, **overrides: Any) -> None:
    """Summarise a run's memory logs: per rank start/peak/end RSS, growth per 1,000 steps, and a leak verdict.

    Usage: `lowmem memlog PATH` (PATH as a word or --path=PATH), e.g. `lowmem memlog model_save/demo`: a run
    writes its memory logs into <output_dir>/logs.

    For each rank: start, peak and end RSS, the growth in MB per 1,000 steps after warm-up (a least-squares
    slope), peak GPU memory, the lowest system available memory and what the cleanups freed; then FLAT, or
    GROWING with the step at which the budget would run out. Partly written logs are read up to the damage.

    Args:
        path: a run folder (an output_dir: its logs, the segments of a resumed run joined), a run id, a memory
            log file, or a folder of logs; with train's flags (below), the run `train` writes with them (its
            <output_dir>/logs); with neither, the newest run in log_dir.
        plot: also draw RSS (and GPU memory) per rank against the step, with the budget line, into this PNG
            (needs matplotlib: pip install "matplotlib>=3.6").
        json: print the same data as JSON instead of a table.
        log_dir: where to look when neither PATH nor train's flags name a run: the logs/ of the folder `train`
            was started from, which links every run's memory logs (each run keeps its own in <output_dir>/logs).
        use_large_config: the run of `train --use_large_config=True` (with the same flags).
        overrides: train's flags that choose its run folder (--output_dir, --train_file, --init_from, ...).
    """
    from lowmem.memory.log_files import run_folder_log_dir
    from lowmem.memory.report import memlog_command

    if path is None and (use_large_config or overrides):  # train's flags name its run: that one, or say so
        path = build_config(use_large_config, overrides, demo_data=False).output_dir
        if run_folder_log_dir(path) is None:
            from lowmem.errors import DataError

            raise DataError(f"No memory logs in {path}/logs: the run `train` writes with these flags has not logged "
                            "yet (it writes a record at the start and every --memory_log_steps steps). Pass the run "
                            "folder, a run id or a log file instead.")
    print(memlog_command(path, plot=plot, json_output=json, log_dir=log_dir))


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


def convert(*inputs: str, output: str | None = None, prompt_field: str | None = None,
            response_field: str | None = None, text_field: str | None = None, chosen_field: str | None = None,
            rejected_field: str | None = None, text_unit: str = "line", input_format: str | None = None,
            row_group_rows: int = 10_000, overwrite: bool = False, validation_rows: int = 0) -> None:
    """Convert JSON Lines, JSON arrays, CSV, TSV or plain text into parquet files with small row groups.

    Reads .jsonl/.ndjson/.json (one record per line, or one array of records), .csv, .tsv and .txt files, also
    compressed as .gz or .zst, as a stream: memory holds about one row group whatever the file's size. Each
    output is written aside and renamed when complete. Records that cannot be used (not valid JSON, a field
    missing, null or empty) are left out and counted by reason, with their first line numbers, in the summary
    printed for each file.

    Fields: prompt/response by default; when the records do not have them (and no field is named), the first of
    text (one text column), instruction + input/output (Alpaca), question/answer, query/response,
    prompt/completion, input/output, or a conversation (conversations or messages: one row per assistant turn,
    prompted with the conversation before it). Plain text gives one text column. Preference data (chosen and
    rejected answers, as text beside a prompt, as lists of turns, or as Human/Assistant text that carries the
    prompt) gives the columns prompt, chosen and rejected, which DPO training reads.

    Args:
        inputs: files, folders (every file below them with a suffix convert reads) or globs.
        output: for one input, the .parquet file to write (default: beside the input, same stem); for several,
            a folder receiving one file per input, by stem (default: each beside its input).
        prompt_field: the field holding the prompt (a.b reaches into nested objects).
        response_field: the field holding the response.
        text_field: write this one field as a column `text` (pretraining data) instead of prompt/response (JSON
            and CSV inputs; a text file is one column `text` already).
        chosen_field: the field holding the chosen answer of preference data (written as the column `chosen`).
        rejected_field: the field holding the rejected answer of preference data (written as the column
            `rejected`).
        text_unit: for plain text: "line" (a row per line) or "paragraph" (a row per run of lines up to a
            blank line).
        input_format: read every input as jsonl, json, csv, tsv, txt or parquet, whatever its suffix.
        row_group_rows: rows per row group; 10,000 keeps reads small and shuffling good.
        overwrite: replace output files that already exist (by default they are refused).
        validation_rows: move this many rows, drawn at random (seeded), out of each output into
            `<name>_valid.parquet` beside it: held-out rows for --validation_file.
    """
    from lowmem.conversion.convert import FieldNames, convert as convert_files, find_inputs, plan_targets
    from lowmem.conversion.split import split_off_validation, validation_path
    from lowmem.errors import ConfigError

    def text(value: object) -> str | None:  # fire reads --prompt_field=1 as a number
        return None if value is None else str(value)

    names = FieldNames(text(prompt_field), text(response_field), text(text_field), text(chosen_field),
                       text(rejected_field))
    held_out = int(validation_rows)
    if held_out < 0:
        raise ConfigError(f"--validation_rows must be 0 (no split) or more, got {held_out}.")
    if held_out and not overwrite:  # refused before anything is written, as an existing output is
        existing = [str(validation_path(target)) for _, target in
                    plan_targets(find_inputs([str(entry) for entry in inputs]), text(output))
                    if validation_path(target).exists()]
        if existing:
            raise ConfigError(f"{', '.join(existing)} exist(s): pass --overwrite=True to replace, or convert "
                              "elsewhere with --output=...; nothing was written.")
    for result in convert_files([str(entry) for entry in inputs], text(output), names, str(text_unit),
                                int(row_group_rows), text(input_format), overwrite):
        print(result.summary())
        if held_out:
            left, valid = split_off_validation(result.target, held_out)
            print(f"{held_out:,} rows drawn at random moved to {valid} (--validation_file={valid}); {left:,} left "
                  f"in {result.target}.")


def bench_data(*files: str, rows: int = 2_000_000, buffer_size: int = 5000, mix_row_groups: int = 16) -> None:
    """Benchmark reading: a plain pyarrow read against ParquetStream (normal, ultra-low-mem, resume).

    Each case runs in a fresh process and the table shows rows/s, peak RSS, and the seconds from a
    resume at 90% of the epoch to its first row.

    Args:
        files: parquet files to read; with none, a file of `rows` generated rows is written to a temporary folder.
        rows: rows of the generated file.
        buffer_size: ParquetStream's shuffle buffer, in rows.
        mix_row_groups: row groups each reader reads at once and mixes.
    """
    from lowmem.bench.data_bench import bench_data as run_bench

    print(run_bench(list(files) or None, rows=rows, buffer_size=buffer_size, mix_row_groups=mix_row_groups))


def bench_mixing(rows: int = 2_000_000, row_group_rows: int = 10_000, buffer_size: int = 5000, batch_size: int = 32,
                 mixes: tuple = (1, 4, 8, 16, 24, 32)) -> None:
    """Benchmark mixing: row groups per batch, rows/s and peak RSS for each mix_row_groups, on a sorted file.

    Each setting runs in a fresh process on a generated file sorted by id, so that a row's row group is known;
    the table compares with a uniform shuffle (row groups per batch) and with a plain pyarrow read (rows/s).

    Args:
        rows: rows of the generated file.
        row_group_rows: rows per row group of the generated file.
        buffer_size: ParquetStream's shuffle window, in rows.
        batch_size: rows per batch.
        mixes: the mix_row_groups values to compare, e.g. --mixes=1,16.
    """
    from lowmem.bench.mixing_bench import bench_mixing as run_bench

    mixes = (mixes,) if isinstance(mixes, int) else tuple(int(mix) for mix in mixes)
    print(run_bench(rows=rows, row_group_rows=row_group_rows, buffer_size=buffer_size, batch_size=batch_size,
                    mixes=mixes))


def bench_train(use_large_config: bool = False, steps: int | None = None, skip_steps: int = 3,
                data_file: str | None = None, rows: int = 0, peak_tflops: float = 0.0, pipeline: bool = True,
                reference: bool = True, trainer: bool = True, **overrides: Any) -> None:
    """Benchmark training: the same model and optimizer on in-memory batches (the ceiling), through the pipeline
    and in the training loop itself, and a plain PyTorch loop on the same batches for reference.

    Prints one table: tokens/s of each, their ratio, the share of step time spent waiting for data, peak RSS
    per process and, on a GPU, peak GPU memory and MFU; then lowmem's step and loop as ratios of the plain loop's,
    (a)/(r) and (t)/(r). Every phase is timed from one synchronisation of the device to another, with no result
    read back per step. Run it under `accelerate launch` to measure several processes (the plain loop then runs on
    each process on its own).

    Args:
        use_large_config: benchmark TrainConfigPretrainLarge instead of TrainConfig.
        steps: timed optimizer steps in each phase (default 200 on a GPU, 20 on the CPU).
        skip_steps: untimed steps before them (warm-up; torch.compile compiles here).
        data_file: parquet rows to train on (default: the config's train_file).
        rows: generate a parquet file of this many synthetic rows instead.
        peak_tflops: the GPU's dense bf16 peak in TFLOP/s for MFU (default: from the GPU's name).
        pipeline: also time the steps through the real pipeline (False: in-memory batches only).
        reference: after lowmem's phases, free its model and train a fresh one of the same configuration in a
            plain PyTorch loop (whole logits, no accelerate, the same attention) on the same in-memory batches
            (False: skip it).
        trainer: after (a) and (b), run the training loop (Trainer.fit, every default on, no save or validation
            within the timed steps) on the same rows (False: skip it).
    """
    from lowmem.bench.train_bench import bench_train as run_bench

    table = run_bench(build_config(use_large_config, overrides), steps=steps, skip_steps=skip_steps,
                      data_file=data_file, rows=rows, peak_tflops=peak_tflops, pipeline=pipeline,
                      reference=reference, trainer=trainer)
    if table:
        print(table)


def bench_attention(seq_len: int = 4096, batch: int = 4, heads: int = 12, head_dim: int = 64,
                    rows_per_sequence: int = 8, repeats: int = 20, device: str = "") -> None:
    """Benchmark attention over packed rows against one causal sequence of the same length, forward and backward:
    plain causal SDPA (the floor), the rows kept apart by SDPA with a mask, and by FlexAttention (a GPU only).

    Prints one table: milliseconds per pass and each case against the floor.

    Args:
        seq_len: tokens per sequence.
        batch: sequences.
        heads: attention heads.
        head_dim: channels per head.
        rows_per_sequence: rows packed in each sequence.
        repeats: timed passes per case.
        device: cuda or cpu (default: cuda when a GPU is visible).
    """
    from lowmem.bench.attention_bench import bench_attention as run_bench

    print(run_bench(seq_len=seq_len, batch=batch, heads=heads, head_dim=head_dim,
                    rows_per_sequence=rows_per_sequence, repeats=repeats, device=device))


def bench_memory(use_large_config: bool = False, processes: int = 3, strategies: Any = "ddp,fsdp",
                 chunk_tokens: int = 2048, steps: int = 1, skip_steps: int = 1, rows: int = 0,
                 every_combination: bool = True, **overrides: Any) -> None:
    """The memory table: high-water RSS per process and tokens/s for DDP and FSDP, each with the whole-logits
    and the chunked loss, activation checkpointing off and on; every case in fresh processes on the CPU.

    Args:
        use_large_config: measure TrainConfigPretrainLarge instead of TrainConfig.
        processes: processes per case (accelerate launch --num_processes).
        strategies: "ddp", "fsdp" or "ddp,fsdp".
        chunk_tokens: tokens per chunk for the chunked loss's rows.
        steps: timed optimizer steps per case.
        skip_steps: untimed steps before them.
        rows: generate this many synthetic rows for every case (0: the config's train_file).
        every_combination: all four cases per strategy; False: only the chunked loss with checkpointing.
        overrides: any other config field, passed to every case (e.g. --n_layer=24 --tokenizer_dir=...).
    """
    from lowmem.bench.memory_bench import bench_memory as run_bench

    names = strategies.split(",") if isinstance(strategies, str) else list(strategies)
    bench_args = [f"--use_large_config={use_large_config}", f"--steps={steps}", f"--skip_steps={skip_steps}",
                  *(f"--{name}={value}" for name, value in overrides.items())]
    print(run_bench(bench_args, processes=processes, strategies=[name.strip() for name in names],
                    chunk_tokens=chunk_tokens, rows=rows, every_combination=every_combination))
