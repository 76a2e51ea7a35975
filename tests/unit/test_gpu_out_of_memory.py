"""A GPU out-of-memory error in a training step or a validation (raised here by a patched step) ends the run with
one paragraph that says what did not fit and what lowers it, exit code 2, and the checkpoints as they were."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from training_helpers import commands_run_in, resume_chat_data, tiny_overrides

from lowmem.cli import main
from lowmem.train.trainer import Trainer

CUDA_SAYS = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 19.70 GiB"


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError(CUDA_SAYS)


def checkpoint_files(run: Path) -> dict[str, str]:
    """Every file of the run's checkpoints, best/ and final/ with its hash, and the checkpoint list."""
    files = [path for pattern in ("checkpoint-*/**/*", "best/**/*", "final/**/*", "checkpoints.json")
             for path in run.glob(pattern) if path.is_file()]
    return {str(path.relative_to(run)): hashlib.sha256(path.read_bytes()).hexdigest() for path in files}


def test_an_out_of_memory_step_is_one_paragraph_and_leaves_the_checkpoints(tmp_path, capsys, monkeypatch):
    flags = [*tiny_overrides(tmp_path, *resume_chat_data(tmp_path)), "--max_steps=8", "--save_steps=2",
             "--logging_steps=1"]
    step = Trainer.optimizer_step

    def fifth_step_out_of_memory(trainer, *args, **kwargs):
        if trainer.state.step == 4:  # after checkpoint-4 was saved
            out_of_memory()
        return step(trainer, *args, **kwargs)

    monkeypatch.setattr(Trainer, "optimizer_step", fifth_step_out_of_memory)
    with commands_run_in(tmp_path):
        assert main(["train", *flags]) == 2
    run = tmp_path / "run"
    saved = checkpoint_files(run)
    assert any(name.startswith("checkpoint-4/") for name in saved)
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr and CUDA_SAYS not in stderr
    assert "The GPU ran out of memory in a training step: a micro-batch of 8 rows x 64 tokens" in stderr
    assert "--batch_size_per_gpu=4 --gradient_accumulation_steps=2" in stderr
    assert "--activation_checkpointing=True" in stderr and "--allow_config_change" not in stderr

    monkeypatch.setattr(Trainer, "optimizer_step", out_of_memory)  # the resume's first step
    with commands_run_in(tmp_path):
        assert main(["train", *flags, "--is_keep_training=True"]) == 2
    stderr = capsys.readouterr().err
    assert "Resumed from" in stderr and "The GPU ran out of memory in a training step" in stderr
    assert "On a resume add --allow_config_change=True" in stderr
    assert checkpoint_files(run) == saved


def test_an_out_of_memory_validation_is_named_as_such(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("lowmem.eval.validator.evaluate", out_of_memory)
    flags = [*tiny_overrides(tmp_path, *resume_chat_data(tmp_path)), "--max_steps=2", "--activation_checkpointing=True"]
    with commands_run_in(tmp_path):
        assert main(["train", *flags]) == 2
    stderr = capsys.readouterr().err
    assert "The GPU ran out of memory in a validation batch" in stderr and "Traceback" not in stderr
    assert "--activation_checkpointing=True" not in stderr.split("The GPU ran out of memory")[1]  # already on
    assert "--allow_config_change" not in stderr  # a new run: nothing saved to keep


def test_an_out_of_memory_inside_a_compile_is_recognised_through_the_error_compile_wraps_it_in():
    from torch._dynamo.exc import BackendCompilerFailed

    from lowmem.train.gpu_oom import is_out_of_memory

    def compile_that_runs_out() -> None:
        try:
            out_of_memory()
        except torch.OutOfMemoryError as error:
            raise BackendCompilerFailed("inductor", error, None) from error

    try:
        compile_that_runs_out()
    except BackendCompilerFailed as wrapped:
        assert is_out_of_memory(wrapped)
    try:
        try:
            out_of_memory()
        except torch.OutOfMemoryError:
            raise RuntimeError("a failure while handling it")  # noqa: B904 - the implicit context is what is read
    except RuntimeError as handled:
        assert is_out_of_memory(handled)
    assert not is_out_of_memory(RuntimeError("expected m1 and m2 to have the same dtype"))
