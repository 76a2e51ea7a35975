"""A data error inside a DataLoader worker (a damaged row group, text that is not UTF-8) reaches the user as the
same one paragraph it is without workers, not wrapped in torch's report of the worker's traceback (through the
command: tests/integration/test_worker_errors_command.py)."""

from __future__ import annotations

import pytest
from data_helpers import write_bad_text, write_damaged

from lowmem.data import ParquetStream, StreamLoader
from lowmem.errors import DataError


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
