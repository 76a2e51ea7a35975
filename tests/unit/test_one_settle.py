"""The run is settled once and handed along: `plan` settles a resume as `train` does, a resume lists its run folder
and reads its checkpoint's marker once, and nothing below the start-up decides a setting again."""

from __future__ import annotations

import builtins
import io
import json
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest
from training_helpers import commands_run_in, resume_chat_data, tiny_overrides

import lowmem.train.memory_fit as memory_fit
from lowmem.checkpoint.layout import MARKER_NAME
from lowmem.cli import main
from lowmem.train.trainer import Trainer


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Iterator[Path]:
    """This module's folder: its commands run there, their logging taken down at its end."""
    folder = tmp_path_factory.mktemp("settle")
    with commands_run_in(folder):
        yield folder


@pytest.fixture(scope="module")
def stopped_run(folder) -> list[str]:
    """A gpt2 run of 4 steps with checkpoints at steps 2 and 4 in `folder`/run, its tokenizer in `folder`/tok; the
    flags that made it, the architecture left out."""
    flags = [*tiny_overrides(folder, *resume_chat_data(folder)), "--save_steps=2", "--keep_latest_n_ckp=1",
             "--progress=False"]
    assert main(["train", *flags, "--architecture=gpt2", "--max_steps=4"]) == 0
    return flags


def test_the_plan_of_a_resume_plans_the_runs_own_architecture(stopped_run, monkeypatch, capsys):
    planned = []
    decide = memory_fit.decide

    def recording(config, *args, **kwargs):
        planned.append(config.architecture)
        return decide(config, *args, **kwargs)

    monkeypatch.setattr(memory_fit, "decide", recording)
    capsys.readouterr()
    assert main(["plan", *stopped_run, "--is_keep_training=True"]) == 0
    assert planned == ["gpt2"], "a resume of a gpt2 run is planned as a gpt2, whatever a new run's default"
    assert main(["plan", *stopped_run]) == 0
    assert planned[-1] == "llama", "a new run's plan takes the default architecture"
    assert "Memory plan:" in capsys.readouterr().out


def test_a_resume_lists_its_run_folder_and_reads_its_markers_once(stopped_run, folder, monkeypatch):
    """From the command to the first step (`Trainer.begin`): the start-up, the memory plan, the Trainer's parts
    and the resume itself."""
    run = (folder / "run").resolve()
    resumed_marker = run / "checkpoint-4" / MARKER_NAME
    listings, marker_reads, started = [], [], []
    listdir, scandir, real_open, begin = os.listdir, os.scandir, builtins.open, Trainer.begin

    def counted_listdir(path=".", *args, **kwargs):
        if not started and Path(path).resolve() == run:
            listings.append("listdir")
        return listdir(path, *args, **kwargs)

    def counted_scandir(path=".", *args, **kwargs):
        if not started and isinstance(path, (str, os.PathLike)) and Path(path).resolve() == run:
            listings.append("scandir")
        return scandir(path, *args, **kwargs)

    def counted_open(file, *args, **kwargs):
        if not started and isinstance(file, (str, os.PathLike)) and Path(file).resolve() == resumed_marker:
            marker_reads.append(file)
        return real_open(file, *args, **kwargs)

    def first_step(trainer):
        started.append(trainer.resumed_from)
        return begin(trainer)

    monkeypatch.setattr(os, "listdir", counted_listdir)
    monkeypatch.setattr(os, "scandir", counted_scandir)
    monkeypatch.setattr(builtins, "open", counted_open)
    monkeypatch.setattr(io, "open", counted_open)
    monkeypatch.setattr(Trainer, "begin", first_step)
    assert main(["train", *stopped_run, "--architecture=gpt2", "--max_steps=4", "--is_keep_training=True"]) == 0
    monkeypatch.undo()
    assert [Path(folder).resolve() for folder in started] == [run / "checkpoint-4"]
    assert len(listings) == 1, f"the run folder was listed {len(listings)} times at a resume: {listings}"
    assert len(marker_reads) == 1, f"checkpoint-4's marker was read {len(marker_reads)} times"


def count_calls(monkeypatch, function, counted=lambda *args, **kwargs: True) -> list[tuple]:
    """Every call of `function` (where `counted` says so), through any name a lowmem module holds it by."""
    calls: list[tuple] = []

    def counting(*args, **kwargs):
        if counted(*args, **kwargs):
            calls.append(args)
        return function(*args, **kwargs)

    for module in [module for name, module in sys.modules.items() if name.startswith("lowmem")]:
        for name, value in list(vars(module).items()):
            if value is function:
                monkeypatch.setattr(module, name, counting)
    return calls


