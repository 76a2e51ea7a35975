"""The Trainer in-process: stopping, epoch ends, a rank out of rows, validation and saves when due, the final
export, and resume, each through the Trainer's own methods (one process; the multi-process paths are tested
through the launcher in test_resume_runs.py and test_training.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from fault_injection import StopAfterStep, TrainingTrace
from trainer_fixtures import ACCUMULATION, BATCH, ROWS, tiny_config
from trainer_fixtures import chat_data as chat_data, in_tmp as in_tmp, tokenizer_dir as tokenizer_dir  # fixtures

from lowmem.checkpoint.folders import file_crc32
from lowmem.config import TrainConfig
from lowmem.train.callbacks import Callback, StepResult
from lowmem.train.schedule import get_lr, stretched_step
from lowmem.train.state import TrainState
from lowmem.train.trainer import Trainer

STEPS_PER_EPOCH = ROWS // (BATCH * ACCUMULATION)  # 12


class Recorder(Callback):
    """Remembers the steps, validations and saves it saw."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.saves: list[int] = []
        self.started_at: int | None = None
        self.ended_with_model = False

    def on_train_start(self, trainer) -> None:
        self.started_at = trainer.state.step

    def on_step_end(self, trainer, result: StepResult) -> None:
        self.steps.append(trainer.state.step)
        assert result.global_target_tokens >= result.target_tokens > 0

    def on_checkpoint_write(self, trainer, folder: Path) -> None:
        self.saves.append(trainer.state.step)
        assert folder.name.endswith(".tmp"), "written into the temporary folder, before it is complete"

    def on_train_end(self, trainer, model) -> None:
        self.ended_with_model = model is not None


def validation_steps(caplog) -> list[int]:
    return [int(record.getMessage().split()[3].rstrip(":")) for record in caplog.records
            if record.getMessage().startswith("Validation at step")]


def test_a_full_run_validates_and_saves_when_due_and_exports(in_tmp, chat_data, tokenizer_dir, caplog):
    config = tiny_config(in_tmp, chat_data, tokenizer_dir, epochs=2, eval_steps=5, save_steps=8)
    recorder = Recorder()
    with caplog.at_level("INFO"):
        summary = Trainer(config, callbacks=[recorder]).fit()
    total = 2 * STEPS_PER_EPOCH
    assert recorder.steps == list(range(1, total + 1)) and recorder.started_at == 0
    # Saves: every 8 steps, at each epoch's end (12, 24); the last step is already saved then.
    assert recorder.saves == [8, 12, 16, 24]
    # Validations: before the first step (0), every 5 steps, and before each save.
    assert validation_steps(caplog) == [0, 5, 8, 10, 12, 15, 16, 20, 24]
    assert summary["steps"] == total and summary["stopped_by"] is None
    assert summary["val_loss_end"] < summary["val_loss_start"]
    assert recorder.ended_with_model
    run = in_tmp / "run"
    assert (run / "final" / "model.safetensors").is_file() and (run / "best" / "model.safetensors").is_file()
    marker = json.loads((run / "checkpoint-24" / "COMPLETE.json").read_text())
    assert marker["info"]["epoch"] == 1, "the step budget ended the run inside the second epoch"


def test_eval_on_start_false_trains_from_the_first_moment_and_says_so_at_the_end(in_tmp, chat_data, tokenizer_dir,
                                                                                   caplog):
    config = tiny_config(in_tmp, chat_data, tokenizer_dir, eval_steps=5, save_steps=8, eval_on_start=False)
    with caplog.at_level("INFO"):
        summary = Trainer(config).fit()
    assert validation_steps(caplog) == [5, 8, 10, 12], "no validation before the first step, the others as due"
    assert math.isnan(summary["val_loss_start"]) and summary["val_loss_end"] > 0
    assert f"Validation loss {summary['val_loss_end']:.4f} at step 12 (none before step 1: --eval_on_start=False)" \
        in caplog.text
    saved = json.loads((in_tmp / "run" / "checkpoint-12" / "trainer_state.json").read_text(),
                       parse_constant=lambda word: pytest.fail(f"{word} is not JSON"))
    assert saved["train"]["val_loss_start"] is None, "not measured: null"
    state = TrainState()
    state.load_state_dict(saved["train"])
    assert math.isnan(state.val_loss_start) and state.step == 12


