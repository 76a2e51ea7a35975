"""A run stopped before its end has no best/ or final/: generate, evaluate and export take its best-scored complete
checkpoint so far (checkpoints.json) and say which."""

from __future__ import annotations

import json

import pytest
from training_helpers import commands_run_in, resume_chat_data, tiny_overrides

from lowmem.checkpoint.export import find_model_folder
from lowmem.checkpoint.layout import MARKER_NAME
from lowmem.cli import main
from lowmem.errors import ConfigError
from lowmem.train.callbacks import Callback


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, result) -> None:
        if trainer.state.step == self.step:
            trainer.request_stop("the test")


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run of 12 steps stopped at step 7, with a checkpoint (validated) every 2 steps and at the stop."""
    folder = tmp_path_factory.mktemp("stopped")
    flags = [*tiny_overrides(folder, *resume_chat_data(folder)), "--max_steps=12", "--save_steps=2",
             "--eval_bleu_samples=0", "--keep_latest_n_ckp=2"]
    with commands_run_in(folder):
        assert main(["train", *flags], callbacks=[StopAt(7)]) == 0
    run = folder / "run"
    assert not (run / "best").exists() and not (run / "final").exists()
    return folder, flags, run


def test_the_best_scored_complete_checkpoint_is_taken_and_named(stopped_run, caplog):
    _folder, _flags, run = stopped_run
    manifest = json.loads((run / "checkpoints.json").read_text())
    best = manifest["best"][0]
    score = next(entry["score"] for entry in manifest["checkpoints"] if entry["name"] == best)
    scores = [entry["score"] for entry in manifest["checkpoints"] if entry["score"] is not None]
    assert len(scores) >= 2 and score == min(scores)  # val_loss: the lowest is the best
    with caplog.at_level("INFO"):
        assert find_model_folder(run) == run / best
    assert f"No best/ or final/ in {run} (the run stopped before its end): using {best}, the best-scored complete " \
           f"checkpoint so far (val_loss {score:.4f})" in caplog.text


def test_a_damaged_best_checkpoint_gives_way_to_the_next(stopped_run, tmp_path):
    import shutil

    _folder, _flags, run = stopped_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    manifest = json.loads((copy / "checkpoints.json").read_text())
    first, second = manifest["best"][:2]
    (copy / first / MARKER_NAME).unlink()  # no marker: not a complete checkpoint, whatever the manifest says
    assert find_model_folder(copy) == copy / second


def test_generate_answers_with_the_stopped_runs_checkpoint(stopped_run, capsys, caplog):
    folder, flags, run = stopped_run
    with commands_run_in(folder), caplog.at_level("INFO"):
        assert main(["generate", *flags, "--prompt=春", "--max_new_tokens=4"]) == 0
    assert capsys.readouterr().out.strip()  # an answer
    assert f"using {json.loads((run / 'checkpoints.json').read_text())['best'][0]}, the best-scored" in caplog.text


def test_an_empty_run_folder_still_says_there_is_no_model(tmp_path):
    with pytest.raises(ConfigError, match="No trained model in"):
        find_model_folder(tmp_path)


def test_a_next_stage_starts_from_the_same_checkpoint(stopped_run):
    from lowmem.source.locate import find_source

    _folder, _flags, run = stopped_run
    best = json.loads((run / "checkpoints.json").read_text())["best"][0]
    chosen = find_source(str(run))
    assert chosen.folder == run / best and "the best-scored complete checkpoint so far" in chosen.chosen
