"""Rewriting parquet files into small row groups, in bounded memory, keeping every row and its order."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from lowmem.atomic_files import file_built_aside
from lowmem.data.reader import open_parquet
from lowmem.data.sources import FileSpec, open_parquet_metadata, resolve_parquet_files
from lowmem.errors import DataError
from lowmem.memory import release_arrow_memory
from lowmem.progress import progress_bar

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RepackResult:
    """One rewritten file."""

    source: str
    target: str
    rows: int
    row_groups_before: int
    row_groups_after: int


def plan_targets(sources: list[str], output: str | os.PathLike) -> list[tuple[str, str]]:
    """Pair each source with its output path.

    One source and an output ending in `.parquet` gives that file; otherwise the output is a directory
    that receives each source under its own name.
    """
    output = os.fspath(output)
    if len(sources) == 1 and output.endswith(".parquet") and not os.path.isdir(output):
        pairs = [(sources[0], output)]
    else:
        names = [os.path.basename(source) for source in sources]
        if len(set(names)) != len(names):
            raise DataError(
                "Two input files share a file name, so they would overwrite each other in the output "
                f"directory '{output}'. Repack them in separate runs, into separate directories."
            )
        pairs = [(source, os.path.join(output, name)) for source, name in zip(sources, names)]
    for source, target in pairs:
        if os.path.exists(target) and os.path.samefile(source, target):
            raise DataError(
                f"The output '{target}' is the input itself. Write to a new path, check it, then replace the original."
            )
    return pairs


def repack_file(source: str, target: str, row_group_rows: int = 10_000, compression: str = "zstd") -> RepackResult:
    """Rewrite one file with row groups of `row_group_rows` rows (the last may be shorter).

    Reads with `pre_buffer=False` in batches of `row_group_rows` rows, so memory holds about one output
    row group however large the input's row groups are. Writes to a temporary file and renames it into
    place when complete, so a failure never leaves a half-written output.
    """
    metadata = open_parquet_metadata(source)
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    reader = open_parquet(source, metadata)
    try:
        with file_built_aside(target) as partial:
            with pq.ParquetWriter(partial, reader.schema_arrow, compression=compression) as writer:
                batches = reader.iter_batches(batch_size=row_group_rows, use_threads=False)
                for batch in progress_bar(batches, total=-(-metadata.num_rows // row_group_rows),
                                          desc=os.path.basename(source), unit="group", leave=False):
                    writer.write_batch(batch, row_group_size=row_group_rows)
                    release_arrow_memory()
            written = pq.read_metadata(partial)
            if written.num_rows != metadata.num_rows:
                raise DataError(f"Repacking '{source}' wrote {written.num_rows} rows instead of {metadata.num_rows}.")
    finally:
        reader.close()
    return RepackResult(source, target, metadata.num_rows, metadata.num_row_groups, written.num_row_groups)


def repack(inputs: FileSpec, output: str | os.PathLike, row_group_rows: int = 10_000) -> list[RepackResult]:
    """Rewrite one or many parquet files (path, glob, directory or list) into small row groups."""
    if row_group_rows < 1:
        raise DataError(f"row_group_rows must be at least 1; got {row_group_rows}. 10000 is a good size.")
    results = []
    for source, target in plan_targets(resolve_parquet_files(inputs), output):
        result = repack_file(source, target, row_group_rows)
        logger.debug("Repacked %s → %s: %d rows, %d → %d row groups.", result.source, result.target,
                    result.rows, result.row_groups_before, result.row_groups_after)
        results.append(result)
    return results