def test_request_stop_saves_where_training_stands_and_exports_nothing(in_tmp, chat_data, tokenizer_dir):
    trainer = Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir), callbacks=[StopAfterStep(5)])
    summary = trainer.fit()
    assert summary["stopped_by"] == "LOWMEM_STOP_AFTER_STEP=5" and summary["steps"] == 5
    run = in_tmp / "run"
    assert (run / "checkpoint-5" / "COMPLETE.json").is_file()
    assert not (run / "final").exists(), "a stopped run exports nothing"
    state = json.loads((run / "checkpoint-5" / "trainer_state.json").read_text())
    assert state["train"]["step"] == 5 and state["checkpoints"]["last_saved_step"] == 5
    assert {p.name for p in (run / "checkpoint-5" / "rank0").iterdir()} == {"rng.json", "data.json", "memory.json"}


def test_a_stop_right_after_a_save_keeps_that_checkpoint_and_its_score(in_tmp, chat_data, tokenizer_dir):
    # The stop is asked for in step 5's hooks; step 5's save is due (with a validation): the stop, agreed at the
    # next step, finds the step saved and writes it no second time.
    recorder = Recorder()
    trainer = Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir, save_steps=5),
                      callbacks=[StopAfterStep(5), recorder])
    summary = trainer.fit()
    assert summary["steps"] == 5 and recorder.saves == [5]
    marker = json.loads((in_tmp / "run" / "checkpoint-5" / "COMPLETE.json").read_text())
    assert marker["score"] == pytest.approx(trainer.validator.last.loss)


def test_a_stop_asked_for_during_the_last_step_comes_too_late_and_the_run_ends_done(in_tmp, chat_data,
                                                                                    tokenizer_dir):
    # No step follows the last one to agree on the stop: every rank ends the run alike, saved and exported.
    trainer = Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir, max_steps=6), callbacks=[StopAfterStep(6)])
    summary = trainer.fit()
    assert summary["steps"] == 6 and not trainer.stopped
    assert (in_tmp / "run" / "checkpoint-6" / "COMPLETE.json").is_file() and (in_tmp / "run" / "final").is_dir()


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_a_resumed_trainer_continues_exactly(in_tmp, chat_data, tokenizer_dir, architecture):
    def config(folder: Path) -> TrainConfig:
        return tiny_config(folder, chat_data, tokenizer_dir, epochs=2, architecture=architecture)

    reference = TrainingTrace(in_tmp / "reference")
    Trainer(config(in_tmp / "a"), callbacks=[reference]).fit()

    stopped = Trainer(config(in_tmp / "b"), callbacks=[StopAfterStep(7)])
    stopped.fit()
    saved = json.loads((in_tmp / "b" / "run" / "checkpoint-7" / "trainer_state.json").read_text())
    assert saved["config"]["architecture"] == architecture
    resumed_trace = TrainingTrace(in_tmp / "resumed")
    resumed = Trainer(config(in_tmp / "b"), callbacks=[resumed_trace])
    assert resumed.resume() == in_tmp / "b" / "run" / "checkpoint-7"
    assert (resumed.state.step, resumed.checkpoints.last_saved_step) == (7, 7)
    resumed.fit()
    assert sorted(resumed_trace.losses) == list(range(8, 2 * STEPS_PER_EPOCH + 1))
    for step, loss in resumed_trace.losses.items():
        assert loss == pytest.approx(reference.losses[step], rel=1e-6), step
    rows_before = 7 * ACCUMULATION * BATCH
    assert resumed_trace.rows == reference.rows[rows_before:]


class EpochsSeen(Callback):
    """The epoch each step was trained in, the (step, epoch) of each save, and what the first step of the second
    epoch found: the last step saved, and whether that checkpoint was complete."""

    def __init__(self) -> None:
        self.epoch_of_step: dict[int, int] = {}
        self.saves: list[tuple[int, int]] = []
        self.found_in_second_epoch: tuple[int | None, bool] | None = None

    def on_step_end(self, trainer, result: StepResult) -> None:
        self.epoch_of_step[trainer.state.step] = trainer.state.epoch
        if trainer.state.epoch == 1 and self.found_in_second_epoch is None:
            last = trainer.checkpoints.last_saved_step
            complete = Path(trainer.config.output_dir) / f"checkpoint-{last}" / "COMPLETE.json"
            self.found_in_second_epoch = (last, complete.is_file())

    def on_checkpoint_write(self, trainer, folder: Path) -> None:
        self.saves.append((trainer.state.step, trainer.state.epoch))


