"""ParquetStream: bad input gives one clear message naming the file; null and empty values are skipped and counted."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import write_rows

from lowmem.data import ParquetStream, StreamLoader
from lowmem.data.sources import resolve_parquet_files
from lowmem.errors import DataError


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(DataError, match="not found") as error:
        ParquetStream(missing)
    assert str(missing) in str(error.value)


def test_directory_without_parquet_files(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="No parquet files found") as error:
        ParquetStream(tmp_path)
    assert str(tmp_path) in str(error.value)


def test_glob_without_matches(tmp_path):
    with pytest.raises(DataError, match="No parquet files match"):
        ParquetStream(str(tmp_path / "*.parquet"))


def test_directory_glob_and_list_are_resolved_in_order(tmp_path):
    for name in ("b", "a", "c"):
        write_rows(tmp_path / f"{name}.parquet", [name], 1)
    (tmp_path / "sub").mkdir()
    write_rows(tmp_path / "sub" / "d.parquet", ["d"], 1)
    as_dir = resolve_parquet_files(tmp_path)
    assert [p.rsplit("/", 1)[-1] for p in as_dir] == ["a.parquet", "b.parquet", "c.parquet", "d.parquet"]
    as_glob = resolve_parquet_files(str(tmp_path / "*.parquet"))
    assert len(as_glob) == 3
    # The same file named twice is read once.
    assert len(resolve_parquet_files([tmp_path / "a.parquet", str(tmp_path / "a.parquet")])) == 1


def test_missing_column_lists_the_columns(tmp_path):
    path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), path)
    with pytest.raises(DataError, match="no column 'prompt'") as error:
        ParquetStream(path)
    message = str(error.value)
    assert str(path) in message and "question, answer" in message


def test_other_column_names_can_be_chosen(tmp_path):
    path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["a1", "a2"]}), path)
    rows = list(ParquetStream(path, columns=("question", "answer"), shuffle=False))
    assert rows == [{"question": "q1", "answer": "a1"}, {"question": "q2", "answer": "a2"}]


def test_non_string_column(tmp_path):
    path = tmp_path / "n.parquet"
    pq.write_table(pa.table({"prompt": [1, 2], "response": ["a", "b"]}), path)
    with pytest.raises(DataError, match="type int64") as error:
        ParquetStream(path)
    assert str(path) in str(error.value)


def test_large_string_and_dictionary_columns_are_text(tmp_path):
    path = tmp_path / "t.parquet"
    table = pa.table({
        "prompt": pa.array(["p1", "p2"], type=pa.large_string()),
        "response": pa.array(["r1", "r2"]).dictionary_encode(),
    })
    pq.write_table(table, path)
    other = write_rows(tmp_path / "u.parquet", ["p3"], 1)
    rows = list(ParquetStream([path, other], shuffle=False))
    assert rows == [{"prompt": "p1", "response": "r1"}, {"prompt": "p2", "response": "r2"},
                    {"prompt": "p3", "response": "r:p3"}]


def test_not_parquet(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text("prompt,response\nhello,world\n")
    with pytest.raises(DataError, match="not a readable parquet file") as error:
        ParquetStream(path)
    assert str(path) in str(error.value)


def test_truncated_file(tmp_path):
    path = write_rows(tmp_path / "cut.parquet", [str(i) for i in range(1000)], 100)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="truncated") as error:
        ParquetStream(path)
    assert str(path) in str(error.value)


def test_damaged_row_group_names_file_and_group(tmp_path):
    path = write_rows(tmp_path / "bad.parquet", [f"row{i}" * 20 for i in range(1000)], 100)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 200] = b"\x00" * 200  # footer intact, one column chunk destroyed
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"row group \d+ of") as error:
        list(ParquetStream(path, shuffle=False))
    assert str(path) in str(error.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.parquet"
    path.write_bytes(b"")
    with pytest.raises(DataError, match="empty") as error:
        ParquetStream(path)
    assert str(path) in str(error.value)


def test_file_with_no_rows(tmp_path):
    path = tmp_path / "norows.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "response": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match="no rows") as error:
        ParquetStream(path)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"buffer_size": 0}, "buffer_size"),
    ({"rank": 3, "world_size": 3}, "rank"),
    ({"columns": "prompt"}, "columns"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    path = write_rows(tmp_path / "a.parquet", ["a"], 1)
    with pytest.raises(DataError, match=match):
        ParquetStream(path, **kwargs)


def test_null_and_empty_values_are_skipped_and_counted(tmp_path, caplog):
    prompts = [f"p{i}" for i in range(500)]
    responses = [f"r{i}" for i in range(500)]
    for i in range(0, 500, 25):
        prompts[i] = None
    for i in range(3, 500, 50):
        responses[i] = ""
    path = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"prompt": prompts, "response": responses}), path, row_group_size=60)
    bad = sum(1 for p, r in zip(prompts, responses) if not p or not r)
    assert bad == 30

    stream = ParquetStream(path, buffer_size=70)
    with caplog.at_level(logging.WARNING, logger="lowmem.data.stream"):
        rows = list(stream)
    assert len(rows) == 500 - bad
    assert all(row["prompt"] and row["response"] for row in rows)
    assert stream.skipped_rows == bad
    skip_logs = [r for r in caplog.records if "Skipped" in r.getMessage()]
    assert len(skip_logs) == 1 and "30 rows" in skip_logs[0].getMessage()

    # The count survives a resume, and the loader reports it too.
    loader = StreamLoader(ParquetStream(path, buffer_size=70), batch_size=9, num_workers=2)
    delivered = sum(len(batch) for batch in loader)
    assert delivered == 500 - bad
    assert loader.skipped_rows == bad
