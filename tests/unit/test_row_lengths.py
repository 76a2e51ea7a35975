"""The training length of a run from a transformers model is settled from its rows (99% kept whole, within the
model's context), and the rows a length cuts are counted: from the sample at the start and in the log."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_models import qwen2_folder

from lowmem.cli import main
from lowmem.data.lengths import CutRows, cut_rows_line, length_keeping, rows_cut

LONG_SHARE = 0.05


def test_the_length_keeps_99_percent_whole_in_multiples_of_32():
    lengths = [20] * 98 + [70, 300]  # a row of n tokens needs n - 1 inputs
    assert length_keeping(lengths) == 96  # 69 inputs, rounded up: the one row of 300 is the 1% cut
    assert length_keeping(lengths, share=1.0) == 320
    assert length_keeping([]) == 32
    assert rows_cut(lengths, 96) == 1 and rows_cut(lengths, 299) == 0
    assert cut_rows_line(lengths, 299) is None
    line = cut_rows_line(lengths, 64)
    assert line.startswith("2 of 100 sampled training rows (2.0%) are longer than --max_seq_len=64") and \
        "--max_seq_len=96 keeps 99% of them whole" in line


def test_cut_rows_are_said_at_the_first_and_when_the_count_doubles(caplog):
    cut = CutRows(64)
    with caplog.at_level("WARNING"):
        for count in (0, 3, 2, 1, 4, 2, 0):
            cut.add(count)
    said = [record.getMessage() for record in caplog.records]
    assert [line.split(" training rows")[0] for line in said] == ["3", "6", "12"], said


def rows_with_long_ones(path, rows: int, seed: int) -> None:
    """Short prompt/response rows, LONG_SHARE of them with a response of 400 characters."""
    import random

    rng = random.Random(seed)
    long_rows = set(rng.sample(range(rows), int(LONG_SHARE * rows)))
    responses = ["".join(rng.choices("春风明月江南归去相思", k=400 if row in long_rows else 12)) for row in range(rows)]
    pq.write_table(pa.table({"prompt": [f"问{row}" for row in range(rows)], "response": responses}), path)


@pytest.fixture
def long_rows_project(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    for name, seed in (("train", 1), ("valid", 2), ("test", 3)):
        rows_with_long_ones(tmp_path / "data" / f"{name}.parquet", 200, seed)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def qwen_1024(tmp_path_factory):
    return qwen2_folder(tmp_path_factory.mktemp("lengths") / "qwen", max_position_embeddings=1024)


def test_a_run_from_a_transformers_model_takes_the_length_of_its_rows(long_rows_project, qwen_1024, capsys):
    assert main(["train", f"--init_from={qwen_1024}", "--print_config"]) == 0
    captured = capsys.readouterr()
    settled = json.loads(captured.out)["max_seq_len"]
    assert settled % 32 == 0 and 192 < settled <= 1024, settled  # the long rows' length, not the default 192
    assert "are longer than --max_seq_len" not in captured.err  # every sampled row whole

    assert main(["train", f"--init_from={qwen_1024}", "--max_seq_len=2048", "--print_config"]) == 2
    assert "longer than its context (max_position_embeddings), 1,024 tokens" in capsys.readouterr().err


@pytest.fixture
def logging_restored():
    """A run in this process sets up the root logger for training (its handlers replace the others): put it back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_rows_cut_by_a_given_length_are_counted_at_the_start_and_in_the_log(long_rows_project, qwen_1024, capsys,
                                                                             logging_restored):
    assert main(["train", f"--init_from={qwen_1024}", "--max_seq_len=128", "--max_steps=4", "--batch_size_per_gpu=50",
                 "--logging_steps=1", "--eval_bleu_samples=0", "--sample_max_new_tokens=2"]) == 0
    err = capsys.readouterr().err
    assert "10 of 200 sampled training rows (5.0%) are longer than --max_seq_len=128" in err, err[-3000:]
    counted = [line for line in err.splitlines() if "training rows cut at --max_seq_len=128 so far" in line]
    assert counted and counted[-1].split("WARNING")[1].split()[-1] != "0"
    totals = [int(line.split(" training rows")[0].split()[-1].replace(",", "")) for line in counted]
    assert totals[-1] == 10, counted  # 200 rows, each read once: every long row counted once


def test_a_length_from_rows_stops_at_the_cap_and_says_the_length_that_keeps_them(tmp_path, monkeypatch, capsys,
                                                                                  caplog):
    # Every row about 1,500 tokens, on a model of a 4,096-token context: trained at the cap, as TRL's default cuts,
    # with the length that would keep them whole said.
    from lowmem.data.lengths import LENGTH_FROM_ROWS_CAP

    qwen_4096 = qwen2_folder(tmp_path / "qwen", max_position_embeddings=4096)
    (tmp_path / "data").mkdir()
    for name in ("train", "valid", "test"):
        rows = {"prompt": [f"问{row}" for row in range(40)], "response": ["春风明月江南归去相思" * 150] * 40}
        pq.write_table(pa.table(rows), tmp_path / "data" / f"{name}.parquet")
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"--init_from={qwen_4096}", "--print_config"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out[captured.out.index("{\n"):])  # after what an import may print
    assert printed["max_seq_len"] == LENGTH_FROM_ROWS_CAP == 1024
    said = caplog.text  # the start-up's warning
    needed = int(said.split("The training rows need --max_seq_len=")[1].split(" ")[0])
    assert 1024 < needed <= 4096 and f"pass --max_seq_len={needed} to train them whole" in said
