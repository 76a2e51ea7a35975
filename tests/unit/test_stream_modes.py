"""Ultra-low-mem mode, the memory budget, the large-row-group warning and the repack tool."""

from __future__ import annotations

import logging

import pyarrow.parquet as pq
import pytest
from conftest import write_rows

import lowmem.data.reader as reader_module
from lowmem.data import ParquetStream
from lowmem.data.repack import repack
from lowmem.errors import DataError
from lowmem.memory import MemoryBudget, read_cgroup_limit_bytes
from lowmem.memory.budget import GIB
from lowmem.program import command_line


class CountingParquetFile(pq.ParquetFile):
    opened: list[dict] = []

    def __init__(self, source, **kwargs):
        CountingParquetFile.opened.append(kwargs)
        super().__init__(source, **kwargs)


@pytest.fixture
def counted(monkeypatch):
    CountingParquetFile.opened = []
    releases = []
    monkeypatch.setattr(reader_module.pq, "ParquetFile", CountingParquetFile)
    monkeypatch.setattr(reader_module, "release_arrow_memory", lambda: releases.append(1))
    return CountingParquetFile.opened, releases


def test_ultra_low_mem_reopens_with_cached_footer_and_releases_the_pool(tmp_path, counted):
    opened, releases = counted
    path = write_rows(tmp_path / "a.parquet", [str(i) for i in range(1000)], 100)
    stream = ParquetStream(path, ultra_low_mem=True, buffer_size=100, shuffle=False)
    assert len(list(stream)) == 1000
    assert len(opened) == 10  # one open per row group
    assert all(kwargs["metadata"] is stream.index.metadata[0] for kwargs in opened)
    assert all(kwargs["pre_buffer"] is False for kwargs in opened)
    assert len(releases) == 10  # the pool is released after every row group


def test_normal_mode_keeps_one_handle_per_file(tmp_path, counted):
    opened, releases = counted
    files = [write_rows(tmp_path / f"{n}.parquet", [f"{n}{i}" for i in range(500)], 50) for n in "ab"]
    stream = ParquetStream(files, ultra_low_mem=False, buffer_size=64)
    assert len(list(stream)) == 1000
    assert len(opened) == 2
    assert releases == []


def test_auto_mode_follows_the_budget(tmp_path, monkeypatch):
    path = write_rows(tmp_path / "a.parquet", ["a"], 1)
    monkeypatch.setattr(MemoryBudget, "detect", classmethod(lambda cls, local_processes=1: cls(12 * GIB)))
    assert ParquetStream(path).ultra_low_mem is True
    assert ParquetStream(path, ultra_low_mem_threshold_gb=8).ultra_low_mem is False
    assert ParquetStream(path, ultra_low_mem=False).ultra_low_mem is False
    monkeypatch.setattr(MemoryBudget, "detect", classmethod(lambda cls, local_processes=1: cls(64 * GIB)))
    assert ParquetStream(path).ultra_low_mem is False
    assert ParquetStream(path, ultra_low_mem=True).ultra_low_mem is True


def test_cgroup_limit_is_read_for_v2_and_v1(tmp_path):
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    v2.write_text("8589934592\n")
    assert read_cgroup_limit_bytes(v2, v1) == 8 * GIB
    v2.write_text("max\n")
    assert read_cgroup_limit_bytes(v2, v1) is None
    v2.unlink()
    v1.write_text(str(4 * GIB))
    assert read_cgroup_limit_bytes(v2, v1) == 4 * GIB
    v1.write_text("9223372036854771712")  # v1's "no limit"
    assert read_cgroup_limit_bytes(v2, v1) is None
    v1.unlink()
    assert read_cgroup_limit_bytes(v2, v1) is None


def test_budget_is_the_smaller_of_ram_and_cgroup(monkeypatch):
    import lowmem.memory.budget as budget

    monkeypatch.setattr(budget, "read_cgroup_limit_bytes", lambda: 3 * GIB)
    assert budget.memory_budget_bytes() == min(3 * GIB, budget.psutil.virtual_memory().total)
    monkeypatch.setattr(budget, "read_cgroup_limit_bytes", lambda: None)
    assert budget.memory_budget_bytes() == budget.psutil.virtual_memory().total


