"""Checkpoint folders: atomic save, marker, damage detection, retention by score, manifest, errors, ranks."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import threading
import zlib
from pathlib import Path
from typing import Callable

import pytest

import lowmem.checkpoint.marker as ckpt_marker
from lowmem.checkpoint import MANIFEST_NAME, MARKER_NAME, CheckpointManager, file_crc32, write_json_atomic
from lowmem.errors import CheckpointError, ConfigError, LowmemError

MB = 1024**2


def writer(content: bytes = b"weights", name: str = "model.bin") -> Callable[[Path], None]:
    """A write callback that puts `content` into `name` and a small state file into a subfolder."""
    def write(folder: Path) -> None:
        (folder / name).write_bytes(content)
        (folder / "state").mkdir(exist_ok=True)
        (folder / "state" / "rng.json").write_text('{"seed": 1}')
    return write


def manager(run_dir: Path, keep_best_n: int = 2, **kwargs) -> CheckpointManager:
    return CheckpointManager(run_dir, keep_best_n, fsync=False, **kwargs)


def on_disk(run_dir: Path) -> list[str]:
    """Names of everything in the run folder except the manifest."""
    return sorted(p.name for p in run_dir.iterdir() if p.name != MANIFEST_NAME)


def steps_on_disk(run_dir: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*")}


# ----- saving ---------------------------------------------------------------------------------------------
def test_save_lists_every_file_with_size_and_crc32(tmp_path: Path) -> None:
    path = manager(tmp_path).save(100, writer(b"x" * 5000), score=2.5, info={"epoch": 1})
    assert path == tmp_path / "checkpoint-100"
    assert on_disk(tmp_path) == ["checkpoint-100"]
    marker = json.loads((path / MARKER_NAME).read_text())
    assert marker["step"] == 100 and marker["score"] == 2.5 and marker["metric"] == "val_loss"
    assert marker["info"] == {"epoch": 1} and marker["hash"] == "crc32"
    assert set(marker["files"]) == {"model.bin", "state/rng.json"}
    assert marker["files"]["model.bin"] == {"size": 5000, "crc32": f"{zlib.crc32(b'x' * 5000):08x}"}
    assert marker["total_bytes"] == 5000 + len('{"seed": 1}')


def test_marker_is_written_last_inside_the_temporary_folder(tmp_path: Path, monkeypatch) -> None:
    seen = []
    real = ckpt_marker.write_json_atomic

    def spy(path, obj):
        if Path(path).name == MARKER_NAME:
            folder = Path(path).parent
            seen.append((folder.name, sorted(obj["files"]), (folder / "model.bin").exists(),
                         (tmp_path / "checkpoint-7").exists()))
        real(path, obj)

    monkeypatch.setattr(ckpt_marker, "write_json_atomic", spy)
    manager(tmp_path).save(7, writer())
    assert seen == [(".checkpoint-7.tmp", ["model.bin", "state/rng.json"], True, False)]
    assert (tmp_path / "checkpoint-7" / MARKER_NAME).exists()


def test_crash_in_write_leaves_no_checkpoint(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(100, writer(b"good"))

    def crashing(folder: Path) -> None:
        (folder / "model.bin").write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        mgr.save(200, crashing)
    assert on_disk(tmp_path) == ["checkpoint-100"]
    assert mgr.latest_complete() == tmp_path / "checkpoint-100"
    assert mgr.verify(tmp_path / "checkpoint-100") == []


def test_second_interrupt_while_saving_only_leaves_a_temp_folder(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(100, writer(b"good"), score=1.0)

    def interrupted(folder: Path) -> None:
        (folder / "model.bin").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mgr.save(200, interrupted)
    assert on_disk(tmp_path) == [".checkpoint-200.tmp", "checkpoint-100"]
    assert mgr.latest_complete() == tmp_path / "checkpoint-100"

    resumed = manager(tmp_path)  # the next start cleans up
    assert on_disk(tmp_path) == ["checkpoint-100"]
    assert resumed.latest_complete() == tmp_path / "checkpoint-100"
    assert resumed.manifest["checkpoints"][0]["score"] == 1.0


def test_markerless_folder_is_never_returned_and_is_cleaned(tmp_path: Path, caplog) -> None:
    mgr = manager(tmp_path)
    mgr.save(100, writer(), score=1.0)
    stray = tmp_path / "checkpoint-500"
    stray.mkdir()
    (stray / "model.bin").write_bytes(b"no marker")
    (tmp_path / ".checkpoint-300.tmp").mkdir()

    with caplog.at_level(logging.WARNING, logger="lowmem.checkpoint"):
        assert mgr.latest_complete() == tmp_path / "checkpoint-100"
    assert "checkpoint-500" in caplog.text
    assert mgr.complete_checkpoints() == [tmp_path / "checkpoint-100"]

    mgr.save(200, writer())  # the next save removes leftovers before writing
    assert on_disk(tmp_path) == ["checkpoint-100", "checkpoint-200"]


def test_leftovers_are_removed_at_start_but_complete_checkpoints_never(tmp_path: Path) -> None:
    manager(tmp_path).save(100, writer())
    (tmp_path / "checkpoint-900").mkdir()
    (tmp_path / ".checkpoint-900.tmp").mkdir()
    (tmp_path / "notes").mkdir()  # not ours: left alone
    mgr = manager(tmp_path)  # the main process cleans up when it starts
    assert on_disk(tmp_path) == ["checkpoint-100", "notes"]
    assert mgr.cleanup_incomplete() == []


def _truncate(folder: Path) -> None:
    data = (folder / "model.bin").read_bytes()
    (folder / "model.bin").write_bytes(data[:-3])


def _flip_byte(folder: Path) -> None:
    data = bytearray((folder / "model.bin").read_bytes())
    data[len(data) // 2] ^= 0x01
    (folder / "model.bin").write_bytes(bytes(data))


def _drop_marker(folder: Path) -> None:
    (folder / MARKER_NAME).unlink()


def _drop_file(folder: Path) -> None:
    (folder / "state" / "rng.json").unlink()


def _garble_marker(folder: Path) -> None:
    (folder / MARKER_NAME).write_text('{"files": ')


@pytest.mark.parametrize("damage, words", [
    (_truncate, "truncated"), (_flip_byte, "corrupted"), (_drop_marker, "no COMPLETE.json"),
    (_drop_file, "rng.json is missing"), (_garble_marker, "unreadable"),
])
def test_damaged_latest_warns_and_falls_back(tmp_path: Path, caplog, damage, words) -> None:
    mgr = manager(tmp_path, keep_best_n=0)
    mgr.save(100, writer(bytes(range(256)) * 40))
    mgr.save(200, writer(bytes(range(256)) * 40))
    assert on_disk(tmp_path) == ["checkpoint-200"]  # keep_best_n=0: only the latest
    shutil.copytree(tmp_path / "checkpoint-200", tmp_path / "checkpoint-150")  # an older intact one
    marker = json.loads((tmp_path / "checkpoint-150" / MARKER_NAME).read_text())
    write_json_atomic(tmp_path / "checkpoint-150" / MARKER_NAME, {**marker, "step": 150})
    damage(tmp_path / "checkpoint-200")

    with caplog.at_level(logging.WARNING, logger="lowmem.checkpoint"):
        assert mgr.latest_complete() == tmp_path / "checkpoint-150"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "checkpoint-200" in warnings[0] and words in warnings[0]

    # The damaged one is neither the latest nor kept: the next save removes it.
    mgr.save(160, writer())
    assert steps_on_disk(tmp_path) == {160}
    assert mgr.manifest["latest"] == "checkpoint-160"


def test_size_only_check_skips_hashing(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(1, writer(b"abcdef"))
    _flip_byte(tmp_path / "checkpoint-1")
    assert mgr.latest_complete(verify_hashes=False) == tmp_path / "checkpoint-1"
    assert mgr.latest_complete() is None


def test_no_checkpoint_gives_none(tmp_path: Path) -> None:
    assert manager(tmp_path / "missing").latest_complete() is None
    assert manager(tmp_path).complete_checkpoints() == []


def test_saving_an_existing_step_replaces_it(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(100, writer(b"old"))
    mgr.save(100, writer(b"new"))
    assert on_disk(tmp_path) == ["checkpoint-100"]
    assert (tmp_path / "checkpoint-100" / "model.bin").read_bytes() == b"new"
    assert mgr.latest_complete() == tmp_path / "checkpoint-100"


def test_replacement_interrupted_between_renames_is_restored(tmp_path: Path) -> None:
    manager(tmp_path).save(100, writer(b"old"))
    os.replace(tmp_path / "checkpoint-100", tmp_path / ".checkpoint-100.old")  # as if killed right here
    mgr = manager(tmp_path)
    assert on_disk(tmp_path) == ["checkpoint-100"]
    assert mgr.latest_complete() == tmp_path / "checkpoint-100"


def test_deletion_removes_the_marker_first(tmp_path: Path, monkeypatch) -> None:
    mgr = manager(tmp_path, keep_best_n=0)
    mgr.save(1, writer())
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # as if killed during the deletion
    mgr.save(2, writer())
    assert not (tmp_path / "checkpoint-1" / MARKER_NAME).exists()
    monkeypatch.undo()
    assert mgr.latest_complete() == tmp_path / "checkpoint-2"
    manager(tmp_path, keep_best_n=0)
    assert on_disk(tmp_path) == ["checkpoint-2"]


# ----- retention ------------------------------------------------------------------------------------------
def expected_kept(history: list[tuple[int, float | None]], keep_best_n: int, mode: str) -> dict[int, list[str]]:
    """Reference model: the latest step, plus the n best scores ever saved (ties: earlier step)."""
    sign = 1 if mode == "min" else -1
    scored = sorted(((sign * s, step) for step, s in history if s is not None))
    kept: dict[int, list[str]] = {history[-1][0]: ["latest"]}
    for rank, (_key, step) in enumerate(scored[:keep_best_n], start=1):
        score = dict(history)[step]
        kept.setdefault(step, []).append(f"best #{rank} by m={score:.6g}")
    return kept


@pytest.mark.parametrize("mode", ["min", "max"])
@pytest.mark.parametrize("keep_best_n", [0, 1, 2, 3])
def test_retention_keeps_latest_and_n_best(tmp_path: Path, mode: str, keep_best_n: int) -> None:
    for seed in range(6):
        run_dir = tmp_path / f"seed{seed}"
        rng = random.Random(seed * 10 + keep_best_n)
        mgr = CheckpointManager(run_dir, keep_best_n, metric="m", mode=mode, fsync=False)
        history: list[tuple[int, float | None]] = []
        for step in range(1, 16):
            # one-decimal scores make ties common; about one save in five has no score
            score = None if rng.random() < 0.2 else round(rng.uniform(0, 3), 1)
            before = steps_on_disk(run_dir) if run_dir.exists() else set()

            def write(folder: Path, before=before) -> None:
                # Nothing is deleted while the new one is written. (B023: mgr.save below calls this in the
                # iteration that defines it, so run_dir is this iteration's.)
                assert steps_on_disk(run_dir) == before  # noqa: B023
                (folder / "model.bin").write_bytes(b"w")

            mgr.save(step, write, score=score)
            history.append((step, score))
            want = expected_kept(history, keep_best_n, mode)
            assert steps_on_disk(run_dir) == set(want), (seed, history)
            listed = {e["step"]: e["kept_because"] for e in mgr.manifest["checkpoints"]}
            assert listed == want
        on_file = json.loads((run_dir / MANIFEST_NAME).read_text())
        assert {e["step"]: e["kept_because"] for e in on_file["checkpoints"]} == want


def test_keep_best_1_keeps_both_best_and_latest(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_best_n=1)
    for step, loss in [(1, 1.0), (2, 2.0), (3, 3.0)]:
        mgr.save(step, writer(), score=loss)
    assert steps_on_disk(tmp_path) == {1, 3}
    reasons = {e["name"]: e["kept_because"] for e in mgr.manifest["checkpoints"]}
    assert reasons == {"checkpoint-1": ["best #1 by val_loss=1"], "checkpoint-3": ["latest"]}
    assert mgr.manifest["best"] == ["checkpoint-1"]


def test_keep_best_0_keeps_only_latest(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_best_n=0)
    for step, loss in [(1, 0.5), (2, 2.0), (3, 3.0)]:
        mgr.save(step, writer(), score=loss)
    assert steps_on_disk(tmp_path) == {3}
    assert mgr.manifest["best"] == []


def test_unscored_checkpoint_is_kept_only_while_latest(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_best_n=2)
    mgr.save(1, writer(), score=None)
    mgr.save(2, writer(), score=5.0)
    assert steps_on_disk(tmp_path) == {2}


def test_nan_score_counts_as_unscored(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_best_n=1)
    mgr.save(1, writer(), score=float("nan"))
    mgr.save(2, writer(), score=None)
    assert steps_on_disk(tmp_path) == {2}


def test_record_score_after_save(tmp_path: Path, caplog) -> None:
    mgr = manager(tmp_path, keep_best_n=1)
    mgr.save(100, writer())
    mgr.record_score(100, 2.0)
    mgr.save(200, writer())
    assert steps_on_disk(tmp_path) == {100, 200}
    mgr.record_score(200, 3.0)
    assert steps_on_disk(tmp_path) == {100, 200}
    mgr.save(300, writer(), score=1.0)
    assert steps_on_disk(tmp_path) == {300}
    assert mgr.manifest["checkpoints"] == [
        {"name": "checkpoint-300", "step": 300, "score": 1.0, "kept_because": ["latest", "best #1 by val_loss=1"]}
    ]
    with caplog.at_level(logging.WARNING, logger="lowmem.checkpoint"):
        mgr.record_score(100, 0.1)
    assert "checkpoint-100" in caplog.text and steps_on_disk(tmp_path) == {300}


# ----- manifest -------------------------------------------------------------------------------------------
def test_manifest_survives_a_new_manager(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_best_n=2, metric="bleu4", mode="max")
    mgr.save(10, writer(), score=0.20)
    mgr.save(20, writer())
    mgr.record_score(20, 0.35)  # only in the manifest, not in the marker
    mgr.save(30, writer(), score=0.10)
    first = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert first["metric"] == "bleu4" and first["mode"] == "max" and first["latest"] == "checkpoint-30"
    assert {e["name"]: e["kept_because"] for e in first["checkpoints"]} == {
        "checkpoint-10": ["best #2 by bleu4=0.2"], "checkpoint-20": ["best #1 by bleu4=0.35"],
        "checkpoint-30": ["latest"]}
    assert [e["score"] for e in first["checkpoints"]] == [0.20, 0.35, 0.10]

    resumed = manager(tmp_path, keep_best_n=2, metric="bleu4", mode="max")
    assert {**resumed.manifest, "updated": None} == {**first, "updated": None}
    resumed.save(40, writer(), score=0.30)  # beats step 10, not step 20
    assert steps_on_disk(tmp_path) == {20, 40}
    assert resumed.manifest["best"] == ["checkpoint-20", "checkpoint-40"]


def test_manifest_is_rebuilt_from_markers_when_missing(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_best_n=1)
    mgr.save(1, writer(), score=0.5)
    mgr.save(2, writer(), score=0.9)
    (tmp_path / MANIFEST_NAME).unlink()
    resumed = manager(tmp_path, keep_best_n=1)
    assert (tmp_path / MANIFEST_NAME).exists()
    assert resumed.manifest["best"] == ["checkpoint-1"] and resumed.manifest["latest"] == "checkpoint-2"


def test_other_metric_on_resume_is_a_config_error(tmp_path: Path) -> None:
    manager(tmp_path).save(1, writer(), score=0.5)
    with pytest.raises(ConfigError, match="val_loss"):
        manager(tmp_path, metric="bleu4", mode="max")


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        manager(tmp_path, keep_best_n=-1)
    with pytest.raises(ConfigError):
        manager(tmp_path, mode="lowest")


def test_write_json_atomic_keeps_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    write_json_atomic(target, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(target, {"a": object()})
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["x.json"]


def test_file_crc32_streams_in_chunks(tmp_path: Path) -> None:
    data = os.urandom(3 * ckpt_marker.CHUNK + 17)
    (tmp_path / "f").write_bytes(data)
    assert file_crc32(tmp_path / "f", sync=True) == (len(data), f"{zlib.crc32(data):08x}")


# ----- errors while saving --------------------------------------------------------------------------------
def test_disk_full_is_a_checkpoint_error_that_says_what_is_needed(tmp_path: Path, monkeypatch) -> None:
    mgr = manager(tmp_path)
    mgr.save(100, writer(b"\0" * (3 * MB)), score=1.0)

    def fills_disk(folder: Path) -> None:
        (folder / "model.bin").write_bytes(b"\0" * MB)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100 * MB, 99 * MB, MB // 2))
    with pytest.raises(CheckpointError) as caught:
        mgr.save(200, fills_disk)
    message = str(caught.value)
    assert isinstance(caught.value, LowmemError)
    assert "1.0 MB were written" in message and "needs about 3.0 MB" in message and "0.5 MB are free" in message
    assert "--output_dir" in message and "checkpoint-100" in message
    assert on_disk(tmp_path) == ["checkpoint-100"]
    assert mgr.verify(tmp_path / "checkpoint-100") == []
    assert mgr.latest_complete() == tmp_path / "checkpoint-100"


def test_disk_full_while_writing_the_marker(tmp_path: Path, monkeypatch) -> None:
    mgr = manager(tmp_path)
    mgr.save(100, writer())
    real = ckpt_marker.write_json_atomic

    def full(path, obj):
        if Path(path).name == MARKER_NAME:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, obj)

    monkeypatch.setattr(ckpt_marker, "write_json_atomic", full)
    with pytest.raises(CheckpointError, match="Not enough disk space"):
        mgr.save(200, writer())
    assert on_disk(tmp_path) == ["checkpoint-100"]


def test_permission_denied_is_a_checkpoint_error(tmp_path: Path, monkeypatch) -> None:
    mgr = manager(tmp_path)
    mgr.save(100, writer())

    def denied(folder: Path) -> None:  # what a read-only folder gives a non-root user
        raise PermissionError(errno.EACCES, "Permission denied", str(folder / "model.bin"))

    with pytest.raises(CheckpointError, match="No permission") as caught:
        mgr.save(200, denied)
    assert "writable" in str(caught.value)
    assert on_disk(tmp_path) == ["checkpoint-100"]
    assert mgr.latest_complete() == tmp_path / "checkpoint-100"


def test_permission_denied_creating_the_temp_folder(tmp_path: Path, monkeypatch) -> None:
    mgr = manager(tmp_path)
    mgr.save(100, writer())
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name.endswith(".tmp"):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(CheckpointError, match="No permission"):
        mgr.save(200, writer())
    assert on_disk(tmp_path) == ["checkpoint-100"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_folder(tmp_path: Path) -> None:
    mgr = manager(tmp_path)
    mgr.save(100, writer())
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="No permission"):
            mgr.save(200, writer())
    finally:
        tmp_path.chmod(0o755)
    assert on_disk(tmp_path) == ["checkpoint-100"]


# ----- several ranks --------------------------------------------------------------------------------------
class ThreadGroup:
    """What an all-reduce of an "ok" flag does across processes, for threads."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=20)
        self.flags = [True] * size

    def all_ok(self, rank: int, ok: bool) -> bool:
        self.flags[rank] = ok
        self.barrier.wait()
        result = all(self.flags)
        self.barrier.wait()  # nobody overwrites a flag before everyone has read them all
        return result


