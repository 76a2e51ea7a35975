"""A data error inside a DataLoader worker (a damaged row group, text that is not UTF-8) reaches the user as the
same one paragraph it is without workers, not wrapped in torch's report of the worker's traceback (through the
command: tests/integration/test_worker_errors_command.py)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from test_bad_text import write_bad_text
from training_helpers import write_chat_rows

from lowmem.data import ParquetStream, StreamLoader
from lowmem.errors import DataError

ROWS, GROUP_ROWS = 2000, 200


def write_damaged(path, group: int = 5):
    """Chat rows in row groups of GROUP_ROWS whose row group `group` has its compressed pages scrambled."""
    write_chat_rows(path, ROWS, seed=3, row_group_rows=GROUP_ROWS)
    metadata = pq.ParquetFile(path).metadata.row_group(group)
    data = bytearray(path.read_bytes())
    for column in range(metadata.num_columns):
        chunk = metadata.column(column)
        start = chunk.data_page_offset + 40  # past the page header, inside the compressed values
        for offset in range(start, min(start + 64, chunk.data_page_offset + chunk.total_compressed_size)):
            data[offset] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


def error_of(path, workers: int) -> str:
    loader = StreamLoader(ParquetStream(str(path), buffer_size=50, shuffle=False), batch_size=16,
                          num_workers=workers, collate_fn=lambda rows: len(rows))
    with pytest.raises(DataError) as error:
        for _ in loader:
            pass
    return str(error.value)


@pytest.mark.parametrize("kind", ["damaged row group", "text that is not UTF-8"])
def test_a_workers_data_error_reads_as_without_workers(tmp_path, kind):
    path = (write_damaged(tmp_path / "damaged.parquet") if kind == "damaged row group"
            else write_bad_text(tmp_path / "bad.parquet"))
    alone = error_of(path, workers=0)
    in_worker = error_of(path, workers=1)
    assert in_worker == alone
    assert "Traceback" not in in_worker and "worker process" not in in_worker and str(path) in in_worker
