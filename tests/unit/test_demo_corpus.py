"""Tests for the demo-corpus builder (on a generated fixture) and for the committed demo data set."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lowmem.errors import DataError


def _load_script_module(name: str):
    """A module of scripts/ (build helpers, not part of the package), loaded from its file."""
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


build_demo_corpus = _load_script_module("demo_corpus").build_demo_corpus
SPLITS = ("train", "valid", "test")
REPO_DATA = Path(__file__).resolve().parents[2] / "lowmem" / "demo_data"

# Characters for made-up lines; each generated line uses characters no other line uses, so poems
# never share a line by accident and each poem can be recognised by its last line.
_CHARS = [chr(c) for c in range(0x4E00, 0x4E00 + 6000)]


def _line_maker(seed: int):
    rng = random.Random(seed)
    pool = _CHARS[:]
    rng.shuffle(pool)
    it = iter(pool)

    def make(n: int, stop: str = "。") -> str:
        return "".join(next(it) for _ in range(n)) + stop

    return make


def _make_corpus(root: Path, n_ci: int = 30, n_qu: int = 20) -> dict[str, list[str]]:
    """Write a small corpus in the chinese-poetry layout; return the texts of the good poems by kind."""
    make = _line_maker(0)
    ci_records, qu_records = [], []
    good: dict[str, list[str]] = {"ci": [], "qu": []}
    for i in range(n_ci):
        paragraphs = [make(4, "，") + make(5), make(7), make(4, "，") + make(5), make(7)]
        ci_records.append({"author": f"作者{i % 3}", "paragraphs": paragraphs, "rhythmic": "浣溪沙"})
        good["ci"].append("".join(paragraphs))
    for _ in range(n_qu):
        paragraphs = [make(6, "，") + make(6), make(8, "？") + "。", make(9)]
        qu_records.append(
            {"dynasty": "yuan", "author": "马致远", "paragraphs": paragraphs, "title": "天净沙・秋思"}
        )
        # yuanqu.json's "？。" is written "？" in the built data.
        good["qu"].append("".join(paragraphs).replace("？。", "？"))

    duplicate = dict(ci_records[0])
    broken = [
        {"author": "某", "paragraphs": [], "rhythmic": "浣溪沙"},
        {"author": "某", "paragraphs": ["□□□□□。", "□□□□□。"], "rhythmic": "浣溪沙"},
        {"author": "某", "paragraphs": [make(9) for _ in range(40)], "rhythmic": "浣溪沙"},  # too long
        {"author": "某", "paragraphs": [make(5), "（下缺）"], "rhythmic": "浣溪沙"},
        duplicate,
    ]
    songci, yuanqu = root / "songci", root / "yuanqu"
    songci.mkdir(parents=True)
    yuanqu.mkdir(parents=True)
    half = len(ci_records) // 2
    (songci / "ci.song.0.json").write_text(json.dumps(ci_records[:half], ensure_ascii=False), encoding="utf-8")
    (songci / "ci.song.1000.json").write_text(
        json.dumps(ci_records[half:] + broken, ensure_ascii=False), encoding="utf-8"
    )
    (yuanqu / "yuanqu.json").write_text(json.dumps(qu_records, ensure_ascii=False), encoding="utf-8")
    (root / "LICENSE").write_text("The MIT License (MIT)\n\nCopyright (c) 2016 JackeyGao\n", encoding="utf-8")
    return good


def _read_rows(out_dir: Path) -> dict[str, list[dict]]:
    return {split: pq.read_table(out_dir / f"{split}.parquet").to_pylist() for split in SPLITS}


@pytest.fixture()
def corpus(tmp_path: Path) -> tuple[Path, dict[str, list[str]]]:
    source = tmp_path / "chinese-poetry"
    return source, _make_corpus(source)


def test_builds_three_files_with_string_columns(corpus, tmp_path: Path) -> None:
    source, good = corpus
    summary = build_demo_corpus(source, tmp_path / "out", seed=0, row_group_rows=7)

    for split in SPLITS:
        schema = pq.read_schema(tmp_path / "out" / f"{split}.parquet")
        assert schema.names == ["prompt", "response"]
        assert all(schema.field(name).type == pa.string() for name in schema.names)
    rows = _read_rows(tmp_path / "out")
    assert {split: len(rows[split]) for split in SPLITS} == summary["rows"]
    assert sum(summary["rows"].values()) == len(good["ci"]) + len(good["qu"])
    assert all(summary["rows"][split] > 0 for split in SPLITS)
    assert (tmp_path / "out" / "LICENSE").read_text(encoding="utf-8").startswith("The MIT License")


def test_no_empty_values_and_broken_records_skipped(corpus, tmp_path: Path) -> None:
    source, _ = corpus
    summary = build_demo_corpus(source, tmp_path / "out")
    rows = [row for split_rows in _read_rows(tmp_path / "out").values() for row in split_rows]

    assert all(row["prompt"].strip() and row["response"].strip() for row in rows)
    assert not any("□" in row["prompt"] + row["response"] or "下缺" in row["response"] for row in rows)
    assert summary["skipped"]["ci"] == {
        "duplicate": 1,
        "empty": 1,
        "missing_chars": 1,
        "notes_in_text": 1,
        "too_long": 1,
    }


def test_rows_are_recognisable_tasks(corpus, tmp_path: Path) -> None:
    source, good = corpus
    summary = build_demo_corpus(source, tmp_path / "out")
    rows = [row for split_rows in _read_rows(tmp_path / "out").values() for row in split_rows]
    texts = set(good["ci"]) | set(good["qu"])

    assert set(summary["templates"]) <= {"ci_write", "qu_write", "continue"}
    for row in rows:
        prompt, response = row["prompt"], row["response"]
        if prompt.startswith("续写"):
            first_half = prompt.split("的后半首：", 1)[1]
            assert first_half + response in texts
        else:
            assert prompt.startswith("请以《") and response in texts


def test_no_poem_in_two_splits(corpus, tmp_path: Path) -> None:
    source, good = corpus
    build_demo_corpus(source, tmp_path / "out", seed=3)
    rows = _read_rows(tmp_path / "out")

    for text in good["ci"] + good["qu"]:
        # The last line of a poem is in the response whatever the template.
        last_line = text.rstrip("。").rsplit("。", 1)[-1]
        splits = {split for split in SPLITS for row in rows[split] if last_line in row["response"]}
        assert len(splits) == 1, f"poem found in splits {splits}: {text}"


def test_same_seed_same_files_other_seed_other_order(corpus, tmp_path: Path) -> None:
    source, _ = corpus
    build_demo_corpus(source, tmp_path / "a", seed=1)
    build_demo_corpus(source, tmp_path / "b", seed=1)
    build_demo_corpus(source, tmp_path / "c", seed=2)

    for split in SPLITS:
        name = f"{split}.parquet"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert _read_rows(tmp_path / "a")["train"] != _read_rows(tmp_path / "c")["train"]


def test_row_groups_no_larger_than_asked(corpus, tmp_path: Path) -> None:
    source, _ = corpus
    build_demo_corpus(source, tmp_path / "out", row_group_rows=7)

    for split in SPLITS:
        metadata = pq.ParquetFile(tmp_path / "out" / f"{split}.parquet").metadata
        sizes = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        assert sizes and max(sizes) <= 7
        assert metadata.row_group(0).column(0).compression == "ZSTD"


def test_missing_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no corpus files"):
        build_demo_corpus(tmp_path / "nowhere", tmp_path / "out")


def test_committed_demo_data() -> None:
    for split in SPLITS:
        path = REPO_DATA / f"{split}.parquet"
        assert path.is_file(), f"{path} is missing: run scripts/build_demo_data.py"
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
        assert schema.names == ["prompt", "response"]
        assert all(schema.field(name).type == pa.string() for name in schema.names)
        metadata = parquet.metadata
        assert metadata.num_rows > 0
        assert max(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)) <= 2000
    assert "JackeyGao" in (REPO_DATA / "LICENSE").read_text(encoding="utf-8")
