"""Shared test helpers: small generated parquet files.

pytest puts this folder on the import path (its conftest.py, in a folder that is no package): the helper modules
beside it (training_helpers.py, trainer_fixtures.py, data_helpers.py, ...) are what tests/unit/ and
tests/integration/ share. A test file never imports another (tests/unit/test_architecture.py checks it)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def write_rows(path: Path, ids: list[str], row_group_rows: int, **extra_columns) -> Path:
    """Write rows whose prompt is `id` and response `r:id` (plus any extra columns)."""
    table = pa.table({"prompt": ids, "response": [f"r:{i}" for i in ids], **extra_columns})
    pq.write_table(table, path, row_group_size=row_group_rows)
    return path


@pytest.fixture
def three_files(tmp_path: Path) -> list[Path]:
    """Three files with different row-group sizes, each with a short last row group: 3,278 rows."""
    specs = [("a", 1000, 100), ("b", 777, 64), ("c", 1501, 250)]
    return [
        write_rows(tmp_path / f"{name}.parquet", [f"{name}{i}" for i in range(rows)], group)
        for name, rows, group in specs
    ]
