"""Where a command's config comes from: `--preset`, `--config=FILE` (YAML, TOML, JSON) with flags on top,
`--print_config`, `--help` of a preset, and the run folder that data of one's own gets by default."""

from __future__ import annotations

import json

import pytest
from saved_runs import rewrite_trainer_state, write_saved_run
from training_helpers import write_chat_rows

from lowmem.cli import main


def printed_config(capsys, *flags: str) -> dict:
    capsys.readouterr()
    assert main(["train", *flags, "--print_config"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name, text", [
    ("run.yaml", "preset: large\nn_layer: 6\noutput_dir: runs/from_file\nkeep_best_n: 2\n"),
    ("run.toml", 'preset = "large"\nn_layer = 6\noutput_dir = "runs/from_file"\nkeep_best_n = 2\n'),
    ("run.json", '{"preset": "large", "n_layer": 6, "output_dir": "runs/from_file", "keep_best_n": 2}'),
])
def test_a_config_file_sets_fields_and_flags_win_over_it(tmp_path, monkeypatch, capsys, name, text):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    config = printed_config(capsys, f"--config={name}", "--n_layer=3")
    assert config["n_layer"] == 3  # the flag
    assert config["output_dir"] == "runs/from_file" and config["keep_latest_n_ckp"] == 2  # the file, an alias too
    assert config["vocab_size"] == 32000 and config["n_embd"] == 768  # the preset the file names


def test_print_config_gives_a_file_that_gives_the_same_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    first = printed_config(capsys, "--use_large_config=True", "--learn_rate=3e-4")
    (tmp_path / "resolved.json").write_text(json.dumps(first))
    assert printed_config(capsys, "--config=resolved.json") == first
    assert printed_config(capsys, "--preset=large", "--learn_rate=3e-4") == first
    assert not (tmp_path / "model_save").exists(), "--print_config only prints"


