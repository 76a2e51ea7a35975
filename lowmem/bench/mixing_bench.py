"""The mixing benchmark: how many row groups a batch draws from, against memory and speed, for each
number of row groups read at once (`mix_row_groups`).

The file is the data benchmark's, sorted by id, so a row's row group is its id // row-group rows. Each setting
runs in a fresh process: a timed pass over the whole file (rows/s, peak RSS), then the batches of the first
`sample_rows` rows are scored. Every case runs several rounds, interleaved with the plain read. The reference is
a uniform shuffle of the file: the expected number of row groups among `batch_size` rows drawn without replacement.
"""

from __future__ import annotations

import multiprocessing
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from lowmem.bench.data_bench import _measure_ceiling, _peak_rss, generate_file, machine_line
from lowmem.units import DECIMAL_MB

_ID = re.compile(r"问(\d+)")


def groups_per_batch(groups: Iterable[int], batch_size: int) -> float:
    """The mean number of distinct row groups in consecutive batches of `batch_size` rows (whole batches only)."""
    values = np.fromiter(groups, dtype=np.int64)
    batches = values[: values.shape[0] // batch_size * batch_size].reshape(-1, batch_size)
    if batches.shape[0] == 0:
        return float("nan")
    ordered = np.sort(batches, axis=1)
    return float((1 + (np.diff(ordered, axis=1) != 0).sum(axis=1)).mean())


def uniform_groups_per_batch(group_rows: Sequence[int], batch_size: int) -> float:
    """The expected number of distinct row groups among `batch_size` rows of a uniform shuffle."""
    total = float(sum(group_rows))
    # A group of n rows is missed by all draws with probability C(total - n, b) / C(total, b).
    missed = [np.exp(np.sum(np.log1p(-n / (total - np.arange(batch_size))))) for n in group_rows]
    return float(len(group_rows) - sum(missed))


def measure_mixing(files: Sequence[str], mix_row_groups: int, buffer_size: int, batch_size: int,
                   row_group_rows: int, sample_rows: int) -> dict[str, Any]:
    """One setting in this process: a timed pass (rows/s, peak RSS), then groups per batch over a sample
    (`sample_rows` 0: not scored)."""
    from lowmem.data import ParquetStream

    def stream() -> ParquetStream:
        return ParquetStream(files, buffer_size=buffer_size, mix_row_groups=mix_row_groups, seed=0, ultra_low_mem=False)

    started = time.perf_counter()
    rows = sum(1 for _ in stream())
    seconds = time.perf_counter() - started
    peak = _peak_rss()
    groups: list[int] = []
    for row in stream() if sample_rows else ():
        match = _ID.match(row["prompt"])
        assert match is not None  # every generated prompt starts with 问<id>
        groups.append(int(match.group(1)) // row_group_rows)
        if len(groups) == sample_rows:
            break
    return {"rows": rows, "seconds": seconds, "peak_rss": peak,
            "groups_per_batch": groups_per_batch(groups, batch_size)}


def _in_fresh_process(function: Any, *args: Any) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(function, args)


def bench_mixing(rows: int = 2_000_000, row_group_rows: int = 10_000, buffer_size: int = 5000, batch_size: int = 32,
                 mixes: Sequence[int] = (1, 4, 8, 16, 24, 32, 64), sample_rows: int = 320_000, rounds: int = 3) -> str:
    """Generate a sorted file, run each `mix_row_groups` in fresh processes, and return the table.

    Rates vary by a fifth from pass to pass on a shared 2-core machine, so every case runs `rounds` times,
    interleaved with the plain read, and the table gives medians: rows/s, and the ratio to the plain read of
    the same round.
    """
    with tempfile.TemporaryDirectory(prefix="lowmem-mixing-") as folder:
        path = generate_file(Path(folder) / f"sorted-{rows}.parquet", rows, row_group_rows)
        files = [str(path)]
        ceilings: list[dict[str, Any]] = []
        results: dict[int, list[dict[str, Any]]] = {mix: [] for mix in mixes}
        for round_ in range(rounds):
            ceilings.append(_in_fresh_process(_measure_ceiling, files))
            for mix in mixes:
                results[mix].append(_in_fresh_process(measure_mixing, files, mix, buffer_size, batch_size,
                                                      row_group_rows, sample_rows if round_ == 0 else 0))
    group_rows = [min(row_group_rows, rows - start) for start in range(0, rows, row_group_rows)]
    ceiling_rates = [run["rows"] / run["seconds"] for run in ceilings]
    baseline = float(np.median([run["peak_rss"] for run in results[mixes[0]]]))
    lines = [
        f"{rows:,} rows sorted by id in {len(group_rows)} row groups of {row_group_rows:,}, buffer_size={buffer_size}, "
        f"batches of {batch_size}, on {machine_line()}; medians of {rounds} rounds",
        f"(a uniform shuffle gives {uniform_groups_per_batch(group_rows, batch_size):.1f} row groups per batch; "
        f"the plain pyarrow read runs at {np.median(ceiling_rates):,.0f} rows/s)",
        "| mix_row_groups | row groups per batch | rows/s | vs plain read | peak RSS MB | vs first row MB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for mix, runs in results.items():
        rates = [run["rows"] / run["seconds"] for run in runs]
        ratio = np.median([rate / ceiling for rate, ceiling in zip(rates, ceiling_rates)])
        peak = float(np.median([run["peak_rss"] for run in runs]))
        lines.append(f"| {mix} | {runs[0]['groups_per_batch']:.1f} | {np.median(rates):,.0f} | {ratio:.2f} | "
                     f"{peak / DECIMAL_MB:,.0f} | {(peak - baseline) / DECIMAL_MB:+,.0f} |")
    return "\n".join(lines)
