"""The mixture benchmark: two sources at 0.7/0.3 against one source of as many rows, in batches of 32.

    python -m lowmem.bench.mixture_bench [--batches=10000]

Prints the share of each source over all batches and the largest deviation in a single batch, and rows/s of the
mixture against a single ParquetStream over the same number of rows (each measured twice, the faster kept).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lowmem.bench.data_bench import machine_line
from lowmem.config.train_sources import Source
from lowmem.data import ParquetStream, StreamLoader
from lowmem.data.mixture import MixedStream

BATCH = 32
WEIGHTS = (0.7, 0.3)


def _write(path: Path, tag: str, rows: int) -> str:
    text = [f"{tag}{i} " + "春风明月江南归去" * 8 for i in range(rows)]
    pq.write_table(pa.table({"prompt": text, "response": text}), path, row_group_size=10_000)
    return str(path)


def _timed(loader: StreamLoader, batches: int) -> tuple[float, list[int]]:
    """Seconds to read `batches` batches, and the rows of the first source in each."""
    start = time.perf_counter()
    firsts = []
    for index, batch in enumerate(loader):
        firsts.append(sum(row["prompt"].startswith("A") for row in batch))
        if index + 1 == batches:
            break
    return time.perf_counter() - start, firsts


def run(batches: int = 10_000) -> str:
    rows = batches * BATCH
    with tempfile.TemporaryDirectory() as folder:
        single = _write(Path(folder) / "single.parquet", "A", rows)
        sources = [Source(_write(Path(folder) / f"s{i}.parquet", tag, round(rows * weight)), weight)
                   for i, (tag, weight) in enumerate(zip("AB", WEIGHTS))]
        settings: dict[str, Any] = dict(buffer_size=2000, mix_row_groups=16, ultra_low_mem=False,
                                        large_row_group_bytes=10**10)
        single_seconds = min(_timed(StreamLoader(ParquetStream(single, **settings), BATCH), batches)[0]
                             for _ in range(2))
        measured = [_timed(StreamLoader(MixedStream(sources, **settings), BATCH), batches) for _ in range(2)]
        mixed_seconds, firsts = min(measured)
    share = sum(firsts) / (len(firsts) * BATCH)
    worst = max(abs(count - WEIGHTS[0] * BATCH) for count in firsts)
    return "\n".join([
        machine_line(),
        f"{len(firsts):,} batches of {BATCH} rows, sources at {WEIGHTS[0]}/{WEIGHTS[1]}",
        "| | rows/s | vs one source |",
        "|---|---:|---:|",
        f"| one source | {rows / single_seconds:,.0f} | 1.00 |",
        f"| mixture of two | {rows / mixed_seconds:,.0f} | {single_seconds / mixed_seconds:.2f} |",
        f"share of the first source over all batches: {share:.4f} (weight {WEIGHTS[0]}); the largest deviation "
        f"in one batch: {worst:.1f} rows of {BATCH}",
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10_000)
    print(run(parser.parse_args().batches))
