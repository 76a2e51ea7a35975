"""Atomic files and folders: readers see the old version or the whole new one, and failures leave no trace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lowmem.atomic_files import (file_built_aside, folder_built_aside, replace_folder, replaced_folder,
                                 write_bytes_atomic, write_json_atomic, write_text_atomic)


def test_small_files_are_replaced_whole(tmp_path: Path) -> None:
    write_bytes_atomic(tmp_path / "a.bin", b"old")
    write_bytes_atomic(tmp_path / "a.bin", b"new")
    write_text_atomic(tmp_path / "b.txt", "中文\n")
    write_json_atomic(tmp_path / "c.json", {"name": "中文"})
    assert (tmp_path / "a.bin").read_bytes() == b"new"
    assert (tmp_path / "b.txt").read_bytes() == "中文\n".encode("utf-8")
    assert (tmp_path / "c.json").read_text(encoding="utf-8") == '{\n  "name": "中文"\n}\n'
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.txt", "c.json"]  # no temporary file left


def test_json_that_cannot_be_serialised_changes_nothing(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / "x.json", {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "x.json", {"a": object()})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["x.json"]


def test_file_built_aside_appears_only_when_complete(tmp_path: Path) -> None:
    target = tmp_path / "out.parquet"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with file_built_aside(target) as partial:
            assert partial == tmp_path / "out.parquet.partial"
            partial.write_bytes(b"half")
            raise RuntimeError("interrupted")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.parquet"]
    with file_built_aside(target) as partial:
        partial.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # not before the block ends
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.parquet"]


def test_folder_built_aside_replaces_the_old_folder_or_leaves_it(tmp_path: Path) -> None:
    final = tmp_path / "best"
    with folder_built_aside(final) as folder:
        (folder / "weights").write_bytes(b"1")
        assert not final.exists()
    assert (final / "weights").read_bytes() == b"1"
    with pytest.raises(RuntimeError):
        with folder_built_aside(final) as folder:
            (folder / "weights").write_bytes(b"2")
            raise RuntimeError("interrupted")
    assert (final / "weights").read_bytes() == b"1" and os.listdir(tmp_path) == ["best"]
    (tmp_path / "best.partial").mkdir()  # left by a build that was killed
    with folder_built_aside(final) as folder:
        assert list(folder.iterdir()) == []
        (folder / "weights").write_bytes(b"3")
    assert (final / "weights").read_bytes() == b"3" and os.listdir(tmp_path) == ["best"]


def _folder(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "f").write_text(content)
    return path


def test_replace_folder_moves_the_old_one_aside_until_the_new_one_is_in_place(tmp_path: Path, monkeypatch) -> None:
    final = _folder(tmp_path / "checkpoint-5", "old")
    replace_folder(_folder(tmp_path / ".checkpoint-5.tmp", "new"), final)
    assert (final / "f").read_text() == "new" and os.listdir(tmp_path) == ["checkpoint-5"]

    staged = _folder(tmp_path / ".checkpoint-5.tmp", "newer")
    real_replace = os.replace

    def killed_between_the_renames(src, dst):
        if Path(src) == staged:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_between_the_renames)
    with pytest.raises(KeyboardInterrupt):
        replace_folder(staged, final)
    assert replaced_folder(final) == tmp_path / ".checkpoint-5.old"
    assert (replaced_folder(final) / "f").read_text() == "new"  # whole, for the caller to put back
