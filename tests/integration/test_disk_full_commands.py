"""A full disk, a file-size limit and lost write access anywhere the run writes: one clear message and exit code 2
for what must be written (checkpoints under every strategy, the exported model), one warning for logs, every
earlier checkpoint intact, and an exact resume once the space is back.

The disk fills for real: a small tmpfs where the test may mount one (root), else a file-size limit (RLIMIT_FSIZE,
SIGXFSZ ignored), which fails a write past the limit with EFBIG the way a quota or a full disk fails it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from training_helpers import (assert_losses_match, command_line, resume_chat_data, resume_overrides, resumed_from,
                              run_command, tiny_overrides, traced_losses, traced_run)

from lowmem.checkpoint.folders import CheckpointManager, verify_checkpoint
from lowmem.distributed.strategy import save_distributed, save_torch_file
from lowmem.errors import CheckpointError

pytestmark = pytest.mark.own_process  # file-size limits set in the command's own process

KB = 1024


def _can_mount() -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    probe = Path(f"/tmp/lowmem-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                                 capture_output=True).returncode == 0
        if mounted:
            subprocess.run(["umount", str(probe)], check=True)
        return mounted
    finally:
        probe.rmdir()


CAN_MOUNT = _can_mount() and not os.environ.get("LOWMEM_TEST_NO_MOUNT")  # to try the fallback here too


@contextlib.contextmanager
def tmpfs(folder: Path, size_kb: int) -> Iterator[Path]:
    """A tmpfs of `size_kb` mounted on `folder` for the block; unmounted (lazily if busy) after, always."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path, leave: int) -> Path:
    """Fill the file system of `folder` until about `leave` bytes are free; returns the filler file."""
    filler = folder / "filler.bin"
    free = shutil.disk_usage(folder).free
    with open(filler, "wb") as file:
        file.write(b"\0" * max(0, free - leave))
    return filler


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes of any file fail with EFBIG in this process for the block (SIGXFSZ ignored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


@contextlib.contextmanager
def small_disk(folder: Path, room: int) -> Iterator[Path]:
    """`folder` on a disk where about `room` more bytes fit: a full tmpfs, or else a file-size limit of `room`."""
    if CAN_MOUNT:
        with tmpfs(folder, 4096) as mounted:
            fill(mounted, room)
            yield mounted
    else:
        folder.mkdir(parents=True, exist_ok=True)
        with file_size_limit(room):
            yield folder


# ----- every writer's failure is recognised ---------------------------------------------------------------
def _safetensors(path: Path) -> None:
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(64 * KB)}, str(path / "model.safetensors"))


def _torch_save(path: Path) -> None:
    save_torch_file({"exp_avg": torch.zeros(64 * KB)}, path / "optimizer.pt")


def _distributed_checkpoint(path: Path) -> None:
    save_distributed({"optimizer": {"exp_avg": torch.zeros(64 * KB)}}, path / "optimizer", no_dist=True)


def _plain_file(path: Path) -> None:
    (path / "trainer_state.json").write_text("x" * 256 * KB)


WRITERS = {"weights (safetensors)": _safetensors, "optimizer (torch.save)": _torch_save,
           "FSDP optimizer (torch.distributed.checkpoint)": _distributed_checkpoint, "trainer state": _plain_file}


@pytest.mark.parametrize("writer", list(WRITERS.values()), ids=list(WRITERS))
def test_every_writer_on_a_full_disk_is_a_checkpoint_error_and_the_earlier_checkpoint_stays(tmp_path, writer):
    with small_disk(tmp_path / "disk", 32 * KB) as disk:
        manager = CheckpointManager(disk / "run", keep_best_n=1, fsync=False)
        manager.save(1, lambda folder: (folder / "small.bin").write_bytes(b"1" * 100))
        with pytest.raises(CheckpointError) as caught:
            manager.save(2, writer)
        message = str(caught.value)
        assert message.startswith("Not enough disk space to write checkpoint-2 in ")
        assert "--output_dir" in message and "continues from checkpoint-1" in message
        assert sorted(path.name for path in (disk / "run").iterdir()) == ["checkpoint-1", "checkpoints.json"]
        assert verify_checkpoint(disk / "run" / "checkpoint-1") == []


# ----- the training command ---------------------------------------------------------------------------------
SHORT = ("--max_steps=60",)  # the resume tests' run, cut short: saves at 25, 30 (the stop), 50 and 60

@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return resume_chat_data(tmp_path_factory.mktemp("chat"))


def _train_on_small_disk(folder: Path, chat_data, room: int, run_dir: Path) -> subprocess.CompletedProcess:
    """Resume training with about `room` bytes of space left for the run folder (or a file-size limit)."""
    args = command_line(["train", *resume_overrides(folder, chat_data, *SHORT), "--is_keep_training=True"])
    if CAN_MOUNT:
        filler = fill(run_dir, room)
        try:
            return subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=300)
        finally:
            filler.unlink()

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=300, preexec_fn=limit)


@pytest.mark.over_a_minute("five runs of up to 60 steps, each a process of its own (the disk's limit is the "
                           "process's): the stopped run, two on a full disk, the resume and its reference")
