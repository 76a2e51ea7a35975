"""ParquetStream: every row exactly once, evenly over ranks and DataLoader workers; deterministic; well shuffled."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import write_rows
from torch.utils.data import get_worker_info

from lowmem.data import ParquetStream, StreamLoader

TOTAL_ROWS = 1000 + 777 + 1501


def _tag_with_worker(rows):
    info = get_worker_info()
    return (0 if info is None else info.id, [row["prompt"] for row in rows])


def rows_per_consumer(files, world_size: int, num_workers: int, **kwargs) -> list[list[str]]:
    """Read one epoch on every rank (and worker) and return each consumer's rows."""
    consumers = []
    for rank in range(world_size):
        stream = ParquetStream(files, rank=rank, world_size=world_size, buffer_size=300, **kwargs)
        loader = StreamLoader(stream, batch_size=7, collate_fn=_tag_with_worker, num_workers=num_workers)
        by_worker: dict[int, list[str]] = {}
        for worker, prompts in loader:
            by_worker.setdefault(worker, []).extend(prompts)
        consumers.extend(by_worker[w] for w in sorted(by_worker))
        assert sum(len(rows) for rows in by_worker.values()) == len(stream)
    return consumers


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_row_once_and_evenly(three_files, world_size, num_workers):
    consumers = rows_per_consumer(three_files, world_size, num_workers)
    num_consumers = world_size * max(1, num_workers)
    assert len(consumers) == num_consumers
    sizes = {len(rows) for rows in consumers}
    assert sizes == {TOTAL_ROWS // num_consumers}
    every_row = [row for rows in consumers for row in rows]
    assert len(every_row) == len(set(every_row)), "a row was given twice"
    assert TOTAL_ROWS - len(every_row) < num_consumers


def test_len_matches_rows_per_rank(three_files):
    stream = ParquetStream(three_files, rank=2, world_size=3)
    assert len(stream) == TOTAL_ROWS // 3
    assert len(list(stream)) == len(stream)


def test_same_arguments_same_stream_and_other_epoch_other_order(three_files):
    first = [r["prompt"] for r in ParquetStream(three_files, seed=7, buffer_size=100)]
    again = [r["prompt"] for r in ParquetStream(three_files, seed=7, buffer_size=100)]
    assert first == again
    other_epoch = ParquetStream(three_files, seed=7, buffer_size=100)
    other_epoch.set_epoch(1)
    second = [r["prompt"] for r in other_epoch]
    assert second != first and sorted(second) == sorted(first)
    other_seed = [r["prompt"] for r in ParquetStream(three_files, seed=8, buffer_size=100)]
    assert other_seed != first


def test_no_shuffle_gives_file_order(three_files):
    rows = [r["prompt"] for r in ParquetStream(three_files, shuffle=False, buffer_size=64)]
    expected = [f"a{i}" for i in range(1000)] + [f"b{i}" for i in range(777)] + [f"c{i}" for i in range(1501)]
    assert rows == expected
    assert rows[0] == "a0" and rows[-1] == "c1500"


def test_no_shuffle_with_ranks_gives_contiguous_file_order(three_files):
    expected = [f"a{i}" for i in range(1000)] + [f"b{i}" for i in range(777)] + [f"c{i}" for i in range(1501)]
    per = TOTAL_ROWS // 3
    for rank in range(3):
        rows = [r["prompt"] for r in ParquetStream(three_files, shuffle=False, rank=rank, world_size=3)]
        assert rows == expected[rank * per:(rank + 1) * per]


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rank_x = np.argsort(np.argsort(x)).astype(float)
    rank_y = np.argsort(np.argsort(y)).astype(float)
    return float(np.corrcoef(rank_x, rank_y)[0, 1])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_shuffle_breaks_file_order(tmp_path, seed):
    rows = 60_000
    path = write_rows(tmp_path / "sorted.parquet", [str(i) for i in range(rows)], row_group_rows=500)  # 120 groups
    ids = np.array([int(r["prompt"]) for r in ParquetStream(path, buffer_size=1000, seed=seed)])
    assert len(ids) == rows
    correlation = _spearman(np.arange(rows), ids)
    assert abs(correlation) < 0.05, correlation
    # The order inside a window is mixed too: neighbours are rarely neighbours in the file.
    assert np.mean(np.abs(np.diff(ids)) == 1) < 0.01


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_without_drop_remainder_every_row_is_read_exactly_once(three_files, world_size, num_workers):
    consumers = rows_per_consumer(three_files, world_size, num_workers, drop_remainder=False)
    every_row = [row for rows in consumers for row in rows]
    assert len(every_row) == TOTAL_ROWS and len(set(every_row)) == TOTAL_ROWS
    assert max(map(len, consumers)) - min(map(len, consumers)) <= 1


def test_max_rows_reads_the_first_rows_of_the_sequence(three_files):
    expected = [f"a{i}" for i in range(1000)] + [f"b{i}" for i in range(50)]
    shares = [[r["prompt"] for r in ParquetStream(three_files, shuffle=False, drop_remainder=False, max_rows=1050,
                                                  rank=rank, world_size=3)] for rank in range(3)]
    assert [row for share in shares for row in share] == expected
    assert [len(share) for share in shares] == [350, 350, 350]
    # Shuffled, the first rows of the epoch's sequence (one lane and a buffer of 1 row leave it as it is).
    prefix = [r["prompt"] for r in ParquetStream(three_files, seed=4, max_rows=100, buffer_size=1, mix_row_groups=1)]
    assert prefix == [r["prompt"] for r in ParquetStream(three_files, seed=4, buffer_size=1, mix_row_groups=1)][:100]
