"""`lowmem convert` takes the same memory whatever the input's size: each conversion runs in a fresh process,
whose high-water mark (VmHWM) is read at its end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from training_helpers import ROOT

from lowmem.bench.convert_bench import generate_jsonl


# ----- memory -------------------------------------------------------------------------------------------------------
_PEAK_CHILD = """
import sys
from lowmem.cli import main
assert main(["convert", sys.argv[1], "--output=" + sys.argv[2], "--row_group_rows=1000"]) == 0
with open("/proc/self/status") as status:
    print(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")))
"""


def _peak_rss(source: Path, target: Path) -> int:
    done = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(source), str(target)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_memory_stays_flat_on_a_file_a_hundred_row_groups_long(tmp_path):
    big = generate_jsonl(tmp_path / "big.jsonl", 80 * 10**6)
    one_group = tmp_path / "one.jsonl"
    with open(big, "rb") as lines, open(one_group, "wb") as out:
        out.writelines(next(lines) for _ in range(1000))
    # The baseline converts one row group of the same rows: the interpreter, the imports, and what the
    # libraries take on first use (allocator arenas, compression contexts), which no input size changes.
    baseline = _peak_rss(one_group, tmp_path / "one.parquet")
    peak = _peak_rss(big, tmp_path / "big.parquet")
    assert pq.ParquetFile(tmp_path / "big.parquet").metadata.num_row_groups > 200
    size = big.stat().st_size
    assert peak - baseline < size / 10, (f"peak {peak / 1e6:.0f} MB, baseline {baseline / 1e6:.0f} MB, "
                                         f"file {size / 1e6:.0f} MB")
