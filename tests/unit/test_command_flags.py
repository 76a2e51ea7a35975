"""Yes/no options mean what they say: true/false, 1/0 and yes/no (any case) are read as such, for the commands'
own flags (`--use_large_config`, `--is_keep_training`, ...) and for config fields alike; anything else is an
error in one line, never a silent "true"."""

from __future__ import annotations

import pytest

from lowmem.cli import main
from lowmem.cli.common import strict_flags
from lowmem.config.overrides import parse_bool
from lowmem.errors import ConfigError


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), (1, True), (0, False), ("true", True),
                                             ("False", False), ("YES", True), ("no", False), (" 1 ", True),
                                             ("0", False)])
def test_yes_no_words_are_read_as_such(value, expected):
    assert parse_bool("flag", value) is expected


@pytest.mark.parametrize("value", ["maybe", "flase", "", 2, -1, 0.5, None])
def test_anything_else_is_an_error_that_names_the_option(value):
    with pytest.raises(ConfigError, match=r"--flag=.* is not valid: flag takes True or False"):
        parse_bool("flag", value)


def test_a_command_gets_the_flag_it_was_given():
    seen = {}

    def command(use_large_config: bool = False, is_keep_training: bool = False, steps: int = 3, **overrides):
        seen.update(use_large_config=use_large_config, is_keep_training=is_keep_training, steps=steps, **overrides)

    strict_flags(command)(use_large_config="no", is_keep_training="false", steps=5, other="false")
    assert seen == {"use_large_config": False, "is_keep_training": False, "steps": 5, "other": "false"}
    with pytest.raises(ConfigError, match="is_keep_training takes True or False"):
        strict_flags(command)(is_keep_training="later")


def test_use_large_config_no_plans_the_demo_model_and_a_typo_stops_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the packaged demo data; no tokenizer yet
    assert main(["plan", "--use_large_config=no"]) == 0
    assert "Memory plan: llama, 1.9 M parameters" in capsys.readouterr().out
    assert main(["plan", "--use_large_config=yes"]) == 0
    assert "Memory plan: llama, 109.5 M parameters" in capsys.readouterr().out
    assert main(["plan", "--use_large_config=maybe"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == ["error: --use_large_config='maybe' is not valid: use_large_config takes True or False "
                     "(also 1/0, yes/no, in any case)."]


def test_the_plans_header_names_the_precision_the_cpu_run_computes_in(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the packaged demo data
    assert main(["plan", "--device=cpu"]) == 0
    assert "cpu, float32; micro-batch" in capsys.readouterr().out
    assert main(["plan", "--device=cpu", "--bf16_on_cpu=True"]) == 0
    assert "cpu, bf16; micro-batch" in capsys.readouterr().out  # the frozen weights and gathers it counts are bf16
    assert main(["plan", "--device=cpu", "--bf16_on_cpu=True", "--bf16=False"]) == 0
    assert "cpu, float32; micro-batch" in capsys.readouterr().out
