"""Write failures told as one paragraph: a full disk, a quota, a file-size limit or a missing permission.

Every write of a run (checkpoint parts under every strategy, exports, the tokenizer's files and record) ends up
here when it fails: `disk_write_error` recognises the failure however the writing library reported it and says
what was being written, where, how much it needs against what is free, and what to do. The libraries differ:

    Python's own writes        OSError with its errno
    torch.save to an open file RuntimeError ("unexpected pos ...") whose __context__ is the OSError
    safetensors (Rust)         SafetensorError("... No space left on device (os error 28)")
    torch.distributed.checkpoint  CheckpointException whose `.failures` hold each rank's error (as above)

so the errno is looked for along the whole exception chain, and in the text where a library kept only that.
Logs are the exception: a log that cannot be written degrades to one warning (see `lowmem.log_format`), because
losing log lines must never stop a run.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lowmem.errors import DiskWriteError, LowmemError
from lowmem.units import MB

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust libraries (safetensors) carry an errno in the text
_TORCH_WRITER = re.compile(r"unexpected pos|PytorchStreamWriter|inline_container")
_SHARED_MEMORY = re.compile(r"/dev/shm|shared memory|unable to write to file </torch_")
_ERRNO_WORDS = {
    "No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT, "File too large": errno.EFBIG,
    "Permission denied": errno.EACCES, "Read-only file system": errno.EROFS,
}


def write_errno(error: BaseException) -> int | None:
    """The errno of the OS failure behind `error`: itself, its cause or context, the failures a distributed
    checkpoint collected from its ranks (`.failures`), or an errno named in their text."""
    if _SHARED_MEMORY.search(str(error)):
        return None  # /dev/shm full (DataLoader workers in a container): no disk of the run's, and not its fix
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current.errno
        text = str(current)
        match = _RUST_OS_ERROR.search(text)
        if match:
            return int(match.group(1))
        for words, number in _ERRNO_WORDS.items():
            if words in text:
                return number
        if current.__cause__ is not None:
            pending.append(current.__cause__)
        if current.__context__ is not None and _TORCH_WRITER.search(text):
            # Only torch's writer keeps the OSError as mere context; another error's context is an error already
            # handled when it was raised (a bug in an `except PermissionError:` branch is no permission problem).
            pending.append(current.__context__)
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint: {rank: (error, traceback)}
        if isinstance(failures, dict):
            for failure in failures.values():
                failure = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(failure, BaseException):
                    pending.append(failure)
    return None


def is_disk_failure(error: BaseException) -> bool:
    """True when `error` comes from a full disk, a quota, a file-size limit or a missing permission."""
    return write_errno(error) in SPACE_ERRNOS | PERMISSION_ERRNOS


def free_bytes(where: str | Path) -> int | None:
    """Bytes free for this user on the file system of `where` (its nearest existing parent); None if unknown."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _megabytes(count: int) -> str:
    """Bytes as megabytes with one decimal, for messages."""
    return f"{count / MB:,.1f} MB"


def disk_write_error(error: BaseException, what: str, where: str | Path, needed: int | None = None,
                     written: int | None = None, then: str = "then run the command again",
                     kept: str = "Nothing written earlier was changed.",
                     option: str | None = "--output_dir",
                     kind: type[DiskWriteError] = DiskWriteError) -> DiskWriteError | None:
    """The one-paragraph error for a failed write, or None when `error` is no disk or permission failure.

    Args:
        error: what the writing library raised.
        what: what was being written, e.g. "checkpoint-200" or "the final model".
        where: the folder it was written into.
        needed: about how many bytes the write needs, when known.
        written: how many bytes were written before it failed, when known.
        then: what to do once the cause is fixed (e.g. the resume command).
        kept: what the failure left intact.
        option: the flag that moves the write elsewhere (None: no flag does).
        kind: the error class to raise (a subclass of DiskWriteError).
    """
    number = write_errno(error)
    if number in SPACE_ERRNOS:
        free = free_bytes(where)
        figures = []
        if written is not None:
            figures.append(f"{_megabytes(written)} were written before it failed")
        if needed:
            figures.append(f"it needs about {_megabytes(needed)}")
        figures.append(f"{_megabytes(free)} are free there now" if free is not None else "free space is unknown")
        limit = (" (a file-size limit: see `ulimit -f`)" if number == errno.EFBIG
                 else " (a disk quota: see `quota -s`)" if number == errno.EDQUOT else "")
        elsewhere = f"set {option} to a larger disk" if option else "write to a larger disk"
        return kind(
            f"Not enough disk space to write {what} in {where}{limit}: {', '.join(figures)}. Free space there "
            f"(delete old runs or checkpoints you no longer need; lower --keep_latest_n_ckp to keep fewer), or "
            f"{elsewhere}; {then}. {kept} ({_first_line(error)})"
        )
    if number in PERMISSION_ERRNOS:
        return kind(
            f"No permission to write {what} in {where}: {_first_line(error)}. Make the folder writable by this "
            f"user (check `ls -ld {where}` and its owner, and that the disk is not mounted read-only) or "
            f"{f'set {option} to' if option else 'write to'} a folder you can write; {then}. {kept}"
        )
    return None


def _first_line(error: BaseException) -> str:
    """The error's type and the first line of its text: what the library said, without its traceback."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


@contextmanager
def writing(what: str, where: str | Path, needed: int | None = None, then: str = "then run the command again",
            kept: str = "Nothing written earlier was changed.", option: str = "--output_dir") -> Iterator[None]:
    """Run a block that writes; a disk or permission failure in it becomes `disk_write_error`'s DiskWriteError."""
    try:
        yield
    except LowmemError:
        raise  # already says what happened (a DataError while reading the data, say)
    except Exception as error:
        described = disk_write_error(error, what, where, needed=needed, then=then, kept=kept, option=option)
        if described is None:
            raise
        raise described from error
