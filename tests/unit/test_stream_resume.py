"""ParquetStream and StreamLoader: resuming from state_dict() continues the uninterrupted stream exactly."""

from __future__ import annotations

import json

import pytest
from conftest import write_rows

from lowmem.data import ParquetStream, StreamLoader
from lowmem.errors import DataError

BUFFER = 250
GROUP_ROWS = 100


@pytest.fixture
def data(tmp_path):
    files = [
        write_rows(tmp_path / "x.parquet", [f"x{i}" for i in range(2345)], GROUP_ROWS),
        write_rows(tmp_path / "y.parquet", [f"y{i}" for i in range(1111)], 37),
    ]
    return files


def make_stream(files, **kwargs):
    return ParquetStream(files, buffer_size=BUFFER, seed=11, **kwargs)


def epoch_rows(files, epoch: int, **kwargs) -> list[str]:
    stream = make_stream(files, **kwargs)
    stream.set_epoch(epoch)
    return [row["prompt"] for row in stream]


def cut_and_resume(files, epoch: int, cut: int, **kwargs) -> tuple[list[str], list[str], dict, int]:
    """Read `cut` rows, save, resume in a new stream; return (before, after, state, rows decoded after)."""
    stream = make_stream(files, **kwargs)
    stream.set_epoch(epoch)
    rows = iter(stream)
    before = [next(rows)["prompt"] for _ in range(cut)]
    state = json.loads(json.dumps(stream.state_dict()))  # it must survive JSON
    resumed = make_stream(files, **kwargs)
    resumed.load_state_dict(state)
    after = [row["prompt"] for row in resumed]
    return before, after, state, resumed.rows_decoded


def test_resume_at_many_cut_points(data):
    reference = {epoch: epoch_rows(data, epoch) for epoch in (0, 2)}
    n = len(reference[0])
    cuts = [
        (0, 0), (0, 1), (0, 10), (0, BUFFER - 1),  # during the first fill of the buffer
        (0, BUFFER), (0, 2 * BUFFER),  # window boundaries
        (0, GROUP_ROWS), (0, 7 * GROUP_ROWS), (0, 3 * GROUP_ROWS + 50),  # row-group boundaries and mid-group
        (2, 1234), (2, 77),  # another epoch
        (0, n - 1), (0, n),  # the very end of an epoch
    ]
    import random

    rng = random.Random(5)
    cuts += [(rng.choice([0, 2]), rng.randrange(n + 1)) for _ in range(8)]
    for epoch, cut in cuts:
        before, after, state, _ = cut_and_resume(data, epoch, cut)
        assert before + after == reference[epoch], (epoch, cut)
        assert len(json.dumps(state)) < 4096
        assert state["epoch"] == epoch


def test_resume_near_the_end_reads_only_the_last_window(data):
    n = len(epoch_rows(data, 0, mix_row_groups=1))
    _, after, _, decoded = cut_and_resume(data, 0, n - 5, mix_row_groups=1)
    assert len(after) == 5
    # Only the last window's row groups are decoded again: at most one window plus a group at each edge.
    assert decoded <= BUFFER + 2 * GROUP_ROWS
    assert decoded < n / 5


def test_resume_with_lanes_reads_only_the_row_groups_of_one_window(tmp_path):
    files = [write_rows(tmp_path / "big.parquet", [f"z{i}" for i in range(20_000)], GROUP_ROWS)]
    lanes = 16
    n = len(epoch_rows(files, 0, mix_row_groups=lanes))
    for cut in (n - 5, n // 2):
        _, after, _, decoded = cut_and_resume(files, 0, cut, mix_row_groups=lanes)
        assert len(after) == n - cut
        if cut == n - 5:
            # Each lane's part of the last window lies in at most two row groups.
            assert decoded <= 2 * lanes * GROUP_ROWS
            assert decoded < n / 5


def test_resume_with_ranks(data):
    for rank in range(3):
        reference = epoch_rows(data, 1, rank=rank, world_size=3)
        before, after, _, _ = cut_and_resume(data, 1, 400, rank=rank, world_size=3)
        assert before + after == reference


def test_resume_ultra_low_mem_same_as_normal(data):
    normal = epoch_rows(data, 0, ultra_low_mem=False)
    assert epoch_rows(data, 0, ultra_low_mem=True) == normal
    before, after, _, _ = cut_and_resume(data, 0, 999, ultra_low_mem=True)
    assert before + after == normal


def test_state_is_positions_not_rows(data):
    _, _, state, _ = cut_and_resume(data, 0, 300)
    positions = state["layers"][-1]["positions"]
    assert set(positions) == {"0"}
    assert all(isinstance(v, int) for v in positions["0"])
    assert "x" not in json.dumps(state["layers"])


def test_state_from_other_data_or_settings_is_refused(data, tmp_path):
    state = make_stream(data).state_dict()
    with pytest.raises(DataError, match="seed"):
        ParquetStream(data, buffer_size=BUFFER, seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="data files"):
        make_stream(data[:1]).load_state_dict(state)
    # One rank's position of three cannot be shared out among two processes: the others' are needed.
    rank_state = make_stream(data, rank=1, world_size=3).state_dict()
    with pytest.raises(DataError, match="covers 1 of its 3 readers"):
        make_stream(data, rank=0, world_size=2).load_state_dict(rank_state)


def _prompts(rows):
    return [row["prompt"] for row in rows]


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_loader_resume_gives_the_same_batches(data, num_workers):
    def loader():
        return StreamLoader(make_stream(data), batch_size=16, collate_fn=_prompts, num_workers=num_workers)

    reference = list(loader())
    assert len(reference) == len(loader())
    for cut in (0, 1, 3, 50, len(reference) - 1, len(reference)):
        first = loader()
        batches = iter(first)
        before = [next(batches) for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))
        del batches  # stop the workers
        resumed = loader()
        resumed.load_state_dict(state)
        assert before + list(resumed) == reference, cut


def test_loader_resume_in_a_later_epoch_then_next_epoch(data):
    def loader():
        return StreamLoader(make_stream(data), batch_size=10, collate_fn=_prompts, num_workers=2)

    full = loader()
    full.set_epoch(3)
    epoch3 = list(full)
    full.set_epoch(4)
    epoch4 = list(full)

    first = loader()
    first.set_epoch(3)
    batches = iter(first)
    before = [next(batches) for _ in range(21)]
    state = first.state_dict()
    del batches
    resumed = loader()
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # the training loop calls set_epoch for the current epoch: the position survives
    assert before + list(resumed) == epoch3
    resumed.set_epoch(4)
    assert list(resumed) == epoch4


def test_loader_with_another_worker_count_continues_the_epoch_once(data):
    first = StreamLoader(make_stream(data), batch_size=8, collate_fn=_prompts, num_workers=2)
    batches = iter(first)
    before = [row for _ in range(5) for row in next(batches)]
    resumed = StreamLoader(make_stream(data), batch_size=8, collate_fn=_prompts, num_workers=1)
    resumed.load_state_dict(first.state_dict())
    after = [row for batch in resumed for row in batch]
    every_row = {f"x{i}" for i in range(2345)} | {f"y{i}" for i in range(1111)}
    assert len(set(before + after)) == len(before + after)  # no row twice
    assert set(before + after) <= every_row
    assert len(every_row) - len(before + after) < 2 + 1  # fewer than N + M left out
