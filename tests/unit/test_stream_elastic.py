"""Mixing and elastic resume: batches draw from many row groups, and a position saved by N readers continues
in M readers with every remaining row exactly once."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import write_rows

from lowmem.bench.mixing_bench import groups_per_batch, uniform_groups_per_batch
from lowmem.data import ParquetStream, StreamLoader
from lowmem.data.elastic import merge_rank_states

BUFFER = 64
SPECS = [("a", 1000, 100), ("b", 777, 64), ("c", 450, 200)]  # b and c end with a short row group
TOTAL = sum(rows for _, rows, _ in SPECS)


@pytest.fixture
def files(tmp_path):
    return [write_rows(tmp_path / f"{name}.parquet", [f"{name}{i}" for i in range(rows)], group)
            for name, rows, group in SPECS]


def make(files, rank=0, world_size=1, lanes=4, **kwargs):
    return ParquetStream(files, buffer_size=BUFFER, seed=3, rank=rank, world_size=world_size, mix_row_groups=lanes,
                         **kwargs)


def read_then_save(files, readers: int, cuts: list[int], lanes: int) -> tuple[list[str], dict]:
    """Each of `readers` ranks reads `cuts[rank]` rows and saves; the rows read and the merged state."""
    rows, states = [], []
    for rank in range(readers):
        stream = make(files, rank, readers, lanes)
        iterator = iter(stream)
        rows += [next(iterator)["prompt"] for _ in range(cuts[rank])]
        states.append(json.loads(json.dumps(stream.state_dict())))
    return rows, merge_rank_states(states)


def resume_all(files, readers: int, state: dict, lanes: int) -> tuple[list[list[str]], list[ParquetStream]]:
    streams = [make(files, rank, readers, lanes) for rank in range(readers)]
    shares = []
    for stream in streams:
        stream.load_state_dict(state)
        shares.append([row["prompt"] for row in stream])
    return shares, streams


def cut_points(files, readers: int, lanes: int) -> dict[str, list[int]]:
    share = TOTAL // readers
    # Where the first reader's sequence passes from its first row group to the next, with one lane.
    first_piece = make(files, 0, readers, 1).layers().current_layout.consumer_order(0).lanes[0].pieces(0, share)[0]
    return {
        "first fill": [min(5 + rank, share) for rank in range(readers)],
        "mid-window": [BUFFER + BUFFER // 2 + rank for rank in range(readers)],
        "row-group boundary": [first_piece.rows] * readers,
        "near the end": [share - 3 + rank % 3 for rank in range(readers)],
    }


def check_exactly_once(before: list[str], shares: list[list[str]], old: int, new: int) -> None:
    every_row = {f"{name}{i}" for name, rows, _ in SPECS for i in range(rows)}
    seen = before + [row for share in shares for row in share]
    assert len(set(seen)) == len(seen), "a row was read twice"
    assert set(seen) <= every_row
    assert TOTAL - len(seen) < old + new, TOTAL - len(seen)
    assert len({len(share) for share in shares}) == 1, [len(share) for share in shares]  # equal shares


@pytest.mark.parametrize("old,new", [(3, 2), (3, 4), (2, 5), (1, 3)])
@pytest.mark.parametrize("lanes", [1, 4])
def test_a_position_of_n_readers_continues_in_m_readers_exactly_once(files, old, new, lanes):
    for name, cuts in cut_points(files, old, lanes).items():
        before, state = read_then_save(files, old, cuts, lanes)
        shares, streams = resume_all(files, new, state, lanes)
        check_exactly_once(before, shares, old, new)
        # The next epoch is a whole epoch for the new number of readers.
        for rank, stream in enumerate(streams):
            stream.set_epoch(1)
            fresh = make(files, rank, new, lanes)
            fresh.set_epoch(1)
            assert [r["prompt"] for r in stream] == [r["prompt"] for r in fresh], name


def test_a_change_of_lanes_or_window_is_shared_out_the_same_way(files):
    before, state = read_then_save(files, 2, [100, 150], lanes=4)
    streams = [ParquetStream(files, buffer_size=17, seed=3, rank=rank, world_size=2, mix_row_groups=2)
               for rank in range(2)]
    shares = []
    for stream in streams:
        stream.load_state_dict(state)
        shares.append([row["prompt"] for row in stream])
    check_exactly_once(before, shares, 2, 2)


def test_two_changes_in_one_epoch_and_an_exact_resume_between_them(files):
    before, state = read_then_save(files, 3, [200, 180, 190], lanes=4)
    # 3 → 2: both new readers read some rows, then save.
    middle, middle_states, uninterrupted = [], [], []
    for rank in range(2):
        stream = make(files, rank, 2)
        stream.load_state_dict(state)
        rows = iter(stream)
        middle += [next(rows)["prompt"] for _ in range(150)]
        middle_states.append(json.loads(json.dumps(stream.state_dict())))
        # The same two readers resumed from that save continue row for row.
        again = make(files, rank, 2)
        again.load_state_dict(middle_states[-1])
        uninterrupted.append(([row["prompt"] for row in rows], [row["prompt"] for row in again]))
    for rest, resumed in uninterrupted:
        assert resumed == rest
    # 2 → 4.
    merged = merge_rank_states(middle_states)
    assert len(merged["layers"]) == 2 and len(json.dumps(merged)) < 4096  # positions, not rows
    shares, _ = resume_all(files, 4, merged, lanes=4)
    every_row = {f"{name}{i}" for name, rows, _ in SPECS for i in range(rows)}
    seen = before + middle + [row for share in shares for row in share]
    assert len(set(seen)) == len(seen) and set(seen) <= every_row
    assert TOTAL - len(seen) < 3 + 2 + 4


def _prompts(rows):
    return [row["prompt"] for row in rows]


@pytest.mark.parametrize("old_workers,new_workers", [(2, 0), (0, 2)])
def test_loader_workers_change(files, old_workers, new_workers):
    def loader(rank, workers):
        return StreamLoader(make(files, rank, 2), batch_size=8, collate_fn=_prompts, num_workers=workers)

    before, states = [], []
    for rank in range(2):
        first = loader(rank, old_workers)
        batches = iter(first)
        before += [row for _ in range(9 + rank) for row in next(batches)]
        states.append(first.state_dict())
        del batches
    merged = merge_rank_states(states)
    shares = []
    for rank in range(2):
        resumed = loader(rank, new_workers)
        resumed.load_state_dict(merged)
        shares.append([row for batch in resumed for row in batch])
    old, new = 2 * max(1, old_workers), 2 * max(1, new_workers)
    every_row = {f"{name}{i}" for name, rows, _ in SPECS for i in range(rows)}
    seen = before + [row for share in shares for row in share]
    assert len(set(seen)) == len(seen) and set(seen) <= every_row
    assert TOTAL - len(seen) < old + new


def _without_processes(state: dict) -> dict:
    """`state` as saved before layouts recorded their processes."""
    old = json.loads(json.dumps(state))
    for layer in old["layers"]:
        layer.pop("processes", None)
    return old


@pytest.mark.parametrize("saved_before_processes", [False, True])
def test_another_split_of_as_many_readers_is_a_new_layer_and_len_counts_the_rest(files, saved_before_processes):
    # 2 processes × 1 reader → 1 process × 2 DataLoader workers: as many consumers, but the one process now
    # reads both shares, so its length (and the trainer's steps) must count the rows left, not the old shares.
    before, states = [], []
    for rank in range(2):
        first = StreamLoader(make(files, rank, 2), batch_size=8, collate_fn=_prompts)
        batches = iter(first)
        before += [row for _ in range(30 + 3 * rank) for row in next(batches)]
        states.append(json.loads(json.dumps(first.state_dict())))
        del batches
    merged = merge_rank_states(states)
    if saved_before_processes:
        merged = _without_processes(merged)
    resumed = StreamLoader(make(files, 0, 1), batch_size=8, collate_fn=_prompts, num_workers=2)
    resumed.load_state_dict(merged)
    rows_left, batches_left = len(resumed.stream), len(resumed)
    batches = list(resumed)
    after = [row for batch in batches for row in batch]
    every_row = {f"{name}{i}" for name, rows, _ in SPECS for i in range(rows)}
    seen = before + after
    assert len(set(seen)) == len(seen) and set(seen) <= every_row
    assert TOTAL - len(seen) < 2 + 2
    # The rest (1,723 rows) is shared out anew: 861 rows for each worker, in 108 batches of 8 (the last short).
    assert (rows_left, batches_left) == (len(after), len(batches)) == ((TOTAL - len(before)) // 2 * 2, 2 * 108)
    assert not resumed.stream.continues_exactly
    layers = resumed.state_dict()["layers"]
    assert [(layer["consumers"], layer.get("processes")) for layer in layers] == [(2, 2), (2, 1)]


def test_a_state_saved_before_layouts_recorded_processes_continues_row_for_row(files):
    reference = [[r["prompt"] for r in make(files, rank, 2)] for rank in range(2)]
    _, state = read_then_save(files, 2, [100, 130], lanes=4)
    shares, streams = resume_all(files, 2, _without_processes(state), lanes=4)
    assert all(stream.continues_exactly for stream in streams)
    assert reference[0][:100] + shares[0] == reference[0] and reference[1][:130] + shares[1] == reference[1]


def test_how_readers_are_split_does_not_change_a_fresh_epoch_order(files):
    # The first layer's order depends on the number of consumers alone, as before layouts knew processes:
    # 1 process × 2 workers hands over the batches of 2 processes × 1 reader, in turns.
    per_rank = [list(StreamLoader(make(files, rank, 2), batch_size=8, collate_fn=_prompts)) for rank in range(2)]
    two_workers = list(StreamLoader(make(files, 0, 1), batch_size=8, collate_fn=_prompts, num_workers=2))
    assert two_workers == [batch for pair in zip(*per_rank) for batch in pair]


def test_same_readers_after_a_merge_continue_row_for_row(files):
    # A merged state (every rank's positions) loaded by the same ranks gives each its own position back.
    reference = [[r["prompt"] for r in make(files, rank, 3)] for rank in range(3)]
    before, state = read_then_save(files, 3, [70, 71, 72], lanes=4)
    shares, _ = resume_all(files, 3, state, lanes=4)
    for rank in range(3):
        assert reference[rank][: 70 + rank] + shares[rank] == reference[rank]


def test_batches_draw_from_many_row_groups_of_a_sorted_file(tmp_path):
    group_rows, groups = 400, 120
    path = write_rows(tmp_path / "sorted.parquet", [str(i) for i in range(group_rows * groups)], group_rows)
    uniform = uniform_groups_per_batch([group_rows] * groups, 32)

    def mixing(**kwargs) -> float:
        stream = ParquetStream(path, buffer_size=256, seed=1, **kwargs)
        return groups_per_batch((int(row["prompt"]) // group_rows for row in stream), 32)

    assert mixing() >= uniform / 2, (mixing(), uniform)
    # One row group at a time, a batch is a stretch of one or two row groups: the measure tells them apart.
    assert mixing(mix_row_groups=1) < 3
    assert np.isclose(groups_per_batch([0] * 32 + list(range(32)), 32), (1 + 32) / 2)
