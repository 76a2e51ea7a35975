"""A run from a trained model takes its stage's defaults (a full fine-tune, adapters, DPO) where the flags are not
given, says which and why, keeps a given value, and warns of a learning rate far outside the stage's range."""

from __future__ import annotations

import json

import pytest
from hf_models import QWEN25_05B, qwen2_folder, sparse_qwen2_folder
from training_helpers import preference_project, write_chat_rows

from lowmem.cli import main
from lowmem.config import TrainConfig
from lowmem.source.stage import (ADAPTERS, BOUNDED_BLEU_SAMPLES, FULL, PREFERENCE, PREFERENCE_ADAPTERS,
                                 choose_stage_defaults, kept_on_resume)


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return qwen2_folder(tmp_path_factory.mktemp("stage") / "qwen")


@pytest.fixture
def chat_project(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    for name, seed in (("train", 1), ("valid", 2), ("test", 3)):
        write_chat_rows(tmp_path / "data" / f"{name}.parquet", 40, seed=seed)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def printed(capsys, *argv: str) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(["train", *argv, "--print_config"]) == 0, capsys.readouterr().err[-3000:]
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def stage_line(said: str) -> str:
    return next(line for line in said.splitlines() if line.startswith("Stage: "))


@pytest.mark.parametrize("flags, stage", [([], FULL), (["--lora_rank=8"], ADAPTERS)])
def test_a_fine_tune_takes_its_stages_values_and_says_why(chat_project, tiny_qwen, capsys, flags, stage):
    values, said = printed(capsys, f"--init_from={tiny_qwen}", *flags)
    for name, value in stage.values.items():
        assert values[name] == value, (name, values[name])
    line = stage_line(said)
    assert stage.name in line and f"learn_rate={stage.values['learn_rate']:.0e}".replace("e-0", "e-") in line, line
    assert "learn_rate" not in next(line for line in said.splitlines() if line.startswith("Given"))
    assert values["learn_rate"] != TrainConfig().learn_rate  # the pretraining rate would wreck the model


@pytest.mark.parametrize("flags, stage", [([], PREFERENCE), (["--lora_rank=8"], PREFERENCE_ADAPTERS)])
def test_preference_training_takes_its_stages_values(tmp_path, monkeypatch, tiny_qwen, capsys, flags, stage):
    monkeypatch.chdir(preference_project(tmp_path / "pairs"))
    values, said = printed(capsys, f"--init_from={tiny_qwen}", "--objective=dpo",
                           "--validation_file=data/valid.parquet", *flags)
    assert {name: values[name] for name in stage.values} == stage.values
    assert stage.name in stage_line(said)
    assert values["lora_dropout"] == 0.0  # as TRL: no dropout in preference training


def test_a_given_value_is_kept_and_a_rate_far_outside_the_stage_is_warned_about(chat_project, tiny_qwen, capsys):
    values, said = printed(capsys, f"--init_from={tiny_qwen}", "--lora_rank=8", "--learn_rate=1e-4", "--epochs=3")
    assert values["learn_rate"] == 1e-4 and values["epochs"] == 3
    assert values["weight_decay"] == ADAPTERS.values["weight_decay"]
    assert "learn_rate=" not in stage_line(said) and "epochs=" not in stage_line(said)
    assert "far" not in said  # 1e-4 is within the adapters' usual range

    values, said = printed(capsys, f"--init_from={tiny_qwen}", "--learn_rate=2e-3")
    assert values["learn_rate"] == 2e-3
    warning = [line for line in said.splitlines() if "--learn_rate=2e-3 is far above" in line]
    assert len(warning) == 1 and "a full fine-tune, 5e-6 to 1e-4" in warning[0], said


def test_a_run_from_random_weights_keeps_the_pretraining_defaults(chat_project, capsys):
    values, said = printed(capsys)
    assert values["learn_rate"] == TrainConfig().learn_rate and values["epochs"] == TrainConfig().epochs
    assert "Stage: " not in said


def test_bleu_is_bounded_for_a_model_over_100_million_parameters(tmp_path, chat_project, capsys):
    source = sparse_qwen2_folder(tmp_path / "qwen2.5-0.5b-shapes", QWEN25_05B)
    values, said = printed(capsys, f"--init_from={source}", "--lora_rank=8")
    assert values["eval_bleu_samples"] == BOUNDED_BLEU_SAMPLES
    assert f"eval_bleu_samples={BOUNDED_BLEU_SAMPLES}" in stage_line(said)
    values, _ = printed(capsys, f"--init_from={source}", "--lora_rank=8", "--eval_bleu_samples=-1")
    assert values["eval_bleu_samples"] == -1  # given: every prompt, as asked


def test_a_small_model_scores_every_bleu_prompt(chat_project, tiny_qwen, capsys):
    values, _ = printed(capsys, f"--init_from={tiny_qwen}")
    assert values["eval_bleu_samples"] == TrainConfig().eval_bleu_samples


def test_a_resume_keeps_the_values_its_run_was_saved_with():
    saved = {"learn_rate": 2e-3, "epochs": 2, "weight_decay": 0.1, "warmup_steps": 50, "lora_dropout": 0.05,
             "eval_bleu_samples": -1}  # a run saved before stages chose its values
    config = kept_on_resume(TrainConfig(learn_rate=7e-4), {"learn_rate"}, saved)
    assert config.learn_rate == 7e-4  # given on the resume: the resume's check decides
    assert (config.epochs, config.weight_decay, config.lora_dropout) == (2, 0.1, 0.05)


def test_the_choice_lists_only_what_was_not_given():
    config, choice = choose_stage_defaults(TrainConfig(lora_rank=8), {"lora_rank", "weight_decay"}, 1_000)
    assert "weight_decay" not in choice.chosen and config.weight_decay == TrainConfig().weight_decay
    assert choice.chosen["learn_rate"] == ADAPTERS.values["learn_rate"] == config.learn_rate
    assert choice.warning is None