def run_ranks(run_dir: Path, size: int, write: Callable[[int, Path], None], step: int) -> list[object]:
    """Save `step` from `size` threads; returns each rank's result (a path or the exception it raised)."""
    group = ThreadGroup(size)
    managers = [CheckpointManager(run_dir, 1, is_main=(r == 0), all_ok=lambda ok, r=r: group.all_ok(r, ok),
                                  fsync=False) for r in range(size)]
    results: list[object] = [None] * size

    def rank_main(r: int) -> None:
        try:
            results[r] = managers[r].save(step, lambda folder: write(r, folder))
        except Exception as exc:  # noqa: BLE001 - checked by the test
            results[r] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_three_ranks_write_one_checkpoint(tmp_path: Path) -> None:
    def write(rank: int, folder: Path) -> None:
        (folder / f"rank{rank}.bin").write_bytes(bytes([rank]) * (rank + 1) * 1000)

    results = run_ranks(tmp_path, 3, write, step=50)
    assert results == [tmp_path / "checkpoint-50"] * 3
    marker = json.loads((tmp_path / "checkpoint-50" / MARKER_NAME).read_text())
    assert {name: f["size"] for name, f in marker["files"].items()} == {
        "rank0.bin": 1000, "rank1.bin": 2000, "rank2.bin": 3000}
    assert on_disk(tmp_path) == ["checkpoint-50"]
    assert CheckpointManager(tmp_path, 1, is_main=False).latest_complete() == tmp_path / "checkpoint-50"