class StopAtFirstEpochEnd(Callback):
    """Asks for a stop while the first epoch's end is saved: the run ends at that checkpoint, as it stands after
    the epoch's end (the stop is agreed at the next step, and that step's batches go back untrained)."""

    def on_checkpoint_write(self, trainer, folder: Path) -> None:
        if trainer.state.epoch == 1:
            trainer.request_stop("the end of the first epoch")


def test_running_out_of_rows_ends_the_epoch_and_the_step_budget_does_not(in_tmp, chat_data, tokenizer_dir):
    # Two epochs of 12 steps, and a step budget that ends 3 steps into the second.
    seen = EpochsSeen()
    trainer = Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir, epochs=2, max_steps=STEPS_PER_EPOCH + 3),
                      callbacks=[seen])
    summary = trainer.fit()
    # The rows ran out after the first epoch's 12 steps: the epoch ended there (the 8 rows of the short step not
    # taken are counted), validated and saved, before the second epoch's first step.
    assert seen.epoch_of_step == {step: int(step > STEPS_PER_EPOCH) for step in range(1, STEPS_PER_EPOCH + 4)}
    assert summary["rows_not_trained"] == BATCH
    assert seen.saves[0] == (STEPS_PER_EPOCH, 1)
    assert seen.found_in_second_epoch == (STEPS_PER_EPOCH, True)
    # The budget ended the run inside the second epoch: that epoch is not ended.
    assert trainer.state.step == summary["steps"] == STEPS_PER_EPOCH + 3 and trainer.state.epoch == 1
    assert seen.saves[1:] == [(STEPS_PER_EPOCH + 3, 1)] and not trainer.running


@pytest.mark.parametrize("batch,pack,not_trained", [(BATCH, True, BATCH), (BATCH, False, BATCH), (10, True, 0)])
def test_the_rows_of_a_short_last_accumulation_step_are_reported_at_the_epoch_end(in_tmp, chat_data, tokenizer_dir,
                                                                                    caplog, batch, pack, not_trained):
    # 200 rows in batches of 8: 25 batches, so 12 steps of 2 and one batch of 8 rows that is not trained (a step
    # of fewer micro-batches is not taken). In batches of 10: 20 batches, 10 whole steps, nothing left.
    trainer = Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir, epochs=2, batch_size_per_gpu=batch,
                                  pack_rows=pack), callbacks=[StopAtFirstEpochEnd()])
    steps = ROWS // (batch * ACCUMULATION)
    with caplog.at_level("INFO"):
        summary = trainer.fit()
    assert trainer.state.epoch == 1 and trainer.state.step == steps
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Epoch ")]
    said = (f": {not_trained} rows of a last, short accumulation step (fewer than {ACCUMULATION} micro-batches on "
            "some process) were not trained in this epoch." if not_trained else ".")
    assert lines == [f"Epoch 1 done at step {steps}{said}"]
    assert summary["rows_not_trained"] == not_trained
    state = json.loads((in_tmp / "run" / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    assert state["train"]["rows_not_trained"] == not_trained


def test_resume_without_a_checkpoint_starts_fresh(in_tmp, chat_data, tokenizer_dir, caplog):
    trainer = Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir))
    with caplog.at_level("INFO"):
        assert trainer.resume() is None
    assert f"No complete checkpoint in {in_tmp / 'run'}: starting fresh." in caplog.text
    assert trainer.state.step == 0


def test_a_longer_run_continues_exactly_while_the_steps_taken_keep_their_learning_rates(in_tmp, chat_data,
                                                                                       tokenizer_dir):
    # All 6 steps taken are in the warmup (20 steps): their learning rates do not depend on the run's length.
    reference = TrainingTrace(in_tmp / "reference")
    Trainer(tiny_config(in_tmp / "a", chat_data, tokenizer_dir, max_steps=10, warmup_steps=20),
            callbacks=[reference]).fit()
    Trainer(tiny_config(in_tmp / "b", chat_data, tokenizer_dir, max_steps=6, warmup_steps=20)).fit()
    longer_trace = TrainingTrace(in_tmp / "longer")
    longer = Trainer(tiny_config(in_tmp / "b", chat_data, tokenizer_dir, max_steps=10, warmup_steps=20),
                     callbacks=[longer_trace])
    assert longer.resume() is not None and longer.state.step == 6
    longer.fit()
    assert sorted(longer_trace.losses) == [7, 8, 9, 10]
    for step, loss in longer_trace.losses.items():
        assert loss == pytest.approx(reference.losses[step], rel=1e-6), step


