"""The configuration: sections, fields declared with option(), presets, aliases, and the packaged demo data."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from lowmem.config import (DEMO_DATA_DIR, MODEL_SHAPE_FIELDS, PRESETS, RESUME_EXACT_FIELDS, DataConfig, ModelConfig,
                           OptimConfig, TrainConfig, TrainConfigPretrainLarge, apply_overrides, describe_fields,
                           option, spec_of, validate_config, with_demo_data)
from lowmem.errors import ConfigError


def test_train_config_is_every_section_with_flat_fields():
    config = TrainConfig()
    assert isinstance(config, DataConfig) and isinstance(config, ModelConfig) and isinstance(config, OptimConfig)
    names = list(dataclasses.asdict(config))
    assert names[:3] == ["train_file", "validation_file", "test_file"] and names[-1] == "sample_max_new_tokens"
    assert len(names) == len(set(names)) == len(dataclasses.fields(TrainConfig))
    assert config.batch_size_per_gpu == 32 and config.keep_latest_n_ckp == 3
    assert all(spec_of(field).help for field in dataclasses.fields(TrainConfig))


def test_resume_roles_come_from_the_fields():
    assert set(MODEL_SHAPE_FIELDS) == {"architecture", "n_layer", "n_head", "n_embd", "max_seq_len", "lora_rank",
                                       "lora_targets"}
    assert set(RESUME_EXACT_FIELDS) == {
        "train_file", "train_sources", "text_column", "seed", "batch_size_per_gpu", "gradient_accumulation_steps",
        "dataloader_buffer_size", "dataloader_mix_row_groups", "max_seq_len", "epochs", "max_steps", "learn_rate",
        "min_lr_ratio",
        "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "grad_clip", "loss_on_response_only", "dropout",
        "init_from", "ddp_bf16_gradients", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets",
        "objective", "dpo_beta", "dpo_reference",
    }


def test_the_large_preset_is_data_and_a_class():
    large = TrainConfigPretrainLarge()
    assert isinstance(large, TrainConfig)
    assert {name: getattr(large, name) for name in PRESETS["large"]} == PRESETS["large"]
    untouched = set(dataclasses.asdict(TrainConfig())) - set(PRESETS["large"])
    assert all(getattr(large, name) == getattr(TrainConfig(), name) for name in untouched)
    assert apply_overrides(large, {"n_layer": 6}).n_layer == 6  # overrides keep the preset's other values
    assert apply_overrides(large, {"n_layer": 6}).n_embd == 768


def test_bounds_and_choices_are_checked_from_the_declarations():
    with pytest.raises(ConfigError, match=r"--memory_watchdog_fraction must be in \(0, 1\] \(it is 0.0\)"):
        validate_config(apply_overrides(TrainConfig(), {"memory_watchdog_fraction": 0}))
    with pytest.raises(ConfigError, match="--best_metric must be bleu4, val_loss or rewards_accuracy"):
        validate_config(apply_overrides(TrainConfig(), {"best_metric": "accuracy"}))
    with pytest.raises(ConfigError, match="--vocab_size must be at least 64"):
        validate_config(apply_overrides(TrainConfig(), {"vocab_size": 32}))
    with pytest.raises(ConfigError, match="two different columns"):
        validate_config(apply_overrides(TrainConfig(), {"response_column": "prompt"}))
    validate_config(apply_overrides(TrainConfig(), {"ultra_low_mem": "auto", "eval_bleu_samples": -1}))


def test_option_metadata():
    @dataclasses.dataclass
    class Section:
        width: int = option(8, "how wide", minimum=1, resume="model_shape", aliases=("w",))

    field = dataclasses.fields(Section)[0]
    spec = spec_of(field)
    assert (field.default, spec.help, spec.resume, spec.aliases) == (8, "how wide", {"model_shape"}, ("w",))
    assert spec.problem("width", 0) == "--width must be at least 1 (it is 0)."
    assert apply_overrides(Section(), {"w": 3}).width == 3
    with pytest.raises(ValueError, match="resume role"):
        option(1, "x", resume="sometimes")


def test_the_values_before_a_field_existed_are_declared_with_it():
    from lowmem.config.option import values_before_the_field
    from lowmem.config.settle import VALUES_BEFORE_THE_FIELD, in_effect

    # The table start-up fills old checkpoints from, as it was written by hand before the fields declared it:
    # some differ from today's default (a new run takes llama and mixes 16 row groups; the old runs did not).
    table = {"dataloader_mix_row_groups": 1, "architecture": "gpt2", "text_column": "", "train_sources": "",
             "init_from": "", "ddp_bf16_gradients": False, "lora_rank": 0, "lora_alpha": 16.0, "lora_dropout": 0.05,
             "lora_targets": "all", "objective": "lm", "dpo_beta": 0.1, "dpo_reference": "auto"}
    assert values_before_the_field(TrainConfig) == VALUES_BEFORE_THE_FIELD == table
    assert (TrainConfig().architecture, TrainConfig().dataloader_mix_row_groups) == (None, 16)
    assert values_before_the_field(TrainConfigPretrainLarge) == table
    # A checkpoint written before them gets each field's declared value; one that has them keeps its own.
    old = {"n_layer": 4, "epochs": 2}
    assert in_effect(old) == {**old, **table}
    assert in_effect({**old, "architecture": "llama"})["architecture"] == "llama"

    @dataclasses.dataclass
    class Section:
        always: int = option(8, "existed from the start")
        added: int = option(8, "added later", minimum=1, before=1)
        unset: str | None = option("x", "added later; earlier runs had none", before=None)

    assert not spec_of(dataclasses.fields(Section)[0]).added_later
    assert spec_of(dataclasses.fields(Section)[1]).added_later and spec_of(dataclasses.fields(Section)[1]).before == 1
    assert values_before_the_field(Section) == {"added": 1, "unset": None}  # None is a value, unlike no before=
    with pytest.raises(ValueError, match=r"before=0 is not a value the field allows \(at least 1\)"):
        option(8, "x", minimum=1, before=0)


def test_learning_rate_is_transformers_name_for_learn_rate():
    assert apply_overrides(TrainConfig(), {"learning_rate": 5e-4}).learn_rate == 5e-4
    with pytest.raises(ConfigError, match="set the same option"):
        apply_overrides(TrainConfig(), {"learn_rate": 1e-3, "learning_rate": 5e-4})
    assert "(also --learning_rate)" in describe_fields(TrainConfig())


def test_keep_best_n_is_an_alias_of_keep_latest_n_ckp():
    assert apply_overrides(TrainConfig(), {"keep_best_n": 7}).keep_latest_n_ckp == 7
    assert apply_overrides(TrainConfig(), {"keep-best-n": 2}).keep_latest_n_ckp == 2
    assert "keep_best_n" not in dataclasses.asdict(TrainConfig())  # checkpoints keep the field's own name
    with pytest.raises(ConfigError, match="set the same option"):
        apply_overrides(TrainConfig(), {"keep_latest_n_ckp": 1, "keep_best_n": 2})
    with pytest.raises(ConfigError, match="Did you mean --keep_best_n"):
        apply_overrides(TrainConfig(), {"keep_bst_n": 2})
    assert "--keep_latest_n_ckp=3 (also --keep_best_n): how many best checkpoints" in describe_fields(TrainConfig())


GRADIENT_CHECKPOINTING_NOTE = ("--gradient_checkpointing is lowmem's --activation_checkpointing (HF's name for it): "
                               "keep only each transformer block's input and recompute the block")


def test_gradient_checkpointing_is_hf_s_name_for_activation_checkpointing_and_says_so(caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level(logging.INFO, logger="lowmem.config.overrides"):
        assert apply_overrides(TrainConfig(), {"gradient_checkpointing": "True"}).activation_checkpointing is True
    assert [record.getMessage()[:len(GRADIENT_CHECKPOINTING_NOTE)] for record in caplog.records] == [
        GRADIENT_CHECKPOINTING_NOTE]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lowmem.config.overrides"):
        assert apply_overrides(TrainConfig(), {"gradient-checkpointing": False}).activation_checkpointing is False
        apply_overrides(TrainConfig(), {"activation_checkpointing": True, "keep_best_n": 2})  # no note of their own
        with pytest.raises(ConfigError, match="--activation_checkpointing and --gradient_checkpointing set the same"):
            apply_overrides(TrainConfig(), {"activation_checkpointing": True, "gradient_checkpointing": True})
    assert [record.getMessage()[:len(GRADIENT_CHECKPOINTING_NOTE)] for record in caplog.records] == [
        GRADIENT_CHECKPOINTING_NOTE]  # the first only: a refused set of flags says nothing but the error
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # the other processes of a launch read the same flags: said once
    with caplog.at_level(logging.INFO, logger="lowmem.config.overrides"):
        assert apply_overrides(TrainConfig(), {"gradient_checkpointing": True}).activation_checkpointing is True
    assert not caplog.records
    assert "(also --gradient_checkpointing)" in describe_fields(TrainConfig())


def test_a_note_for_a_name_that_is_not_an_alias_is_refused():
    with pytest.raises(ValueError, match="not aliases"):
        option(1, "x", aliases=("y",), alias_notes={"z": "a typo"})


def test_sizes_in_gb_say_they_are_gib_and_the_low_memory_threshold_says_what_it_chooses():
    from lowmem.memory.data_settings import MIN_SHARE_FOR_A_WORKER_GIB

    sized = [field for field in dataclasses.fields(TrainConfig) if field.name.endswith("_gb")]
    assert {field.name for field in sized} >= {"ultra_low_mem_threshold_gb", "memory_budget_gb"}
    assert [field.name for field in sized if "GiB (2^30 bytes)" not in spec_of(field).help] == []
    threshold = spec_of(next(field for field in sized if field.name == "ultra_low_mem_threshold_gb")).help
    assert "no workers" not in threshold
    share = f"{MIN_SHARE_FOR_A_WORKER_GIB:g} GiB"
    assert f"one DataLoader worker per GPU process whose share of the budget is at least {share}" in threshold


def test_default_data_paths_fall_back_to_the_packaged_demo_data(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="lowmem.config.demo"):
        config = with_demo_data(TrainConfig())
    assert Path(config.train_file) == DEMO_DATA_DIR / "train.parquet" and Path(config.train_file).is_file()
    assert Path(config.validation_file) == DEMO_DATA_DIR / "valid.parquet"
    assert Path(config.test_file) == DEMO_DATA_DIR / "test.parquet"
    assert len([r for r in caplog.records if "demo data set that ships with lowmem" in r.message]) == 1
    large = with_demo_data(TrainConfigPretrainLarge())
    assert type(large) is TrainConfigPretrainLarge and Path(large.train_file) == DEMO_DATA_DIR / "train.parquet"

    # Data of the user's own (a path given, or files at the default paths) means no demo file at all: paths
    # they chose are never replaced, and the others stay as they are, to be named if missing.
    given = with_demo_data(apply_overrides(TrainConfig(), {"train_file": "mine.parquet"}))
    assert given.train_file == "mine.parquet" and given.validation_file == "data/valid.parquet"
    assert given.test_file == "data/test.parquet"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").write_bytes(b"")
    mine = with_demo_data(apply_overrides(TrainConfig(), {"validation_file": "elsewhere.parquet"}))
    assert mine.train_file == "data/train.parquet" and mine.validation_file == "elsewhere.parquet"
    assert mine.test_file == "data/test.parquet"
    at_default_paths = with_demo_data(TrainConfig())  # data/train.parquet only: no demo validation rows
    assert at_default_paths.validation_file == "data/valid.parquet"


def test_an_odd_head_width_is_refused_for_llama_before_anything_starts():
    with pytest.raises(ConfigError, match=r"must be even.*--architecture=gpt2"):
        validate_config(TrainConfig(n_embd=36, n_head=4))  # unset: a new run's llama
    validate_config(TrainConfig(n_embd=36, n_head=4, architecture="gpt2"))
