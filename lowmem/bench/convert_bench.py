"""The conversion benchmark: `lowmem convert` against reading the whole file with pyarrow (and pandas), each in a
fresh process, on a generated JSON Lines file of prompt/response rows.

Cases:
    convert  `lowmem convert FILE --output=...`: one row group of rows in memory at a time
    pyarrow  `pyarrow.json.read_json(FILE)`: the whole file as one table
    pandas   `pandas.read_json(FILE, lines=True)`: the same in pandas, when pandas is installed

Every case runs in a fresh interpreter that reports its own peak RSS (VmHWM), and so does a second one that only
imports what the case imports: the difference is what the work itself held. Times leave out the imports.

    python -m lowmem.bench.convert_bench --size_gb=2
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lowmem.bench.data_bench import machine_line
from lowmem.units import DECIMAL_MB, GIB

_WORDS = ["春风", "明月", "江南", "归去", "相思", "落花", "流水", "千里", "故人", "长亭", "夜雨", "西楼", "山青",
          "云白", "the", "river", "moon", "wind"]
# A child reports its high-water RSS from /proc (ru_maxrss would count the parent's: exec keeps it).
_PEAK = """
def _peak():
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
"""
_CHILD = """
import json, sys, time
{imports}
{peak}
rows = None
started = time.perf_counter()
{work}
print("MEASURED " + json.dumps({{"seconds": time.perf_counter() - started, "peak_rss": _peak(), "rows": rows}}))
"""
CASES = {
    "convert": ("from lowmem.cli import main\nimport lowmem.conversion.convert",
                ("code = main(['convert', sys.argv[1], '--output=' + sys.argv[2], '--overwrite=True'])\n"
                 "assert code == 0, code")),
    "pyarrow": ("import pyarrow.json", "rows = pyarrow.json.read_json(sys.argv[1]).num_rows"),
    "pandas": ("import pandas", "rows = len(pandas.read_json(sys.argv[1], lines=True))"),
}


def generate_jsonl(path: str | Path, size_bytes: int, chunk_rows: int = 100_000, seed: int = 0) -> Path:
    """Write JSON Lines of prompt/response rows (about 20 and 60 characters of Chinese-like text, an `id`) until the
    file holds `size_bytes`, a chunk of rows at a time (built by pyarrow, written as one buffer): little memory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = pa.array(_WORDS)
    written = start = 0
    with open(path, "wb") as out:
        while written < size_bytes:
            ids = pc.cast(pa.array(np.arange(start, start + chunk_rows)), pa.string())
            prompt = pc.binary_join_element_wise(*(words.take(rng.integers(0, len(words), chunk_rows))
                                                   for _ in range(10)), "")
            response = pc.binary_join_element_wise(*(words.take(rng.integers(0, len(words), chunk_rows))
                                                     for _ in range(30)), "")
            lines = pc.binary_join_element_wise('{"id": ', ids, ', "prompt": "问', prompt, '", "response": "答',
                                                response, '"}\n', "")
            offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32)
            data = memoryview(lines.buffers()[2])[offsets[0]:offsets[len(lines)]]
            out.write(data)
            written += len(data)
            start += chunk_rows
    return path


def measure(case: str, args: list[str], work: bool = True) -> dict[str, Any]:
    """Run one case (or, with `work=False`, only its imports) in a fresh interpreter; its seconds and peak RSS,
    or "failed" with the last line it wrote."""
    imports, code = CASES[case]
    program = _CHILD.format(imports=imports, peak=_PEAK, work=code if work else "")
    done = subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True)
    measured = [line for line in done.stdout.splitlines() if line.startswith("MEASURED ")]
    if done.returncode != 0 or not measured:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"failed": "killed (out of memory?)" if done.returncode == -9 else last}
    return json.loads(measured[-1][len("MEASURED "):])


def _pandas_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("pandas") is not None


def run_cases(source: Path, target: Path) -> dict[str, dict[str, Any]]:
    """Every case, and the baseline of its imports alone."""
    results = {}
    for case in CASES:
        if case == "pandas" and not _pandas_installed():
            results[case] = {"skipped": "pandas is not installed"}
            continue
        result = measure(case, [str(source), str(target)])
        if "failed" not in result:
            result["baseline_rss"] = measure(case, [str(source), str(target)], work=False)["peak_rss"]
        results[case] = result
    return results


def format_table(results: dict[str, dict[str, Any]], size_bytes: int) -> str:
    """One line per case: seconds, MB/s of input, peak RSS, and the peak above the case's imports alone."""
    labels = {"convert": "(a) lowmem convert", "pyarrow": "(b) pyarrow.json.read_json",
              "pandas": "(c) pandas.read_json(lines=True)"}
    lines = ["| case | seconds | MB/s | peak RSS MB | peak above imports MB |", "|---|---:|---:|---:|---:|"]
    for case, result in results.items():
        if "seconds" not in result:
            why = f"skipped: {result['skipped']}" if "skipped" in result else f"failed: {result['failed']}"
            lines.append(f"| {labels[case]} | {why} | | | |")
            continue
        lines.append(f"| {labels[case]} | {result['seconds']:.1f} | {size_bytes / DECIMAL_MB / result['seconds']:,.0f} "
                     f"| {result['peak_rss'] / DECIMAL_MB:,.0f} "
                     f"| {(result['peak_rss'] - result['baseline_rss']) / DECIMAL_MB:,.0f} |")
    return "\n".join(lines)


def bench_convert(size_gb: float = 2.0, folder: str | None = None) -> str:
    """Generate a JSON Lines file of `size_gb` GiB (in `folder`, default a temporary one, removed after) and
    return the table of the cases on it."""
    with tempfile.TemporaryDirectory(prefix="lowmem-convert-bench-", dir=folder) as work:
        source = generate_jsonl(Path(work) / "bench.jsonl", int(size_gb * GIB))
        size = os.path.getsize(source)
        results = run_cases(source, Path(work) / "bench.parquet")
    return (f"a {size / GIB:.2f} GiB JSON Lines file ({size / DECIMAL_MB:,.0f} MB) of generated prompt/response "
            f"rows, on {machine_line()}\n(each case in a fresh process; peak RSS includes the interpreter and the "
            "case's imports, shown apart in the last column)\n" + format_table(results, size))


def main(size_gb: float = 2.0, folder: str | None = None) -> None:
    """Print the conversion benchmark's table for a generated file of `size_gb` GiB."""
    print(bench_convert(size_gb, folder))


if __name__ == "__main__":
    import fire

    fire.Fire(main)