def test_large_row_groups_warn_once_per_file_with_the_repack_command(tmp_path, caplog):
    big = [write_rows(tmp_path / f"big{n}.parquet", [f"{n}{i}" * 10 for i in range(6000)], 3000) for n in "ab"]
    small = write_rows(tmp_path / "small.parquet", [f"s{i}" for i in range(100)], 10)
    with caplog.at_level(logging.WARNING, logger="lowmem.data.sources"):
        stream = ParquetStream(big + [small], large_row_group_bytes=20_000)
        list(stream)
    warnings = [r.getMessage() for r in caplog.records if "repack" in r.getMessage()]
    assert len(warnings) == 2
    for path, message in zip(big, warnings):
        assert command_line(f"repack {path} ") in message  # the command as this process was started
        # 16 row groups are read at once: each must fit in 20,000 / 16 bytes, so the smallest repack size.
        assert "--row_group_rows=1000" in message
    with caplog.at_level(logging.WARNING, logger="lowmem.data.sources"):
        caplog.clear()
        ParquetStream(big, large_row_group_bytes=400_000, mix_row_groups=1)  # one group at once: fits
    assert not [r for r in caplog.records if "repack" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="lowmem.data.sources"):
        caplog.clear()
        ParquetStream(big, large_row_group_bytes=20_000, rank=1, world_size=2)
    assert not [r for r in caplog.records if "repack" in r.getMessage()], "only rank 0 warns"


def test_repack_keeps_every_row_and_its_order(tmp_path):
    ids = [f"id{i}" for i in range(25_000)]
    source = write_rows(tmp_path / "in.parquet", ids, 25_000, extra=list(range(25_000)))
    target = tmp_path / "out.parquet"
    [result] = repack(source, target, row_group_rows=1000)
    assert result.rows == 25_000 and result.row_groups_before == 1 and result.row_groups_after == 25
    metadata = pq.read_metadata(target)
    assert {metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)} == {1000}
    assert pq.read_table(target).equals(pq.read_table(source))  # every column, every row, same order
    assert not (tmp_path / "out.parquet.partial").exists()


def test_repack_many_files_into_a_directory(tmp_path):
    (tmp_path / "in").mkdir()
    for n in "ab":
        write_rows(tmp_path / "in" / f"{n}.parquet", [f"{n}{i}" for i in range(3000)], 3000)
    results = repack(tmp_path / "in", tmp_path / "out", row_group_rows=700)
    assert [r.target.rsplit("/", 1)[-1] for r in results] == ["a.parquet", "b.parquet"]
    for n in "ab":
        assert pq.read_table(tmp_path / "out" / f"{n}.parquet").equals(pq.read_table(tmp_path / "in" / f"{n}.parquet"))
        assert pq.read_metadata(tmp_path / "out" / f"{n}.parquet").num_row_groups == 5


def test_repack_refuses_to_overwrite_its_input(tmp_path):
    source = write_rows(tmp_path / "in.parquet", ["a", "b"], 2)
    with pytest.raises(DataError, match="input itself"):
        repack(source, source)
    assert pq.read_table(source).num_rows == 2


@pytest.mark.parametrize("budget_gb, processes, on_gpu, expected", [
    (12, 3, True, (True, 1, False)),  # the reference host: 4 GiB per GPU process, one worker each
    (4, 3, True, (True, 0, False)),  # 1.3 GiB each: no room for a worker's copy of the pipeline
    (64, 3, True, (False, 2, True)),
    (12, 3, False, (True, 0, False)),  # the CPU: workers would take cores from the step
    (64, 1, False, (False, 0, False)),
])
def test_workers_and_modes_follow_the_budget(budget_gb, processes, on_gpu, expected):
    from lowmem.memory.data_settings import decide_memory_settings

    settings = decide_memory_settings(None, -1, 15.0, local_processes=processes, on_gpu=on_gpu, budget_gb=budget_gb)
    assert (settings.ultra_low_mem, settings.num_workers, settings.pin_memory) == expected
    kept = decide_memory_settings(False, 3, 15.0, local_processes=processes, on_gpu=on_gpu, budget_gb=budget_gb)
    assert (kept.ultra_low_mem, kept.num_workers) == (False, 3)  # explicit values are kept
