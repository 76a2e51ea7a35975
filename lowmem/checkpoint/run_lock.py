"""One training per run folder: the main process holds an OS lock on `<output_dir>/.lowmem.lock` for the whole
run, and checks the folder before anything is built.

The lock is `flock`, which the kernel drops when the process dies, however it dies: a crashed or killed run
never leaves a stale lock behind. The file also says who holds it (PID, host, start time, command), so that
a refused second run can name the first. On NFS, `flock` is a lock of the file server, released when the
holder's host ends its lease; a host that vanished keeps it until the lease expires (about 90 s by default).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO

from accelerate import Accelerator

from lowmem.distributed.collectives import broadcast_from_main
from lowmem.errors import ConfigError
from lowmem.program import command_line

logger = logging.getLogger(__name__)

LOCK_NAME = ".lowmem.lock"

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows: no flock; the folder is checked but not locked
    fcntl = None


def check_output_dir(folder: str | Path, option: str = "--output_dir") -> None:
    """Refuse an output folder that is a file, or that cannot be created or written, before anything is built."""
    if not str(folder).strip():
        raise ConfigError(f"{option} is empty: name the folder the run writes its checkpoints and model into, e.g. "
                          f"{option}=model_save/my_run.")
    path = Path(folder)
    dangling = next((part for part in (path, *path.parents) if part.is_symlink() and not part.exists()), None)
    if dangling is not None:
        raise ConfigError(f"{option}={folder}: {dangling} is a symbolic link to {os.readlink(dangling)}, which does "
                          f"not exist (a disk not mounted, or a folder moved away). Mount or create the folder it "
                          f"points to, or remove the link (`rm {dangling}`) to write into a new folder there.")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option}={folder} is a file, not a folder: checkpoints and the model are written into "
                          f"a folder. Choose another {option}, or move the file away.")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option}={folder} cannot be created: {existing} is a file. Choose another {option}.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option}={folder} cannot be written: {existing} is not writable by this user. Choose "
                          f"another {option}, or give this user write access to {existing}.")


# What a run leaves in its folder that a new run would mix with: checkpoints, their manifest, the exported models.
RUN_CONTENTS = ("checkpoint-*", "checkpoints.json", "final", "best", "base")  # base/: a run of adapters


def previous_run(folder: str | Path) -> list[Path]:
    """The checkpoints, manifest and exported models an earlier run left in `folder` (empty when none)."""
    path = Path(folder)
    if not path.is_dir():
        return []
    return sorted({found for pattern in RUN_CONTENTS for found in path.glob(pattern)})


def start_fresh_run(accelerator: Accelerator, folder: str, overwrite: bool) -> None:
    """For a new run (not a resume), under the folder's lock: refuse a folder that holds an earlier run's
    checkpoints (the new run would replace its final/, and a later resume would pick the older run's newest
    checkpoint while retention deleted the new run's), or with `overwrite` delete them first, said in one line.
    Every rank raises the same error; the main process alone touches the folder."""
    def check_or_clear() -> str:
        found = previous_run(folder)
        # A base/ alone (a run of adapters stopped before its first checkpoint) is no run to continue: a new run of
        # adapters writes its own over it, and --overwrite deletes it with the rest.
        if found and not overwrite and any(path.name != "base" for path in found):
            names = ", ".join(path.name for path in found[:4]) + (f" and {len(found) - 4} more"
                                                                  if len(found) > 4 else "")
            return (f"{folder} holds an earlier run ({names}). `{command_line('train ... --is_keep_training=True')}` "
                    "(your flags, and that one) continues it; --overwrite=True instead starts a new run there and "
                    "deletes those first; or choose another --output_dir.")
        if found and overwrite:
            _delete(found)
            logger.info("--overwrite=True: the earlier run's %s deleted from %s.",
                        ", ".join(path.name for path in found), folder)
        return ""

    problem = broadcast_from_main(accelerator, check_or_clear)
    if problem:
        raise ConfigError(problem)


def _delete(found: list[Path]) -> None:
    """Delete an earlier run's files and folders, the manifest first, so that a run stopped midway never points
    at half a folder."""
    for path in sorted(found, key=lambda item: item.name != "checkpoints.json"):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


@dataclass
class RunLock:
    """A held lock on a run folder; `release()` (or the end of the process) frees it."""

    path: Path
    handle: IO[str] | None

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file drops the flock
            self.handle = None


def _holder(handle: IO[str]) -> dict[str, str]:
    handle.seek(0)
    try:
        return json.loads(handle.read() or "{}")
    except json.JSONDecodeError:
        return {}


def acquire_run_lock(folder: str | Path, what: str, option: str = "--output_dir") -> RunLock:
    """Lock `folder` for `what` ("training", "evaluation"), or raise a ConfigError naming the process that holds it."""
    check_output_dir(folder, option)
    path = Path(folder) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        return RunLock(path, None)
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(handle)
        handle.close()
        pid, host = holder.get("pid", "?"), holder.get("host", "?")
        raise ConfigError(
            f"{folder} is in use: {holder.get('what', 'a lowmem process')} by PID {pid} on {host}, started "
            f"{holder.get('started', 'at an unknown time')} ({holder.get('command', 'command unknown')}). One run "
            f"per folder: wait for it to end, stop it (`kill -TERM {pid}` on {host}: it saves a checkpoint and "
            f"exits), or choose another {option}. The lock goes with the process; on a shared filesystem whose "
            f"host is gone it is freed when the file server's lease ends (NFS: about 90 s)."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({
        "pid": os.getpid(), "host": socket.gethostname(), "what": what,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(os.path.basename(arg) if i == 0 else arg for i, arg in enumerate(sys.argv)),
    }))
    handle.flush()
    return RunLock(path, handle)


def lock_run_folder(accelerator: Accelerator, folder: str, what: str) -> RunLock | None:
    """The main process locks the run folder; every rank raises the same error when another process holds it."""
    held: list[RunLock] = []

    def try_lock() -> str:
        try:
            held.append(acquire_run_lock(folder, what))
            return ""
        except ConfigError as error:
            return str(error)

    problem = broadcast_from_main(accelerator, try_lock)
    if problem:
        raise ConfigError(problem)
    return held[0] if held else None
