"""The data benchmark: rows/s and peak RSS of reading parquet, each case in a fresh process.

Cases:
    ceiling  pyarrow `read_row_group` + `to_pylist`, file order, no shuffle: the fastest plain read
    normal   ParquetStream, shuffled, normal mode
    ultra    ParquetStream, shuffled, ultra-low-mem mode
    resume   ParquetStream loaded from a position at 90% of the epoch: seconds to the first row
    resume10 the same at 10% of the epoch: the cost of a resume must not grow with the position

`measure` runs one case in this process; `run_case` runs it in a freshly spawned interpreter, so that each
case starts with a clean heap and its own peak RSS.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lowmem.memory.probe import own_high_water
from lowmem.units import DECIMAL_MB, GIB

if TYPE_CHECKING:
    from lowmem.config import TrainConfig

CASES = ("ceiling", "normal", "ultra", "resume", "resume10")
_SAMPLE_WORDS = ["春风", "明月", "江南", "归去", "相思", "落花", "流水", "千里", "故人", "长亭", "夜雨", "西楼",
                 "the", "river", "moon", "wind", "over", "hills"]


def generate_file(path: str | Path, rows: int, row_group_rows: int = 10_000, seed: int = 0) -> Path:
    """Write `rows` synthetic prompt/response rows (about 40 and 80 characters), with an `id` column,
    sorted by id, in chunks so that generating a large file needs little memory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = pa.array(_SAMPLE_WORDS)
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("response", pa.string())])
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for start in range(0, rows, row_group_rows):
            count = min(row_group_rows, rows - start)
            ids = pa.array(np.arange(start, start + count, dtype=np.int64))
            id_text = pc.cast(ids, pa.string())
            prompt = pc.binary_join_element_wise(
                "问", id_text, *(words.take(rng.integers(0, len(words), count)) for _ in range(8)), ""
            )
            response = pc.binary_join_element_wise(
                "答", id_text, *(words.take(rng.integers(0, len(words), count)) for _ in range(16)), ""
            )
            writer.write_table(pa.table([ids, prompt, response], schema=schema), row_group_size=row_group_rows)
    return path


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    return own_high_water()


def _measure_ceiling(files: Sequence[str]) -> dict[str, Any]:
    # Importing the data layer also gives this case the same imports as the others (torch included): equal baselines.
    from lowmem.data.sources import DEFAULT_COLUMNS

    rows = 0
    started = time.perf_counter()
    for path in files:
        reader = pq.ParquetFile(path)
        for group in range(reader.num_row_groups):
            rows += len(reader.read_row_group(group, columns=list(DEFAULT_COLUMNS)).to_pylist())
    return {"rows": rows, "seconds": time.perf_counter() - started}


def _measure_stream(files: Sequence[str], ultra_low_mem: bool, buffer_size: int, mix_row_groups: int) -> dict[str, Any]:
    from lowmem.data import ParquetStream

    stream = ParquetStream(files, buffer_size=buffer_size, ultra_low_mem=ultra_low_mem, seed=0,
                           mix_row_groups=mix_row_groups)
    tenth = len(stream) // 10
    rows, rss_at_tenth = 0, None
    started = time.perf_counter()
    for rows, _ in enumerate(stream, start=1):
        if rows == tenth:
            rss_at_tenth = _rss()
    return {"rows": rows, "seconds": time.perf_counter() - started, "rss_at_tenth": rss_at_tenth,
            "rows_decoded": stream.rows_decoded}


