"""Build the demo data set (lowmem/demo_data/train.parquet, valid.parquet, test.parquet) from the chinese-poetry corpus.

Usage, from the repository root:

    python scripts/build_demo_data.py [--source DIR] [--out DIR] [--seed N] [--row-group-rows N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from demo_corpus import build_demo_corpus  # beside this script

REPO_ROOT = Path(__file__).resolve().parents[1]

DEFAULT_SOURCE = REPO_ROOT.parent / "shared" / "corpora" / "chinese-poetry"
DEFAULT_OUT = REPO_ROOT / "lowmem" / "demo_data"  # shipped inside the package


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--source", type=Path, default=DEFAULT_SOURCE, help=f"corpus folder (default: {DEFAULT_SOURCE})"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0, help="seed for the split, templates and row order (default: 0)")
    parser.add_argument("--row-group-rows", type=int, default=2000, help="rows per parquet row group (default: 2000)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the data set and print its summary as JSON."""
    args = parse_args(argv)
    summary = build_demo_corpus(args.source, args.out, seed=args.seed, row_group_rows=args.row_group_rows)
    print(json.dumps(summary, ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
