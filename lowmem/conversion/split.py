"""Held-out rows split off a converted file: `lowmem convert ... --validation_rows=N`.

N rows drawn at random (seeded: the same file gives the same split) are moved from the parquet file into
`<name>_valid.parquet` beside it, in one pass a row group at a time: memory holds one row group, whatever the file's
size. Both files are written aside and renamed into place when complete.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lowmem.errors import DataError

VALID_SUFFIX = "_valid"


def validation_path(target: str | Path) -> Path:
    """Where the rows split off `target` go: `<stem>_valid.parquet` beside it."""
    target = Path(target)
    return target.with_name(target.stem + VALID_SUFFIX + target.suffix)


def split_off_validation(target: str | Path, rows: int, seed: int = 0) -> tuple[int, Path]:
    """Move `rows` rows of the parquet file `target`, drawn at random with `seed`, into `validation_path(target)`;
    returns (the rows left for training, the validation file). At least one row is left to train on."""
    target = Path(target)
    source = pq.ParquetFile(target)
    total = source.metadata.num_rows
    if not 0 < rows < total:
        raise DataError(f"--validation_rows={rows} cannot be split off {target}, which holds {total:,} rows: ask for "
                        "at least 1 and fewer than all of them.")
    chosen = np.zeros(total, dtype=bool)
    chosen[random.Random(seed).sample(range(total), rows)] = True
    valid_path = validation_path(target)
    train_aside = target.with_name(target.name + ".partial")
    valid_aside = valid_path.with_name(valid_path.name + ".partial")
    start = 0
    with pq.ParquetWriter(train_aside, source.schema_arrow) as train, \
            pq.ParquetWriter(valid_aside, source.schema_arrow) as valid:
        for group in range(source.num_row_groups):
            table = source.read_row_group(group)
            mask = chosen[start:start + table.num_rows]
            start += table.num_rows
            if (~mask).any():
                train.write_table(table.filter(pa.array(~mask)))
            if mask.any():
                valid.write_table(table.filter(pa.array(mask)))
    os.replace(valid_aside, valid_path)
    os.replace(train_aside, target)
    return total - rows, valid_path