def _measure_resume(files: Sequence[str], buffer_size: int, fraction: float, mix_row_groups: int) -> dict[str, Any]:
    from lowmem.data import ParquetStream

    # The position is computed from the plan, without reading the rows before it.
    stream = ParquetStream(files, buffer_size=buffer_size, seed=0, mix_row_groups=mix_row_groups)
    cut = int(len(stream) * fraction)
    state = stream.state_with_positions({0: [cut // buffer_size, cut % buffer_size // 2, 0]})
    started = time.perf_counter()
    resumed = ParquetStream(files, buffer_size=buffer_size, seed=0, mix_row_groups=mix_row_groups)
    resumed.load_state_dict(state)
    next(iter(resumed))
    return {"rows": 1, "seconds": time.perf_counter() - started, "rows_decoded": resumed.rows_decoded}


def measure(case: str, files: Sequence[str], buffer_size: int = 5000, mix_row_groups: int = 16) -> dict[str, Any]:
    """Run one case in this process and return its figures (RSS in bytes)."""
    if case == "ceiling":
        result = _measure_ceiling(files)
    elif case in ("normal", "ultra"):
        result = _measure_stream(files, ultra_low_mem=case == "ultra", buffer_size=buffer_size,
                                 mix_row_groups=mix_row_groups)
    elif case in ("resume", "resume10"):
        result = _measure_resume(files, buffer_size, 0.9 if case == "resume" else 0.1, mix_row_groups)
    else:
        raise ValueError(f"unknown case {case!r}; choose from {CASES}")
    return {"case": case, **result, "rss_end": _rss(), "peak_rss": _peak_rss()}


def run_case(case: str, files: Sequence[str | Path], buffer_size: int = 5000,
             mix_row_groups: int = 16) -> dict[str, Any]:
    """Run one case in a fresh Python process and return its figures.

    "spawn" starts a new interpreter (no copy of this process's heap, as a fork would give) that imports
    lowmem from the same place as this one.
    """
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (case, [str(file) for file in files], buffer_size, mix_row_groups))


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """The benchmark table: one line per case, with ratios against the ceiling."""
    ceiling = results["ceiling"]
    ceiling_rate = ceiling["rows"] / ceiling["seconds"]
    lines = [
        "| case | rows/s | vs ceiling | peak RSS MB | peak vs ceiling MB |",
        "|---|---:|---:|---:|---:|",
    ]
    labels = {"ceiling": "(a) read_row_group + to_pylist, no shuffle", "normal": "(b) ParquetStream, shuffle",
              "ultra": "(c) ParquetStream ultra-low-mem, shuffle"}
    for case in ("ceiling", "normal", "ultra"):
        result = results[case]
        rate = result["rows"] / result["seconds"]
        lines.append(
            f"| {labels[case]} | {rate:,.0f} | {rate / ceiling_rate:.2f} | {result['peak_rss'] / DECIMAL_MB:,.0f} | "
            f"{(result['peak_rss'] - ceiling['peak_rss']) / DECIMAL_MB:+,.0f} |"
        )
    for case, label in (("resume", "(d) resume at 90% of the epoch"), ("resume10", "(e) resume at 10% of the epoch")):
        resume = results[case]
        lines.append(f"| {label}: seconds to first row | {resume['seconds']:.2f} s | | "
                     f"{resume['peak_rss'] / DECIMAL_MB:,.0f} | {resume['rows_decoded']:,} rows decoded |")
    return "\n".join(lines)


def machine_line() -> str:
    """The machine a benchmark ran on, in one line."""
    import platform

    memory_gb = psutil.virtual_memory().total / GIB
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {memory_gb:.0f} GiB RAM, "
            f"Python {platform.python_version()}, pyarrow {pa.__version__}")


def bench_data(files: Sequence[str | Path] | None = None, rows: int = 2_000_000, buffer_size: int = 5000,
               mix_row_groups: int = 16) -> str:
    """Run the cases, each in a fresh process, and return the table (generating a file if none given)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="lowmem-bench-") as folder:
        if not files:
            files = [generate_file(Path(folder) / f"bench-{rows}.parquet", rows)]
        results = {case: run_case(case, files, buffer_size, mix_row_groups) for case in CASES}
    total_rows = results["ceiling"]["rows"]
    return (f"{total_rows:,} rows, buffer_size={buffer_size}, mix_row_groups={mix_row_groups}, on {machine_line()}\n"
            "(each case in a fresh process with the same imports; peak RSS includes the interpreter and torch)\n"
            + format_table(results))


def config_on_data(config: TrainConfig, accelerator: Any, folder: Path, data_file: str | None,
                   rows: int) -> TrainConfig:
    """The config training on `data_file`, or on `rows` synthetic rows generated into `folder` by the main process."""
    from lowmem.distributed.collectives import broadcast_from_main

    if rows > 0:
        data_file = broadcast_from_main(accelerator, lambda: str(generate_file(folder / "rows.parquet", rows)))
    config = dataclasses.replace(config, train_file=data_file or config.train_file)
    if rows > 0 and config.text_column:
        config = dataclasses.replace(config, text_column="response")  # the synthetic rows' longer column
    return config
