"""Text that is not valid UTF-8 in a string column: refused with a message naming the file, row group, row and
column (the default), or skipped and counted with `bad_text="skip"`, with an exact resume."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
from data_helpers import BAD_TEXT_CELLS as BAD, BAD_TEXT_GROUP_ROWS as GROUP_ROWS, BAD_TEXT_ROWS as ROWS
from data_helpers import EMPTY_PROMPT_ROWS as EMPTY, write_bad_text

from lowmem.data import ParquetStream, StreamLoader
from lowmem.errors import ConfigError, DataError

BUFFER = 250


def good_ids() -> set[str]:
    return {f"x{i}" for i in range(ROWS)} - {f"x{row}" for row, _ in BAD} - {f"x{row}" for row in EMPTY}


@pytest.fixture
def bad_file(tmp_path):
    return write_bad_text(tmp_path / "bad.parquet")


@pytest.mark.parametrize("shuffle", [True, False])
def test_refuse_names_the_file_row_group_row_and_column(bad_file, shuffle):
    stream = ParquetStream(bad_file, buffer_size=BUFFER, shuffle=shuffle, seed=3)
    with pytest.raises(DataError) as error:
        list(stream)
    message = str(error.value)
    assert f"of '{bad_file}' holds text that is not valid UTF-8 in column '" in message
    assert "\n" not in message and "--bad_text=skip" in message and "cast('binary')" in message
    # Whichever bad row the shuffled order meets first, the message names that row where it is in the file.
    named = {(int(row) + GROUP_ROWS * int(group), column) for row, group, column in
             re.findall(r"Row (\d+) of row group (\d+) of .* in column '(\w+)'", message)}
    assert len(named) == 1 and named <= BAD
    if not shuffle:
        assert message.startswith(f"Row 5 of row group 0 of '{bad_file}'") and "column 'prompt'" in message


def test_skip_yields_every_other_row_and_counts_the_skipped(bad_file, caplog):
    stream = ParquetStream(bad_file, buffer_size=BUFFER, seed=3, bad_text="skip")
    with caplog.at_level(logging.WARNING, logger="lowmem.data.stream"):
        rows = [row["prompt"] for row in stream]
    assert len(rows) == len(set(rows)) and set(rows) == good_ids()
    skipped = len({row for row, _ in BAD}) + len(EMPTY)
    assert stream.skipped_rows == skipped == ROWS - len(rows)
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert (f"Skipped {skipped} rows with a null or empty prompt/response value or text that is not valid "
            "UTF-8") in warning
    assert f"({skipped - len(EMPTY)} of them in this reading of the epoch, the first at row" in warning


def test_skip_with_a_dataloader_worker(bad_file):
    loader = StreamLoader(ParquetStream(bad_file, buffer_size=BUFFER, seed=3, bad_text="skip"), batch_size=32,
                          num_workers=1, collate_fn=lambda rows: [row["prompt"] for row in rows])
    rows = [prompt for batch in loader for prompt in batch]
    assert sorted(rows) == sorted(good_ids())
    assert loader.skipped_rows == ROWS - len(rows)


def test_skip_resumes_exactly_at_cuts_around_the_bad_rows(tmp_path, bad_file):
    epoch = 1

    def stream(path=bad_file):
        made = ParquetStream(path, buffer_size=BUFFER, seed=3, bad_text="skip", mix_row_groups=4)
        made.set_epoch(epoch)
        return made

    reference = [row["prompt"] for row in stream()]
    # The same file with valid text in place of the bad bytes has the same order: where the bad rows fall in it.
    clean_order = [row["prompt"] for row in stream(write_bad_text(tmp_path / "clean.parquet", clean=True))]
    gone = {f"x{row}" for row, _ in BAD} | {f"x{row}" for row in EMPTY}
    bad_at = [k for k, prompt in enumerate(clean_order) if prompt in gone]
    assert len(clean_order) == ROWS - len(EMPTY)  # the clean file still has the empty row
    # Cut just before, at and after each bad row (in rows sent), at window edges, and at the ends.
    cuts = {0, 1, BUFFER - 1, BUFFER, BUFFER + 1, len(reference) - 1, len(reference)}
    for k in bad_at:
        sent_before = k - sum(1 for j in bad_at if j < k)
        cuts |= {max(0, sent_before - 1), sent_before, sent_before + 1}
    total_skipped = ROWS - len(reference)
    for cut in sorted(c for c in cuts if c <= len(reference)):
        first = stream()
        rows = iter(first)
        before = [next(rows)["prompt"] for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))
        resumed = ParquetStream(bad_file, buffer_size=BUFFER, seed=3, bad_text="skip", mix_row_groups=4)
        resumed.load_state_dict(state)
        resumed.set_epoch(epoch)
        after = [row["prompt"] for row in resumed]
        assert before + after == reference, cut
        # The count stays exact too: rows skipped before the save are not counted again, nor missed.
        assert resumed.skipped_rows == total_skipped, (cut, state["layers"][-1]["positions"])


def test_a_run_refused_at_bad_text_resumes_with_skip(bad_file):
    clean_prefix = ParquetStream(bad_file, buffer_size=BUFFER, seed=3)
    rows = iter(clean_prefix)
    before = []
    with pytest.raises(DataError):
        for row in rows:
            before.append(row["prompt"])
    state = clean_prefix.state_dict()
    resumed = ParquetStream(bad_file, buffer_size=BUFFER, seed=3, bad_text="skip")
    resumed.load_state_dict(state)
    after = [row["prompt"] for row in resumed]
    assert sorted(before + after) == sorted(good_ids())


def test_the_setting_is_checked(bad_file):
    from lowmem.config import TrainConfig, validate_config

    with pytest.raises(ConfigError, match="bad_text must be 'refuse' or 'skip' \\(it is 'ignore'\\)"):
        ParquetStream(bad_file, bad_text="ignore")
    with pytest.raises(ConfigError, match="--bad_text must be refuse or skip \\(it is 'drop'\\); refuse stops"):
        validate_config(dataclasses.replace(TrainConfig(), bad_text="drop"))


def test_the_tokenizer_refuses_or_skips_bad_text(bad_file, tmp_path):
    from lowmem.tokenization.sentencepiece_tokenizer import train_tokenizer

    options = dict(vocab_size=300, columns=("prompt", "response"), hard_vocab_limit=False)
    with pytest.raises(DataError, match=f"Row 5 of row group 0 of '{bad_file}' holds text that is not valid UTF-8 "
                                        "in column 'prompt'"):
        train_tokenizer([str(bad_file)], tmp_path / "refused", **options)
    assert train_tokenizer([str(bad_file)], tmp_path / "skipped", bad_text="skip", **options).is_file()
