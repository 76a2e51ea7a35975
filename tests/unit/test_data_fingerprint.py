"""The data's content fingerprint: a resume on a file written again with the same rows per row group but other
or reordered rows is refused, naming the file; the same file resumes exactly (the training command's stop
and --allow_config_change=True: tests/integration/test_data_fingerprint_training.py)."""

from __future__ import annotations

import json
import logging
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lowmem.data import ParquetStream, StreamLoader
from lowmem.data.fingerprint import content_fingerprint, read_footer_bytes
from lowmem.data.sources import build_row_group_index
from lowmem.data.storage import DataFile
from lowmem.errors import DataError

GROUP_ROWS = 100
ROWS = 1000
BUFFER = 250
CUT = 333  # rows read before the save: mid-window, mid-epoch
EPOCH = 1


def write_ids(path, ids: list[str], **options):
    pq.write_table(pa.table({"prompt": ids, "response": [f"r:{i}" for i in ids]}), path, row_group_size=GROUP_ROWS,
                   **options)
    return path


def original_ids() -> list[str]:
    return [f"x{i}" for i in range(ROWS)]


def shuffled_across_groups(ids: list[str]) -> list[str]:
    return random.Random(1).sample(ids, len(ids))


def shuffled_within_groups(ids: list[str]) -> list[str]:
    out = []
    for start in range(0, len(ids), GROUP_ROWS):
        group = ids[start:start + GROUP_ROWS]
        shuffled = random.Random(start).sample(group, len(group))
        assert shuffled[0] != group[0] or shuffled[-1] != group[-1]
        out += shuffled
    return out


def other_text(ids: list[str]) -> list[str]:
    return [f"y{i}" for i in range(len(ids))]  # the same lengths, so the same counts, other values


@pytest.fixture
def files(tmp_path):
    return [write_ids(tmp_path / "x.parquet", original_ids()),
            write_ids(tmp_path / "y.parquet", [f"y-{i}" for i in range(555)])]


def make_stream(files, **kwargs) -> ParquetStream:
    stream = ParquetStream(files, buffer_size=BUFFER, seed=11, **kwargs)
    stream.set_epoch(EPOCH)
    return stream


def saved_mid_epoch(files) -> tuple[dict, list[str]]:
    """The position after CUT rows (through JSON, as a checkpoint keeps it), and the rows that followed."""
    stream = make_stream(files)
    rows = iter(stream)
    for _ in range(CUT):
        next(rows)
    state = json.loads(json.dumps(stream.state_dict()))
    return state, [row["prompt"] for row in rows]


@pytest.mark.parametrize("rewrite", [shuffled_across_groups, shuffled_within_groups, other_text])
def test_a_file_written_again_with_the_same_row_counts_is_refused_by_name(files, rewrite):
    state, _ = saved_mid_epoch(files)
    write_ids(files[0], rewrite(original_ids()))
    resumed = make_stream(files)
    assert resumed.index.fingerprint == state["data"]  # names and row counts alone do not tell
    with pytest.raises(DataError) as error:
        resumed.load_state_dict(state)
    message = str(error.value)
    assert f"The content of '{files[0]}' changed since this data position was saved" in message
    assert str(files[1]) not in message and "\n" not in message
    assert "Resume with the data files the run was trained on, or pass --allow_config_change=True" in message


@pytest.mark.parametrize("how", ["untouched", "written again"])
def test_the_same_file_resumes_exactly(files, how):
    state, rest = saved_mid_epoch(files)
    if how == "written again":
        before = files[0].read_bytes()
        write_ids(files[0], original_ids())
        assert files[0].read_bytes() == before
    resumed = make_stream(files)
    resumed.load_state_dict(state)
    assert [row["prompt"] for row in resumed] == rest


def test_sampled_rows_catch_what_the_footer_cannot_and_the_documented_blind_spot(tmp_path):
    # Uncompressed, plain-encoded, no statistics: swapping two values of equal length changes no byte of the
    # footer. Swapping a row group's first row is caught by the sampled rows; swapping two rows in its middle is
    # the blind spot the module's docstring names.
    plain = dict(compression="none", use_dictionary=False, write_statistics=False)
    ids = [f"x{i:04d}" for i in range(ROWS)]
    path = write_ids(tmp_path / "plain.parquet", ids, **plain)
    footer = read_footer_bytes(DataFile(str(path), str(path)))
    before = content_fingerprint(build_row_group_index(path, ("prompt", "response")))

    def fingerprint_after_swapping(i: int, j: int):
        swapped = list(ids)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        write_ids(path, swapped, **plain)
        assert read_footer_bytes(DataFile(str(path), str(path))) == footer
        return content_fingerprint(build_row_group_index(path, ("prompt", "response")))

    assert fingerprint_after_swapping(0, 1) != before  # the first row of row group 0, which is sampled
    assert fingerprint_after_swapping(40, 50) == before  # the middle of a row group: not noticed


def test_a_position_saved_before_content_fingerprints_is_not_checked(files):
    state, _ = saved_mid_epoch(files)
    del state["data_content"]
    write_ids(files[0], other_text(original_ids()))
    make_stream(files).load_state_dict(state)  # an old checkpoint still loads


def test_allowed_change_continues_from_the_saved_position_with_a_warning(files, caplog):
    state, _ = saved_mid_epoch(files)
    write_ids(files[0], other_text(original_ids()))
    resumed = make_stream(files, allow_changed_content=True)
    with caplog.at_level(logging.WARNING, logger="lowmem.data.stream"):
        resumed.load_state_dict(state)
    assert f"The content of '{files[0]}' changed" in caplog.text and "Continuing from the saved position" in caplog.text
    # The position means the same places in the new file: the rows the new file gives after CUT rows.
    new_epoch = [row["prompt"] for row in make_stream(files)]
    assert [row["prompt"] for row in resumed] == new_epoch[CUT:]


def test_computed_once_and_saved_by_a_loader_with_workers(files, monkeypatch):
    import lowmem.data.stream as stream_module

    calls = []
    real = stream_module.content_fingerprint
    monkeypatch.setattr(stream_module, "content_fingerprint", lambda index: calls.append(1) or real(index))
    loader = StreamLoader(make_stream(files), batch_size=32, num_workers=2)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
        state = json.loads(json.dumps(loader.state_dict()))
    assert len(calls) == 1 and state["data_content"]["files"] == real(loader.stream.index)["files"]

    write_ids(files[0], shuffled_within_groups(original_ids()))
    again = StreamLoader(make_stream(files), batch_size=32, num_workers=2)
    with pytest.raises(DataError, match="The content of '.*x.parquet' changed"):
        again.load_state_dict(state)
