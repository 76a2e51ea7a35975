"""Write failures recognised however a library words them: no write permission is a disk failure, an error
that is not about the run's disk passes through as it is (the full disks themselves:
tests/integration/test_disk_full_commands.py)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from lowmem.disk_errors import disk_write_error, is_disk_failure, writing
from lowmem.errors import DiskWriteError


def test_no_write_permission_is_recognised_however_a_library_words_it() -> None:
    assert is_disk_failure(PermissionError(errno.EACCES, "Permission denied"))
    rust_style = RuntimeError("Error while serializing: I/O error: Permission denied (os error 13)")
    assert is_disk_failure(rust_style)
    described = disk_write_error(rust_style, "the final model", Path("/data/run/final"))
    assert isinstance(described, DiskWriteError) and "No permission to write the final model" in str(described)
    assert not is_disk_failure(RuntimeError("size mismatch for lm_head.weight"))
    # Not the run's disk: /dev/shm full under DataLoader workers, and an error merely raised while handling one.
    assert not is_disk_failure(RuntimeError("unable to write to file </torch_123_456_0>: No space left on device (28)"))
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied")
        except PermissionError:
            raise KeyError("a bug in the fallback")  # noqa: B904 - on purpose: an error raised while handling one
    except KeyError as bug:
        assert bug.__context__ is not None and not is_disk_failure(bug)
    with pytest.raises(ValueError):  # not a disk failure: passes through as it is
        with writing("the final model", "/data/run/final"):
            raise ValueError("a bug")