def test_a_full_disk_during_a_save_stops_with_the_message_and_the_resume_is_exact(tmp_path, chat_data):
    run_dir = tmp_path / "run"
    mount = tmpfs(run_dir, 16 * 1024) if CAN_MOUNT else contextlib.nullcontext(run_dir)
    with mount:
        first = run_command(["train", *resume_overrides(tmp_path, chat_data, *SHORT)], cwd=tmp_path,
                            env={"LOWMEM_STOP_AFTER_STEP": "30"})
        assert first.returncode == 0, first.stderr[-3000:]
        # The save at step 50 meets the full disk while the weights are written; a resume while the disk is still
        # full meets it again, there or (with a little more room) while the optimizer state is written.
        for room, failing in [(100 * KB, "SafetensorError"), (300 * KB, "RuntimeError")]:
            full = _train_on_small_disk(tmp_path, chat_data, room, run_dir)
            assert full.returncode == 2, full.stderr[-3000:]
            assert "Traceback" not in full.stderr and "Logging error" not in full.stderr
            assert "error: Not enough disk space to write checkpoint-50 in " in full.stderr
            assert "continues from checkpoint-30" in full.stderr and failing in full.stderr
            kept = sorted(path.name for path in run_dir.glob("*checkpoint-*"))
            assert kept == ["checkpoint-25", "checkpoint-30"], kept
            assert all(verify_checkpoint(run_dir / name) == [] for name in kept)
        # The space is back: the run continues exactly as if never stopped.
        resumed, trace = traced_run(tmp_path, chat_data, extra=(*SHORT, "--is_keep_training=True"))
        assert resumed_from(resumed.stderr) == 30
        (tmp_path / "reference").mkdir()
        _, reference_trace = traced_run(tmp_path / "reference", chat_data, extra=SHORT)
        assert_losses_match(traced_losses(trace), traced_losses(reference_trace), 30)


@pytest.mark.skipif(not CAN_MOUNT, reason="needs a tmpfs to fill the disk the logs are written to")
def test_logs_on_a_full_disk_warn_once_and_training_goes_on(tmp_path, chat_data):
    with tmpfs(tmp_path / "launch", 1024) as launch:
        (launch / "logs").mkdir()
        (launch / "run_logs").mkdir()
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "logs").symlink_to(launch / "run_logs")  # the run folder's logs on the full disk too
        fill(launch, 0)
        tracking = ["--report_to=tensorboard"] if _installed("tensorboard") else []
        done = run_command(["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=12", *tracking],
                           cwd=launch)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Logging error" not in done.stderr and "Traceback" not in done.stderr
        warnings = [line for line in done.stderr.splitlines() if "cannot be written" in line]
        expected = [f"the log file {launch / 'logs' / 'chat_trainer_low_mem_'}",
                    f"the log file {run_dir / 'logs' / 'train.log'}",
                    f"The memory log {run_dir / 'logs' / 'memory_'}"] + (["The training curves"] if tracking else [])
        assert len(warnings) == len(expected), warnings  # each once, however many lines follow
        for words in expected:
            assert sum(words in line for line in warnings) == 1, (words, warnings)
        assert (run_dir / "final" / "model.safetensors").is_file()


def _installed(package: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(package) is not None


def test_only_the_newest_checkpoints_keep_the_optimizer_and_the_sizes_are_printed_at_the_first_save(tmp_path,
                                                                                                     chat_data):
    done = run_command(["train", *tiny_overrides(tmp_path, *chat_data), "--save_steps=10", "--max_steps=50",
                        "--eval_bleu_samples=0", "--keep_latest_n_ckp=3"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = [line for line in done.stderr.splitlines() if "Checkpoint size:" in line]
    assert len(sizes) == 1 and "checkpoint-10 takes" in sizes[0] and "(optimizer state" in sizes[0]
    assert "At most 4 checkpoints are kept (2 with what a resume needs, 2 with the weights only)" in sizes[0]
    assert "free on that disk now" in sizes[0]
    run_dir = tmp_path / "run"
    kept = sorted((path for path in run_dir.glob("checkpoint-*")), key=lambda path: int(path.name.split("-")[1]))
    assert len(kept) >= 3
    for folder in kept:
        assert verify_checkpoint(folder) == []  # the markers of stripped ones list what is left
    resumable = [folder.name for folder in kept if (folder / "optimizer.pt").exists()]
    assert resumable == [folder.name for folder in kept[-2:]]
    assert all((folder / "model.safetensors").is_file() for folder in kept)
    # A resume from one kept for its score only needs to be allowed: the optimizer starts afresh.
    weights_only = kept[0]
    refused = run_command(["train", *tiny_overrides(tmp_path, *chat_data), "--save_steps=10", "--max_steps=60",
                           "--eval_bleu_samples=0", "--keep_latest_n_ckp=3", "--is_keep_training=True",
                           f"--resume_from_checkpoint={weights_only}"], cwd=tmp_path)
    assert refused.returncode == 2 and "holds the weights but not the optimizer state" in refused.stderr
    assert "Traceback" not in refused.stderr
