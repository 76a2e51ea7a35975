""""Decided later by lowmem" is None in the config: --dataloader_num_workers and --attention, which once spelled it
-1 and "auto", take None, and the old spellings still mean None wherever a user can give them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lowmem.config import DataConfig, OptimConfig, TrainConfig, TrainConfigPretrainLarge, apply_overrides, \
    describe_fields, option, spec_of, validate_config
from lowmem.config.option import automatic
from lowmem.config.sources import read_config_file
from lowmem.distributed.performance import speed_settings
from lowmem.errors import ConfigError
from lowmem.memory.data_settings import decide_memory_settings

OLD_SPELLINGS = {"dataloader_num_workers": -1, "attention": "auto"}


def _spec(config_class: type, name: str):
    return spec_of({field.name: field for field in dataclasses.fields(config_class)}[name])


def test_both_default_to_none_and_declare_their_old_spelling():
    config = TrainConfig()
    assert (config.dataloader_num_workers, config.attention) == (None, None)
    assert TrainConfigPretrainLarge().dataloader_num_workers is None and TrainConfigPretrainLarge().attention is None
    assert _spec(DataConfig, "dataloader_num_workers").none_spellings == (-1,)
    assert _spec(OptimConfig, "attention").none_spellings == ("auto",)


@pytest.mark.parametrize("given", [
    {"dataloader_num_workers": -1, "attention": "auto"},  # as fire hands them over from the command line
    {"dataloader-num-workers": -1.0, "attention": "AUTO"},  # a float from YAML, another case
    {"dataloader_num_workers": None, "attention": None},
])
def test_the_old_spellings_become_none_on_the_command_line(given):
    config = apply_overrides(TrainConfig(), given)
    assert (config.dataloader_num_workers, config.attention) == (None, None)
    validate_config(config)


def test_the_old_spellings_become_none_through_the_train_command(tmp_path, monkeypatch, capsys):
    from lowmem.cli import main

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["train", "--dataloader_num_workers=-1", "--attention=auto", "--print_config"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    # Left to decide (None), which the printed config shows as each process decides it at start, and says so.
    decided = next(line for line in captured.err.splitlines() if line.startswith("Decided by each process"))
    assert "dataloader_num_workers (" in decided and "attention (" in decided
    assert printed["attention"] == "sdpa" and isinstance(printed["dataloader_num_workers"], int)  # on the CPU


def test_the_old_spellings_become_none_in_a_config_file_and_an_earlier_runs_train_config(tmp_path):
    written = tmp_path / "config.json"
    written.write_text(json.dumps(OLD_SPELLINGS))
    config = apply_overrides(TrainConfig(), read_config_file(written))
    assert (config.dataloader_num_workers, config.attention) == (None, None)
    # A run's own train_config.json from before: every field, the two with their old spellings.
    earlier = tmp_path / "train_config.json"
    earlier.write_text(json.dumps({**dataclasses.asdict(TrainConfig()), **OLD_SPELLINGS}))
    repeated = apply_overrides(TrainConfig(), read_config_file(earlier))
    assert repeated == TrainConfig()
    validate_config(repeated)


def test_a_config_built_in_python_with_the_old_spellings_is_accepted_and_decided_as_none():
    old = TrainConfig(dataloader_num_workers=-1, attention="auto")
    validate_config(old)
    validate_config(TrainConfigPretrainLarge(dataloader_num_workers=-1, attention="auto"))
    assert automatic(DataConfig, "dataloader_num_workers", old.dataloader_num_workers)
    assert automatic(OptimConfig, "attention", old.attention)
    assert not automatic(DataConfig, "dataloader_num_workers", 0) and not automatic(OptimConfig, "attention", "sdpa")


@pytest.mark.parametrize("budget_gb, processes, on_gpu", [(12, 3, True), (4, 3, True), (64, 3, True), (12, 3, False)])
def test_the_memory_decider_decides_the_old_spelling_as_none(budget_gb, processes, on_gpu):
    decided = decide_memory_settings(None, None, 15.0, local_processes=processes, on_gpu=on_gpu, budget_gb=budget_gb)
    assert "num_workers=" in decided.reason and "(auto)" in decided.reason
    # Every spelling the option declares, and the value a config built in Python holds.
    for spelling in _spec(DataConfig, "dataloader_num_workers").none_spellings:
        assert decide_memory_settings(None, spelling, 15.0, local_processes=processes, on_gpu=on_gpu,
                                      budget_gb=budget_gb) == decided
    old = TrainConfig(dataloader_num_workers=-1)
    assert decide_memory_settings(None, old.dataloader_num_workers, 15.0, local_processes=processes,
                                  on_gpu=on_gpu, budget_gb=budget_gb) == decided
    kept = decide_memory_settings(None, 0, 15.0, local_processes=processes, on_gpu=on_gpu, budget_gb=budget_gb)
    assert kept.num_workers == 0 and "num_workers=0 (set)" in kept.reason


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("changes", [{}, {"max_seq_len": 2048}, {"max_seq_len": 2048, "dropout": 0.1},
                                     {"max_seq_len": 2048, "pack_rows": False}])
def test_the_speed_settings_decide_auto_as_none(device, changes):
    unset = dataclasses.replace(TrainConfig(), **changes)
    assert unset.attention is None
    assert speed_settings(dataclasses.replace(unset, attention="auto"), device) == speed_settings(unset, device)


def test_the_speed_settings_keep_a_kernel_given():
    long = TrainConfig(max_seq_len=2048)
    assert speed_settings(long, "cuda").attention == "flex"
    assert speed_settings(dataclasses.replace(long, attention="sdpa"), "cuda").attention == "sdpa"


@pytest.mark.parametrize("name, value, message", [
    ("dataloader_num_workers", -2, r"--dataloader_num_workers must be 0 or more \(it is -2\); leave it unset \(None\) "
                                   "to decide from the memory budget."),
    ("attention", "fast", r"--attention must be sdpa or flex \(it is 'fast'\); leave it unset \(None\) to decide "),
])
def test_a_bad_value_is_still_refused_with_the_options_message(name, value, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(apply_overrides(TrainConfig(), {name: value}))
    with pytest.raises(ConfigError, match=message):
        validate_config(TrainConfig(**{name: value}))


def test_help_shows_none_with_the_old_spelling():
    lines = {line.split("=", 1)[0]: line for line in describe_fields(TrainConfig()).splitlines()}
    assert lines["--dataloader_num_workers"].startswith(
        "--dataloader_num_workers=None (or -1): DataLoader workers per process; None decides from the memory budget")
    assert lines["--attention"].startswith("--attention=None (or auto): attention kernel for packed rows")
    assert "None decides: flex on CUDA from 1024 tokens per sequence, sdpa otherwise" in lines["--attention"]
    given = {line.split("=", 1)[0]: line
             for line in describe_fields(TrainConfig(attention="flex", dataloader_num_workers=2)).splitlines()}
    assert given["--attention"].startswith("--attention='flex': ")  # the old spelling is shown beside None only
    assert given["--dataloader_num_workers"].startswith("--dataloader_num_workers=2: ")


def test_a_resume_sees_no_change_between_a_saved_old_spelling_and_none():
    from lowmem.train.resume import readers_changed, resume_differences

    saved = {"config": {**dataclasses.asdict(TrainConfig()), **OLD_SPELLINGS}, "train": {"step": 7},
             "world_size": 1, "workers_per_rank": 1}
    assert resume_differences(saved, TrainConfig(), steps_per_epoch=100) == ([], [])
    assert not readers_changed(saved, TrainConfig(), {"world_size": 1, "workers_per_rank": 1})


def test_an_old_spelling_must_not_be_a_value_the_field_allows():
    with pytest.raises(ValueError, match="none_spellings"):
        option(None, "workers", minimum=-1, none_spellings=(-1,))
    with pytest.raises(ValueError, match="none_spellings"):
        option(None, "kernel", choices=("auto", "sdpa"), none_spellings=("auto",))
    spec = spec_of(option(None, "x", minimum=0, none_spellings=(-1,)))
    assert spec.means_none(None) and spec.means_none(-1) and not spec.means_none(0)
    assert not spec_of(option(None, "x", minimum=2, none_spellings=(1,))).means_none(True)  # True == 1, not a spelling
