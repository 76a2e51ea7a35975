"""Write a copy of the demo training data sorted by response length, in row groups of the demo's size.

Files sorted by a property (source, date, topic, length) are what mixing within a batch is for: read one row
group at a time, every batch of such a file holds rows of one length band. The README trains on this copy
with `--dataloader_mix_row_groups=1` and with the default to show the difference.

Usage, from the repository root:

    python scripts/sorted_demo_copy.py [--out data/sorted/train.parquet] [--row-group-rows 2000]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_TRAIN = REPO_ROOT / "lowmem" / "demo_data" / "train.parquet"


def main(argv: list[str] | None = None) -> int:
    """Sort the demo's training rows by response length (ties: prompt) and write them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "sorted" / "train.parquet")
    parser.add_argument("--row-group-rows", type=int, default=2000)
    args = parser.parse_args(argv)
    table = pq.read_table(DEMO_TRAIN)  # 24k short rows: a few MB
    table = table.append_column("length", pc.utf8_length(table["response"]))
    table = table.sort_by([("length", "ascending"), ("prompt", "ascending")]).drop_columns(["length"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, args.out, row_group_size=args.row_group_rows, compression="zstd")
    print(f"{table.num_rows:,} rows sorted by response length → {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