def test_a_longer_run_whose_schedule_already_differs_is_refused(in_tmp, chat_data, tokenizer_dir):
    from lowmem.errors import ConfigError

    Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir, max_steps=6, warmup_steps=2)).fit()
    longer = Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir, max_steps=10, warmup_steps=2))
    with pytest.raises(ConfigError, match=r"max_steps: 6 → 10.*--allow_config_change=True"):
        longer.resume()
    assert longer.resume(allow_config_change=True) is not None


def test_a_step_with_non_finite_gradients_is_skipped_and_training_goes_on(in_tmp, chat_data, tokenizer_dir,
                                                                           caplog):
    from fault_injection import NonFiniteAtStep

    from lowmem.model.weights import model_state_dict

    class Weights(Callback):
        """The weights after each step."""

        def __init__(self) -> None:
            self.after: dict[int, dict] = {}

        def on_step_end(self, trainer, result) -> None:
            self.after[trainer.state.step] = {k: v.clone() for k, v in model_state_dict(trainer.model).items()}
            self.applied = getattr(self, "applied", {})
            self.applied[trainer.state.step] = (result.applied, result.grad_norm)

    weights = Weights()
    trainer = Trainer(tiny_config(in_tmp, chat_data, tokenizer_dir, max_steps=6),
                      callbacks=[NonFiniteAtStep(4), weights])
    with caplog.at_level("WARNING"):
        summary = trainer.fit()
    applied, norm = weights.applied[4]
    assert not applied and not math.isfinite(norm)
    assert all(weights.applied[step][0] for step in (1, 2, 3, 5, 6))
    assert all(torch.equal(weights.after[3][name], weights.after[4][name]) for name in weights.after[3]), \
        "the skipped step changed the weights"
    assert any(not torch.equal(weights.after[4][name], weights.after[5][name]) for name in weights.after[4])
    assert summary["skipped_steps"] == 1 and trainer.state.skipped_steps == 1
    assert "Step 4: the gradient norm is nan, so the update was skipped on every rank" in caplog.text
    assert math.isfinite(summary["val_loss_end"])
    state = json.loads((in_tmp / "run" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["train"]["skipped_steps"] == 1


def write_as_saved(state_file: Path, state: dict) -> None:
    """Rewrite a checkpoint's trainer state, with the sizes and CRC-32 its completeness marker lists."""
    state_file.write_text(json.dumps(state))
    marker_file = state_file.parent / "COMPLETE.json"
    marker = json.loads(marker_file.read_text())
    size, crc = file_crc32(state_file)
    marker["files"][state_file.name].update(size=size, crc32=crc)
    marker_file.write_text(json.dumps(marker))


def test_a_checkpoint_saved_before_the_schedule_was_a_part_of_its_own_resumes_exactly(in_tmp, chat_data,
                                                                                      tokenizer_dir):
    # Checkpoints written before the schedule had its own part kept its state as fields of `train`.
    def config(folder: Path) -> TrainConfig:
        return tiny_config(folder, chat_data, tokenizer_dir, epochs=2)

    reference = TrainingTrace(in_tmp / "reference")
    Trainer(config(in_tmp / "a"), callbacks=[reference]).fit()
    Trainer(config(in_tmp / "b"), callbacks=[StopAfterStep(7)]).fit()
    state_file = in_tmp / "b" / "run" / "checkpoint-7" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    schedule = state.pop("schedule")
    assert schedule == {"total_steps": 2 * STEPS_PER_EPOCH, "anchor_step": 0, "anchor_virtual": 0.0,
                        "virtual_total": 0, "warmup_steps": 2}

    # A stretched schedule (after a resume on another number of processes) kept in `train` goes on stretched.
    state["train"].update(total_steps=20, lr_anchor_step=7, lr_anchor_virtual=7.0, lr_virtual_total=30)
    write_as_saved(state_file, state)
    stretched = Trainer(config(in_tmp / "b"))
    stretched.resume()
    assert stretched.schedule.state_dict() == {"total_steps": 20, "anchor_step": 7, "anchor_virtual": 7.0,
                                               "virtual_total": 30, "warmup_steps": 2}
    assert stretched.total_steps == 20 and stretched.step_log.total_steps == 20
    settings = stretched.config
    assert stretched.schedule.lr(10) == pytest.approx(get_lr(stretched_step(10, 7, 7.0, 30, 20), settings.learn_rate,
                                                             settings.warmup_steps, 30, settings.min_lr_ratio))

    # Not stretched: the run continues exactly, at the same learning rates.
    state["train"].update(total_steps=schedule["total_steps"], lr_anchor_step=0, lr_anchor_virtual=0.0,
                          lr_virtual_total=0)
    write_as_saved(state_file, state)
    resumed_trace = TrainingTrace(in_tmp / "resumed")
    resumed = Trainer(config(in_tmp / "b"), callbacks=[resumed_trace])
    assert resumed.resume() == state_file.parent
    assert resumed.schedule.state_dict() == schedule
    resumed.fit()
    assert sorted(resumed_trace.losses) == list(range(8, 2 * STEPS_PER_EPOCH + 1))
    for step, loss in resumed_trace.losses.items():
        assert loss == pytest.approx(reference.losses[step], rel=1e-6), step
        assert resumed_trace.lrs[step] == reference.lrs[step], step


def test_a_warmup_longer_than_the_run_is_shortened_said_at_the_start_and_kept_on_resume(in_tmp, chat_data,
                                                                                        tokenizer_dir, caplog):
    # warmup_steps at TrainConfig's default (50) and one epoch of 12 steps: shortened to 1, said in one line.
    def config(**overrides) -> TrainConfig:
        return dataclasses.replace(tiny_config(in_tmp, chat_data, tokenizer_dir, save_steps=4),
                                   warmup_steps=TrainConfig().warmup_steps, **overrides)

    with caplog.at_level("WARNING"):
        Trainer(config(), callbacks=[StopAfterStep(4)]).fit()
    assert f"--warmup_steps=50 is {50 / STEPS_PER_EPOCH:.0%} of this run's {STEPS_PER_EPOCH} optimizer steps" \
        in caplog.text
    assert "Warming up over 1 steps instead" in caplog.text
    state = json.loads((in_tmp / "run" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["schedule"]["warmup_steps"] == 1
    resumed = Trainer(config())
    resumed.resume()
    assert resumed.schedule.warmup_steps == 1 and resumed.schedule.lr(7) < resumed.schedule.lr(1)
    # Given on the command line (or set apart from the class's default), it is kept as given.
    kept = Trainer(config(output_dir=str(in_tmp / "kept")), given={"warmup_steps"})
    assert kept.schedule.warmup_steps == 50 and "Kept as given" in kept.schedule.warmup_line()
    # A --max_steps that cuts the run short keeps it too: a larger one continues the run exactly.
    cut = Trainer(config(output_dir=str(in_tmp / "cut"), max_steps=8))
    assert cut.schedule.warmup_steps == 50 and "Kept, as --max_steps cuts the run short" in cut.schedule.warmup_line()


def _count_reads(monkeypatch, name: str) -> dict[str, int]:
    """Every opening of a file called `name` for reading text from here on, by path: `Path.read_text` and `open`
    both go through `io.open` (a checkpoint's integrity check reads bytes, which are not counted)."""
    import builtins
    import io

    reads: dict[str, int] = {}
    real_open = io.open

    def counting_open(file, mode="r", *args, **kwargs):
        if Path(str(file)).name == name and not set(mode) & set("wax+b"):
            reads[str(Path(file).parent.name)] = reads.get(str(Path(file).parent.name), 0) + 1
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    return reads


def test_the_start_up_reads_the_saved_run_once(in_tmp, chat_data, tokenizer_dir, monkeypatch):
    from lowmem.train.run import run_training

    config = tiny_config(in_tmp, chat_data, tokenizer_dir, max_steps=6, save_steps=3, keep_latest_n_ckp=2,
                         keep_optimizer_n_ckp=2)
    reads = _count_reads(monkeypatch, "trainer_state.json")
    run_training(config)
    assert reads == {}  # a new run reads no saved run
    assert (in_tmp / "run" / "checkpoint-3").is_dir() and (in_tmp / "run" / "checkpoint-6").is_dir()
    # A resume from the newest: its trainer state read once, for the settles, the memory savers and the resume.
    summary = run_training(config, is_keep_training=True)
    assert reads == {"checkpoint-6": 1} and summary["steps"] == 6
    # A resume from a named older one: that one read once, the newer one (set aside) not at all.
    reads.clear()
    summary = run_training(config, is_keep_training=True, resume_from=str(in_tmp / "run" / "checkpoint-3"))
    assert reads == {"checkpoint-3": 1} and summary["steps"] == 6
