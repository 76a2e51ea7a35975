"""Atomic writes: files and folders that readers see whole or not at all, even after a crash.

A file is written under a temporary name in its own folder (so the rename cannot cross file systems),
fsynced, then renamed over its final name; the folder is fsynced so that the rename itself survives a power
cut. A folder is built under a temporary name beside its final one and renamed into place the same way. On
failure the temporary file or folder is removed and whatever was there before is untouched.

Small files (`write_bytes_atomic` and its text and JSON forms) get a hidden temporary name unique to the
process and thread, so concurrent writers of one file never share it; files and folders that take long to
build (`file_built_aside`, `folder_built_aside`) are built as `<name>.partial`, visibly unfinished.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any


def fsync_dir(folder: str | Path) -> None:
    """Make renames inside `folder` durable; a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on folders; the rename itself has happened
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Flush a written file's data to disk.

    The file is reopened read-only (a copied file may have lost its write permission); the few systems that
    refuse fsync on such a handle (EBADF, EINVAL) are let be.
    """
    with open(path, "rb") as f:
        fsync_read_only(f.fileno())


def fsync_read_only(fd: int) -> None:
    """fsync a file opened for reading; the few systems that refuse that (EBADF, EINVAL) are let be."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EBADF, errno.EINVAL):
            raise


@contextmanager
def _renamed_into_place(tmp: Path, path: Path) -> Iterator[Path]:
    """Yield `tmp` to write; then fsync it and rename it to `path`, or remove it if the block raised."""
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the original error matters more than a leftover temporary file
        raise
    fsync_dir(path.parent)


def file_built_aside(path: str | Path) -> AbstractContextManager[Path]:
    """A context manager that yields `<name>.partial` beside `path` to write the file under.

    When the block ends normally the file is fsynced and renamed to `path` (replacing a file already there);
    when it raises, the partial file is removed and `path` is left as it was.
    """
    path = Path(path)
    return _renamed_into_place(path.with_name(f"{path.name}.partial"), path)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one.

    The temporary name carries the process and thread, so concurrent writers of the same file never share
    one; the last rename wins.
    """
    path = Path(path)
    with _renamed_into_place(path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"), path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    """`write_bytes_atomic` for text, encoded as UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented JSON (non-ASCII kept as is, a newline at the end), atomically.

    The text is made before anything is written, so an object that cannot be serialised leaves no trace.
    """
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def fsync_tree(folder: str | Path) -> None:
    """fsync every regular file below `folder`, then the folders themselves (symlinks are not followed)."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            file = Path(root) / name
            if file.is_file() and not file.is_symlink():
                fsync_file(file)
        fsync_dir(root)


def replaced_folder(final: str | Path) -> Path:
    """Where `replace_folder` moves the folder it replaces until the new one is in place: `.<name>.old`."""
    final = Path(final)
    return final.with_name(f".{final.name}.old")


def replace_folder(staged: str | Path, final: str | Path) -> None:
    """Rename the finished folder `staged` to `final`, replacing a folder already there.

    An existing `final` is first moved aside to `replaced_folder(final)` and removed only after the rename,
    so an interruption leaves one of the two whole (a caller that finds the aside folder without `final`
    puts it back). Both must be in the same folder.
    """
    staged, final = Path(staged), Path(final)
    old = None
    if final.exists():
        old = replaced_folder(final)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def folder_built_aside(final: str | Path) -> Iterator[Path]:
    """Build a folder under a temporary name beside `final` and put it in place when the block succeeds.

    Yields an empty `<name>.partial` folder (one left by an interrupted build is removed first). When the
    block ends normally its files are fsynced and the folder replaces `final` (see `replace_folder`); when
    it raises, the partial folder is removed and `final` is left as it was.
    """
    final = Path(final)
    staged = final.with_name(f"{final.name}.partial")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    try:
        yield staged
        fsync_tree(staged)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    replace_folder(staged, final)