def test_what_the_memory_plan_decided_is_never_decided_again(stopped_run, folder, monkeypatch):
    """A new run with the tokenizer trained and fixed batch shapes: the speed settings, the data settings, the
    tokenizer, the training data's index and the sample of its row lengths, each once in the run."""
    from lowmem.data.sizing import sample_batch_sizes
    from lowmem.data.sources import build_row_group_index
    from lowmem.tokenization.text_tokenizer import load_tokenizer
    from lowmem.distributed.performance import speed_settings
    from lowmem.memory.data_settings import decide_memory_settings

    train_file = str(folder / "train.parquet")
    of_the_training_rows = lambda files, *rest, **kwargs: str(files) in (train_file, str([train_file]))  # noqa: E731
    calls = {"speed settings": count_calls(monkeypatch, speed_settings),
             "data settings": count_calls(monkeypatch, decide_memory_settings),
             "tokenizer loads": count_calls(monkeypatch, load_tokenizer),
             "training data index": count_calls(monkeypatch, build_row_group_index, of_the_training_rows),
             "row-length sample": count_calls(monkeypatch, sample_batch_sizes)}
    assert main(["train", *stopped_run, f"--output_dir={folder / 'fixed_shapes'}", "--static_shapes=True",
                 "--max_steps=2"]) == 0
    assert {what: len(made) for what, made in calls.items()} == {what: 1 for what in calls}


def test_the_settled_config_is_read_only_and_stays_so_in_its_copies():
    import dataclasses
    import pickle

    from lowmem.config import TrainConfig, TrainConfigPretrainLarge
    from lowmem.config.read_only import SettledConfigError, is_read_only, read_only

    for config in (TrainConfig(n_layer=3), TrainConfigPretrainLarge()):
        settled = read_only(config)
        assert is_read_only(settled) and not is_read_only(config) and isinstance(settled, type(config))
        assert settled == config and config == settled and dataclasses.asdict(settled) == dataclasses.asdict(config)
        with pytest.raises(SettledConfigError, match="n_layer cannot be set"):
            settled.n_layer = 5
        changed = dataclasses.replace(settled, n_layer=5)
        assert is_read_only(changed) and changed.n_layer == 5 and settled.n_layer == config.n_layer
        with pytest.raises(SettledConfigError):
            changed.n_layer = 6
        again = pickle.loads(pickle.dumps(settled))
        assert is_read_only(again) and again == config and read_only(settled) is settled
        assert settled != dataclasses.replace(config, n_layer=7)
    config.n_layer = 4  # the config before the settle stays the user's to build


def test_the_trainer_and_its_parts_get_the_settled_config_read_only(stopped_run, folder, monkeypatch):
    from lowmem.config.read_only import is_read_only

    seen = []
    begin = Trainer.begin

    def first_step(trainer):
        seen.append((trainer.config, trainer.validator.config))
        return begin(trainer)

    monkeypatch.setattr(Trainer, "begin", first_step)
    assert main(["train", *stopped_run, "--architecture=gpt2", "--max_steps=4", "--is_keep_training=True"]) == 0
    assert seen and all(is_read_only(config) for config in seen[0])


def printed_config(capsys, *argv: str) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(list(argv)) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_print_config_shows_the_config_the_run_uses_and_where_each_value_comes_from(stopped_run, capsys):
    from lowmem.cli.print_config import DECIDED_AT_START

    fresh, said = printed_config(capsys, "train", *stopped_run, "--compile=False", "--print_config")
    assert fresh["architecture"] == "llama"  # a new run of these flags: the default, settled
    for name in DECIDED_AT_START:
        assert fresh.get(name, "not a field") is not None, f"{name} printed as null"
    decided = next(line for line in said.splitlines() if line.startswith("Decided by each process"))
    assert "static_shapes (on with CUDA, off on the CPU)" in decided and "compile (" not in decided  # given
    assert "compile" in next(line for line in said.splitlines() if line.startswith("Given"))
    assert "Run length: about" in said and "Warmup 2 steps." in said

    resumed, said = printed_config(capsys, "train", *stopped_run, "--is_keep_training=True", "--print_config")
    assert resumed["architecture"] == "gpt2"  # the saved run's
    assert "architecture" in next(line for line in said.splitlines() if line.startswith("Settled from the saved run"))