@pytest.mark.parametrize("flags, expected", [
    (["--config=missing.yaml"], "no such file"),
    (["--config=bad.toml"], "n_layers, which is not a config field (did you mean n_layer?)"),
    (["--preset=huge"], "is not a preset: choose one of default, large"),
    (["--preset=default", "--use_large_config=True"], "ask for two presets"),
])
def test_a_wrong_config_source_is_one_message(tmp_path, monkeypatch, capsys, flags, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text("n_layers = 6\n")
    assert main(["train", *flags]) == 2
    error = capsys.readouterr().err
    assert expected in error and "Traceback" not in error


def help_text(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as exited:  # fire ends a help with exit status 0
        main(["train", *flags, "--help"])
    assert exited.value.code in (0, None)
    captured = capsys.readouterr()
    return captured.out + captured.err  # fire writes the help to stderr when it is not a terminal


def test_help_of_a_preset_shows_the_presets_values(capsys):
    for large in (help_text(capsys, "--preset=large"), help_text(capsys, "--use_large_config=yes")):
        assert "--output_dir='model_save/pretrain_large'" in large and "--vocab_size=32000" in large
    default = help_text(capsys)
    assert "--output_dir='model_save/demo'" in default and "--vocab_size=8000" in default
    assert "--config" in default and "--print_config" in default and "--resume_from_checkpoint" in default


def test_data_of_ones_own_gets_a_run_folder_and_tokenizer_of_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_chat_rows(tmp_path / "poems.parquet", 20, seed=1)
    mine = printed_config(capsys, "--train_file=poems.parquet", "--validation_file=poems.parquet",
                          "--test_file=poems.parquet")
    assert mine["output_dir"] == "model_save/poems" and mine["tokenizer_dir"] == "model_save/poems/tokenizer"
    chosen = printed_config(capsys, "--train_file=poems.parquet", "--validation_file=poems.parquet",
                            "--output_dir=runs/p", "--tokenizer_dir=tok")
    assert chosen["output_dir"] == "runs/p" and chosen["tokenizer_dir"] == "tok"
    demo = printed_config(capsys)  # nothing given, nothing in data/: the demo data set, in the demo's folders
    assert demo["output_dir"] == "model_save/demo" and demo["tokenizer_dir"] == "model_save/tokenizer"
    assert "demo_data" in demo["train_file"]


def test_the_large_preset_on_data_of_ones_own_gets_folders_named_after_the_data(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    write_chat_rows(tmp_path / "data" / "train.parquet", 20, seed=1)
    write_chat_rows(tmp_path / "data" / "valid.parquet", 10, seed=2)
    write_chat_rows(tmp_path / "data" / "test.parquet", 10, seed=3)
    # The preset's folders hold a run on the demo data (the README's first try): the user's rows never go there.
    demo_run = write_saved_run(tmp_path / "model_save" / "pretrain_large", 7,
                               {"config": {"train_file": "/x/demo_data/train.parquet"}})
    mine = printed_config(capsys, "--use_large_config=True")
    assert mine["output_dir"] == "model_save/train_pretrain_large"
    assert mine["tokenizer_dir"] == "model_save/train_pretrain_large/tokenizer"
    # An earlier large run on these rows, in the preset's folder: it goes on there, with its tokenizer.
    rewrite_trainer_state(demo_run, {"config": {"train_file": "data/train.parquet"}})
    earlier = printed_config(capsys, "--use_large_config=True", "--is_keep_training=True")
    assert earlier["output_dir"] == "model_save/pretrain_large"
    assert earlier["tokenizer_dir"] == "model_save/tokenizer_large"


def test_the_large_preset_on_the_demo_data_keeps_its_folders(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no data/: the demo data set
    demo = printed_config(capsys, "--use_large_config=True")
    assert "demo_data" in demo["train_file"]
    assert demo["output_dir"] == "model_save/pretrain_large" and demo["tokenizer_dir"] == "model_save/tokenizer_large"


def test_the_users_scripts_import_the_config_from_the_checkout():
    # `from config import TrainConfig` from the project's folder, as the users' scripts do.
    import importlib.util

    from training_helpers import ROOT

    from lowmem.config import TrainConfig, TrainConfigPretrainLarge

    spec = importlib.util.spec_from_file_location("config", ROOT / "config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TrainConfig is TrainConfig and module.TrainConfigPretrainLarge is TrainConfigPretrainLarge
    assert module.TrainConfigPretrainLarge().output_dir == "model_save/pretrain_large"


def test_variants_of_a_stage_on_the_same_data_get_folders_of_their_own_and_old_names_are_found(tmp_path, monkeypatch):
    from lowmem.cli.run_folder import with_run_folders
    from lowmem.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    write_chat_rows(tmp_path / "pairs.parquet", 10, seed=1)

    def folder(**fields) -> str:
        config = TrainConfig(train_file="pairs.parquet", init_from="model_save/chat_from_books", **fields)
        return with_run_folders(config, given={"train_file", "init_from", *fields}).output_dir

    variants = {
        folder(): "model_save/pairs_from_chat_from_books",
        folder(lora_rank=16): "model_save/pairs_lora16_from_chat_from_books",
        folder(lora_rank=8): "model_save/pairs_lora8_from_chat_from_books",
        folder(objective="dpo"): "model_save/pairs_dpo_from_chat_from_books",
        folder(objective="dpo", dpo_reference="precomputed"): "model_save/pairs_dpo_precomputed_from_chat_from_books",
        folder(objective="dpo", lora_rank=16): "model_save/pairs_dpo_lora16_from_chat_from_books",
    }
    assert all(got == expected for got, expected in variants.items()), variants
    # A run saved under the name without its variant (as runs were named before) is resumed and read where it is,
    # by its own variant only; a run of another variant there does not capture this one.
    earlier = tmp_path / "model_save" / "pairs_from_chat_from_books"
    checkpoint = write_saved_run(earlier, 3, {"config": {"objective": "dpo", "lora_rank": 16,
                                                         "dpo_reference": "auto"}})
    assert folder(objective="dpo", lora_rank=16) == "model_save/pairs_from_chat_from_books"
    assert folder(objective="dpo", dpo_reference="precomputed") == \
        "model_save/pairs_dpo_precomputed_from_chat_from_books"
    assert folder(lora_rank=16) == "model_save/pairs_lora16_from_chat_from_books"
    rewrite_trainer_state(checkpoint, {"config": {"objective": "lm", "lora_rank": 0}})
    assert folder(objective="dpo", lora_rank=16) == "model_save/pairs_dpo_lora16_from_chat_from_books"
    # Once the variant's own folder exists, it is the one.
    (tmp_path / "model_save" / "pairs_lora16_from_chat_from_books").mkdir()
    rewrite_trainer_state(checkpoint, {"config": {"objective": "lm", "lora_rank": 16}})
    assert folder(lora_rank=16) == "model_save/pairs_lora16_from_chat_from_books"


@pytest.mark.parametrize("command", [["train"], ["train", "--print_config"], ["plan"]])
def test_a_validation_file_without_the_runs_columns_is_refused_before_anything_is_written(tmp_path, monkeypatch,
                                                                                          capsys, command):
    # Text to pretrain on, beside a project whose data/valid.parquet holds chat rows: the default validation file
    # is not the one meant, and train, --print_config and plan all say so, before a tokenizer is trained.
    from data_helpers import write_text_rows

    monkeypatch.chdir(tmp_path)
    write_text_rows(tmp_path / "books.parquet", 40, seed=1)
    (tmp_path / "data").mkdir()
    write_chat_rows(tmp_path / "data" / "valid.parquet", 10, seed=2)
    assert main([command[0], "--text_column=text", "--train_file=books.parquet", *command[1:]]) == 2
    error = capsys.readouterr().err
    assert "--validation_file=data/valid.parquet: The data file 'data/valid.parquet' has no column 'text'" in error
    assert "Traceback" not in error and not (tmp_path / "model_save").exists()
    # A command given the flags of another variant (here none: the full fine-tune's folder) names the runs there are.
    from lowmem.checkpoint.export import find_model_folder
    from lowmem.errors import ConfigError

    (tmp_path / "runs" / "pairs_lora16_from_base").mkdir(parents=True)
    with pytest.raises(ConfigError, match="Runs on the same data from the same model: runs/pairs_lora16_from_base"):
        find_model_folder("runs/pairs_from_base")
