"""Weighted mixtures of training sources: every batch follows the weights, each source has epochs of its own and is
read once per source epoch, and a saved position resumes exactly, also on another number of readers."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lowmem.config import TrainConfig
from lowmem.config.sources import read_config_file
from lowmem.config.train_sources import Source, parse_sources, sources_text
from lowmem.config.validation import validate_config
from lowmem.data import ParquetStream, StreamLoader
from lowmem.data.elastic import merge_rank_states
from lowmem.data.mixture import MixedStream, smooth_round_robin
from lowmem.errors import ConfigError, DataError

BIG, SMALL = 3000, 400  # rows of the two sources: at 0.7/0.3 an epoch (3,400 rows) reads 2,380 of the big one
BATCH = 32


def _write(folder: Path, name: str, rows: int, row_group_rows: int) -> str:
    path = folder / f"{name}.parquet"
    pq.write_table(pa.table({"prompt": [f"{name}{i}" for i in range(rows)], "response": ["r"] * rows}), path,
                   row_group_size=row_group_rows)
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Source]:
    folder = tmp_path_factory.mktemp("mixture")
    return [Source(_write(folder, "a", BIG, 100), 0.7), Source(_write(folder, "b", SMALL, 50), 0.3)]


def _stream(sources, rank: int = 0, world_size: int = 1, **settings) -> MixedStream:
    return MixedStream(sources, buffer_size=200, mix_row_groups=4, seed=3, rank=rank, world_size=world_size,
                       ultra_low_mem=False, large_row_group_bytes=10**9, **settings)


def _rows(batches) -> list[str]:
    return [row["prompt"] for batch in batches for row in batch]


def _read(loader: StreamLoader, batches: int) -> list[list[dict]]:
    iterator = iter(loader)
    return [next(iterator) for _ in range(batches)]


def _through_json(state: dict) -> dict:
    return json.loads(json.dumps(state))


def test_smooth_round_robin_keeps_every_source_within_a_row_of_its_share():
    weights = [0.5, 0.3, 0.2]
    choices = smooth_round_robin(weights, [0, 0, 0], 1000)
    counts = [0, 0, 0]
    for n, source in enumerate(choices, start=1):
        counts[source] += 1
        assert all(abs(counts[i] - weights[i] * n) < 1 for i in range(3)), n
    # From counts part-way, the same rule goes on as if it had never stopped.
    assert smooth_round_robin(weights, [5, 3, 2], 90) == choices[10:100]


def test_every_batch_follows_the_weights_and_each_source_epoch_reads_each_row_once(sources):
    loader = StreamLoader(_stream(sources), BATCH)
    batches = list(loader)
    rows = _rows(batches)
    assert len(loader) == len(batches) and len(rows) == BIG + SMALL  # an epoch: every source's rows together
    for batch in batches[:-1]:
        from_big = sum(row["prompt"].startswith("a") for row in batch)
        assert abs(from_big - 0.7 * BATCH) < 1, from_big
    big = [row for row in rows if row.startswith("a")]
    small = [row for row in rows if row.startswith("b")]
    assert len(big) == round(0.7 * len(rows)) and len(set(big)) == len(big)  # not used up: no row twice
    # The small source is repeated: each of its epochs is every one of its rows once, in a new order.
    epochs = [small[start:start + SMALL] for start in range(0, len(small), SMALL)]
    assert len(epochs) == 3
    for epoch in epochs[:2]:
        assert sorted(epoch) == sorted(f"b{i}" for i in range(SMALL))
    assert epochs[0] != epochs[1]
    assert len(set(epochs[2])) == len(epochs[2])


def test_the_next_epoch_goes_on_where_each_source_stopped(sources):
    loader = StreamLoader(_stream(sources), BATCH)
    first = [row for row in _rows(loader) if row.startswith("a")]
    loader.set_epoch(1)
    second = [row for row in _rows(loader) if row.startswith("a")]
    rest_of_first_epoch = BIG - len(first)
    assert set(first).isdisjoint(second[:rest_of_first_epoch])
    assert set(first) | set(second[:rest_of_first_epoch]) == {f"a{i}" for i in range(BIG)}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_saved_position_continues_row_for_row_into_the_next_epoch(sources, workers):
    reference = StreamLoader(_stream(sources), BATCH, num_workers=workers)
    expected = _rows(reference)
    reference.set_epoch(1)
    expected_next = _rows(reference)

    loader = StreamLoader(_stream(sources), BATCH, num_workers=workers)
    before = _read(loader, 41)  # past the small source's first epoch (its 400 rows go in about 42 batches)
    state = _through_json(loader.state_dict())
    resumed = StreamLoader(_stream(sources), BATCH, num_workers=workers)
    resumed.load_state_dict(state)
    assert _rows(before) + _rows(resumed) == expected
    resumed.set_epoch(1)
    assert _rows(resumed) == expected_next


@pytest.mark.parametrize(("old_workers", "new_workers"), [(0, 0), (2, 0), (1, 2)])
def test_three_readers_resumed_on_two_processes_read_every_remaining_row_of_every_source_once(sources, old_workers,
                                                                                             new_workers):
    before, states = [], []
    for rank in range(3):
        loader = StreamLoader(_stream(sources, rank, 3), BATCH, num_workers=old_workers)
        before += _rows(_read(loader, 17))  # the small source's readers are in its second epoch by now
        states.append(_through_json(loader.state_dict()))
    merged = merge_rank_states(states)
    after = []
    for rank in range(2):
        loader = StreamLoader(_stream(sources, rank, 2), BATCH, num_workers=new_workers)
        loader.load_state_dict(merged)
        after += _rows(loader)
    seen = before + after
    readers = 3 * max(1, old_workers) + 2 * max(1, new_workers)  # each layout may leave a row per reader out
    assert BIG + SMALL - readers <= len(seen) <= BIG + SMALL
    big = collections.Counter(row for row in seen if row.startswith("a"))
    assert max(big.values()) == 1, "a row of the big source was read twice"
    small = collections.Counter(row for row in seen if row.startswith("b"))
    # Two whole epochs of the small source, and some of a third: every row 2 or 3 times, but for the few rows
    # that equal shares leave out of an epoch.
    assert set(small.values()) <= {1, 2, 3} and sum(count == 1 for count in small.values()) <= readers
    assert len(small) == SMALL


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory) -> list[Source]:
    """A big source and one of 40 rows: at half the rows, each reader's 16 rows of it per batch of 32 cross its
    epochs (10 rows per reader with 4 readers), so readers saved one batch apart are in different epochs of it."""
    folder = tmp_path_factory.mktemp("tiny")
    return [Source(_write(folder, "a", BIG, 100), 0.5), Source(_write(folder, "t", 40, 10), 0.5)]


def test_a_reader_that_takes_over_readers_in_several_epochs_of_a_source_saves_all_of_them(tiny_sources):
    states = []
    for rank in range(2):
        loader = StreamLoader(_stream(tiny_sources, rank, 2), BATCH, num_workers=2)
        _read(loader, 7)  # worker 0 has handed over 4 batches, worker 1 3: they are epochs of the tiny source apart
        states.append(_through_json(loader.state_dict()))
    merged = merge_rank_states(states)
    assert len({int(epoch) for state in states for epoch in state["source_states"][1]}) >= 2

    continuous = StreamLoader(_stream(tiny_sources), BATCH)
    continuous.load_state_dict(merged)
    expected = _rows(continuous)

    taking_over = StreamLoader(_stream(tiny_sources), BATCH)
    taking_over.load_state_dict(merged)
    first = _read(taking_over, 1)  # still in the earliest epoch the old readers were in
    resumed = StreamLoader(_stream(tiny_sources), BATCH)
    resumed.load_state_dict(_through_json(taking_over.state_dict()))
    assert _rows(first) + _rows(resumed) == expected


def test_another_window_with_as_many_readers_shares_the_rest_out_each_row_once(sources):
    loader = StreamLoader(_stream(sources), BATCH)
    before = _rows(_read(loader, 30))
    state = merge_rank_states([_through_json(loader.state_dict())])
    other = StreamLoader(MixedStream(sources, buffer_size=300, mix_row_groups=4, seed=3, ultra_low_mem=False,
                                     large_row_group_bytes=10**9), BATCH)
    other.load_state_dict(state)
    assert not other.stream.continues_exactly
    seen = before + _rows(other)
    big = collections.Counter(row for row in seen if row.startswith("a"))
    assert len(seen) == BIG + SMALL and max(big.values()) == 1


def test_a_source_with_fewer_rows_than_readers_is_named(tmp_path, sources):
    few = [sources[0], Source(_write(tmp_path, "few", 2, 2), 0.5)]
    loader = StreamLoader(_stream(few, 0, 3), BATCH)
    with pytest.raises(DataError, match="has 2 rows, fewer than the 3 readers"):
        _read(loader, 1)


def test_a_position_of_other_weights_or_of_one_file_is_refused(sources):
    loader = StreamLoader(_stream(sources), BATCH)
    _read(loader, 3)
    state = _through_json(loader.state_dict())
    other = [Source(sources[0].path, 0.5), Source(sources[1].path, 0.5)]
    with pytest.raises(DataError, match="weights were"):
        StreamLoader(_stream(other), BATCH).load_state_dict(state)
    single = StreamLoader(ParquetStream(sources[0].path, buffer_size=50), BATCH)
    _read(single, 2)
    with pytest.raises(DataError, match="not of a mixture"):
        StreamLoader(_stream(sources), BATCH).load_state_dict(_through_json(single.state_dict()))
    with pytest.raises(DataError, match="of a mixture of sources"):
        StreamLoader(ParquetStream(sources[0].path, buffer_size=50), BATCH).load_state_dict(state)


def test_sources_are_parsed_from_text_and_from_a_config_file(tmp_path):
    assert parse_sources("data/a/:0.7, s3://bucket/b.parquet:0.3") == [Source("data/a/", 0.7),
                                                                        Source("s3://bucket/b.parquet", 0.3)]
    for bad, message in (("data/a", "not PATH:WEIGHT"), ("data/a:0", "above 0"), (",", "is empty")):
        with pytest.raises(ConfigError, match=message):
            parse_sources(bad)
    config_file = tmp_path / "mix.yaml"
    config_file.write_text("train_sources:\n  data/a/: 0.7\n  data/b.parquet: 0.3\n")
    assert read_config_file(config_file)["train_sources"] == "data/a/:0.7,data/b.parquet:0.3"
    assert sources_text([{"path": "x", "weight": 1}, "y:2"]) == "x:1,y:2"
    with pytest.raises(ConfigError, match="replaces --train_file"):
        validate_config(TrainConfig(train_sources="a:1", train_file="mine.parquet"))
