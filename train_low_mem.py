"""lowmem's command line: `python train_low_mem.py COMMAND [--flag=value ...]`, also under `accelerate launch`.

Commands:
    repack      rewrite parquet files into small row groups
    bench_data  benchmark the data pipeline against a plain pyarrow read

`python train_low_mem.py COMMAND --help` documents each one.
"""

from __future__ import annotations

import logging
import sys

import fire

from lowmem.errors import LowmemError


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


COMMANDS = {
    "repack": repack,
    "bench_data": bench_data,
}


def main(argv: list[str] | None = None) -> int:
    """Run one command; errors the user can fix are printed as one message, without a traceback."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        fire.Fire(COMMANDS, command=argv, name="train_low_mem.py")
    except LowmemError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
