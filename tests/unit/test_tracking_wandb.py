"""`--report_to=wandb` across a resume: the W&B run id is chosen at a run's first start, kept in the run folder and
handed back to wandb (resume="allow") by a resume; a new run in the folder gets an id of its own. wandb is not
installed here: what reaches it is what `Tracking.start` hands to `accelerator.init_trackers`."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from lowmem.config import TrainConfig, apply_overrides
from lowmem.run_files import tracking_record_file
from lowmem.train.tracking import Tracking


class FakeAccelerator(SimpleNamespace):
    """What Tracking uses of an Accelerator created with `log_with="wandb"`; `init_trackers` records its call."""

    def __init__(self, is_main_process: bool = True) -> None:
        super().__init__(log_with=["wandb"], is_main_process=is_main_process, trackers=[], calls=[])

    def init_trackers(self, project_name: str, config: dict[str, Any], init_kwargs: dict[str, Any]) -> None:
        self.calls.append({"project_name": project_name, **init_kwargs["wandb"]})


def start(config: TrainConfig, resumed: bool, is_main_process: bool = True) -> dict[str, Any]:
    """wandb.init's arguments of a run's start (the step does not matter to W&B)."""
    accelerator = FakeAccelerator(is_main_process)
    tracking = Tracking(accelerator, config)  # type: ignore[arg-type]
    tracking.start(10 if resumed else 0, resumed=resumed)
    tracking.end()
    [call] = accelerator.calls
    return call


def wandb_config(tmp_path, report_to: str = "wandb") -> TrainConfig:
    return apply_overrides(TrainConfig(), {"output_dir": str(tmp_path / "model_save" / "demo"), "report_to": report_to})


def test_a_resume_continues_the_w_and_b_run_and_a_new_run_gets_a_new_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # wandb's folder, logs/wandb/, is relative to the working directory
    config = wandb_config(tmp_path)

    first = start(config, resumed=False)
    assert first["id"] and "resume" not in first and first["name"] == "demo" == first["project_name"]
    assert json.loads(tracking_record_file(config.output_dir).read_text()) == {"wandb_run_id": first["id"]}

    for _ in range(2):  # every resume continues the same W&B run
        resumed = start(config, resumed=True)
        assert (resumed["id"], resumed["resume"], resumed["name"]) == (first["id"], "allow", "demo")

    again = start(config, resumed=False)  # a new run in the folder (--overwrite=True): a W&B run of its own
    assert again["id"] != first["id"] and "resume" not in again
    assert start(config, resumed=True)["id"] == again["id"]


def test_a_resume_without_a_kept_id_starts_a_w_and_b_run_it_keeps(tmp_path, monkeypatch):
    """A run started with TensorBoard (or none) and resumed with W&B; a record that cannot be read."""
    monkeypatch.chdir(tmp_path)
    config = wandb_config(tmp_path)
    first = start(config, resumed=False)

    Tracking(FakeAccelerator(), wandb_config(tmp_path, "none")).start(0, resumed=False)  # type: ignore[arg-type]
    assert not tracking_record_file(config.output_dir).exists()  # the earlier run's id is not the new run's
    resumed = start(config, resumed=True)
    assert resumed["id"] != first["id"] and "resume" not in resumed
    assert start(config, resumed=True)["id"] == resumed["id"]

    tracking_record_file(config.output_dir).write_text("{not json")
    assert start(config, resumed=True)["id"] not in (first["id"], resumed["id"])


def test_only_the_main_process_keeps_an_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = wandb_config(tmp_path)
    assert "id" not in start(config, resumed=False, is_main_process=False)  # accelerate starts no tracker there
    assert not tracking_record_file(config.output_dir).exists()