def test_one_rank_failing_stops_every_rank(tmp_path: Path) -> None:
    run_ranks(tmp_path, 3, lambda r, folder: (folder / f"rank{r}.bin").write_bytes(b"ok"), step=50)

    def write(rank: int, folder: Path) -> None:
        (folder / f"rank{rank}.bin").write_bytes(b"part")
        if rank == 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    results = run_ranks(tmp_path, 3, write, step=60)
    assert all(isinstance(r, CheckpointError) for r in results)
    assert "Not enough disk space" in str(results[2])
    assert "Another process failed" in str(results[0]) and "Another process failed" in str(results[1])
    assert on_disk(tmp_path) == ["checkpoint-50"]
    assert CheckpointManager(tmp_path, 1).latest_complete() == tmp_path / "checkpoint-50"


def test_keep_two_best_plus_latest_before_and_after_a_resume(tmp_path):
    """keep_latest_n_ckp=2 with scripted validation losses: exactly the latest and the two best stay."""

    def write(folder):
        (folder / "rank0.bin").write_bytes(b"x" * 100)

    scores = {10: 5.0, 20: 3.0, 30: 4.0, 40: 2.5, 50: 6.0}
    manager = CheckpointManager(tmp_path, keep_best_n=2, metric="val_loss", mode="min")
    for step, score in scores.items():
        manager.save(step, write, score=score)
    kept = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert kept == ["checkpoint-20", "checkpoint-40", "checkpoint-50"]  # best 2.5 and 3.0, latest 50

    resumed = CheckpointManager(tmp_path, keep_best_n=2, metric="val_loss", mode="min")  # a resumed run
    assert resumed.latest_complete() == tmp_path / "checkpoint-50"
    resumed.save(60, write, score=2.8)
    resumed.save(70, write, score=9.0)
    kept = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert kept == ["checkpoint-40", "checkpoint-60", "checkpoint-70"]  # best 2.5 and 2.8, latest 70
    assert [entry["name"] for entry in resumed.manifest["checkpoints"]] == kept


# ----- damaged checkpoints are set aside, never deleted ----------------------------------------------------
def test_a_resume_refuses_only_when_every_checkpoint_is_damaged(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_best_n=1)
    mgr.save(100, writer(bytes(range(256)) * 40), score=1.0)
    mgr.save(200, writer(bytes(range(256)) * 40), score=2.0)
    _flip_byte(tmp_path / "checkpoint-200")
    found = mgr.latest_complete()
    assert found == tmp_path / "checkpoint-100" and mgr.no_usable_checkpoint(found) is None  # falls back
    _flip_byte(tmp_path / "checkpoint-100")
    found = mgr.latest_complete()
    message = mgr.no_usable_checkpoint(found)
    assert found is None and "every one is damaged" in message
    assert "checkpoint-200: model.bin has CRC-32" in message and "checkpoint-100: model.bin has CRC-32" in message
    assert manager(tmp_path / "empty").no_usable_checkpoint(None) is None  # nothing at all: start fresh


def test_a_damaged_checkpoint_is_set_aside_when_its_step_is_saved_again(tmp_path: Path) -> None:
    mgr = manager(tmp_path, keep_best_n=1)
    mgr.save(100, writer(b"a" * 4000), score=1.0)
    mgr.save(200, writer(b"b" * 4000), score=2.0)
    _flip_byte(tmp_path / "checkpoint-200")
    damaged_bytes = (tmp_path / "checkpoint-200" / "model.bin").read_bytes()
    assert mgr.latest_complete() == tmp_path / "checkpoint-100"
    mgr.save(200, writer(b"c" * 4000))  # the run reached the damaged one's step again
    assert mgr.verify(tmp_path / "checkpoint-200") == []
    [aside] = (tmp_path / "damaged").iterdir()
    assert aside.name.startswith("checkpoint-200-") and (aside / "model.bin").read_bytes() == damaged_bytes


def test_two_resumes_in_the_same_second_move_their_newer_checkpoints_into_folders_of_their_own(
        tmp_path: Path, monkeypatch) -> None:
    from datetime import datetime

    from lowmem.checkpoint import damage
    from lowmem.checkpoint.listing import Found

    class SameSecond(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(damage, "datetime", SameSecond)
    for name in ("checkpoint-10", "checkpoint-20"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").write_text(name)
        damage.move_superseded(tmp_path, tmp_path / "checkpoint-5", [Found(0, tmp_path / name, None, True)])
    assert (tmp_path / "superseded-20260102-030405" / "checkpoint-10" / "weights").read_text() == "checkpoint-10"
    assert (tmp_path / "superseded-20260102-030405-2" / "checkpoint-20" / "weights").read_text() == "checkpoint-20"
