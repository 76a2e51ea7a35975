"""A first day with lowmem, in-process: hints name the command the user ran, data that is not parquet stops
before anything starts, and the progress bar is drawn on a terminal only (the commands:
tests/integration/test_first_day_commands.py)."""

from __future__ import annotations

import io
import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from training_helpers import tiny_overrides, write_chat_rows

from lowmem.checkpoint.run_lock import start_fresh_run
from lowmem.cli import main
from lowmem.errors import ConfigError
from lowmem.program import command_line, program_name
from lowmem.progress import progress_bar

ONE_PROCESS = SimpleNamespace(is_main_process=True, num_processes=1)


# ----- hints name the command actually run --------------------------------------------------------------------
def _refusal(folder: Path) -> str:
    (folder / "checkpoint-5").mkdir(parents=True)
    with pytest.raises(ConfigError) as error:
        start_fresh_run(ONE_PROCESS, str(folder), overwrite=False)
    return str(error.value)


def test_hints_name_the_installed_command(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["/x/bin/lowmem", "train"])
    message = _refusal(tmp_path / "run")
    assert "`lowmem train ... --is_keep_training=True`" in message
    assert "train_low_mem.py" not in message


@pytest.mark.parametrize("started", ["train_low_mem.py", "/home/me/lowmem/train_low_mem.py"])
def test_hints_name_the_script(monkeypatch, tmp_path, started):
    monkeypatch.setattr(sys, "argv", [started, "train"])
    assert "`python train_low_mem.py train ... --is_keep_training=True`" in _refusal(tmp_path / "run")


def test_python_dash_m_is_the_lowmem_command(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/lib/python3.11/site-packages/lowmem/__main__.py", "plan"])
    assert program_name() == "lowmem" and command_line("plan --n_layer=4") == "lowmem plan --n_layer=4"


# ----- data that is not parquet stops before anything starts ---------------------------------------------------
def _jsonl(path: Path) -> None:
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) + "\n" for i in range(5)))


def _csv(path: Path) -> None:
    path.write_text("prompt,response\n" + "".join(f"p{i},r{i}\n" for i in range(5)))


def _text(path: Path) -> None:
    path.write_text("Once upon a time\nthere was a model\n")


def _binary(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 4)


# What to do: the `lowmem convert` command for the formats it reads, a pandas line for the others.
@pytest.mark.parametrize("name, write, looks_like, advice", [
    ("train.jsonl", _jsonl, "JSON Lines", "lowmem convert {path} --output={stem}.parquet\n"),
    ("train.csv", _csv, "CSV", "lowmem convert {path} --output={stem}.parquet\n"),
    ("train.txt", _text, "plain text", "lowmem convert {path} --output={stem}.parquet\n"),
    ("train.parquet", _csv, "CSV", "lowmem convert {path} --output={stem}.converted.parquet --input_format=csv\n"),
    ("train.parquet", _binary, "binary data",
     "pd.DataFrame({{'prompt': [...], 'response': [...]}}).to_parquet('{stem}.converted.parquet')"),
], ids=["jsonl", "csv", "txt", "csv-named-parquet", "binary-named-parquet"])
def test_data_that_is_not_parquet_stops_before_anything_starts(tmp_path, capsys, name, write, looks_like, advice):
    train = tmp_path / name
    write(train)
    valid = write_chat_rows(tmp_path / "valid.parquet", 20, seed=2)
    assert main(["train", *tiny_overrides(tmp_path, train, valid)]) == 2
    message = capsys.readouterr().err
    assert f"it looks like {looks_like}" in message and str(train) in message, message
    assert "parquet files with the text columns 'prompt' and 'response'" in message
    assert advice.format(path=shlex.quote(str(train)), stem=train.with_suffix("")) in message, message
    if name == "train.txt":  # plain text becomes one column of text, which train reads with --text_column
        assert "--text_column=text" in message
    assert "--train_file" in message and "Traceback" not in message
    assert not (tmp_path / "tok").exists() and not (tmp_path / "run").exists()


def test_every_file_of_a_folder_is_checked_by_its_header(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(3):
        write_chat_rows(folder / f"part-{i}.parquet", 10, seed=i)
    _jsonl(folder / "part-3.parquet")  # JSON Lines under a parquet name
    valid = write_chat_rows(tmp_path / "valid.parquet", 20, seed=9)
    assert main(["train", *tiny_overrides(tmp_path, folder, valid)]) == 2
    message = capsys.readouterr().err
    assert f"'{folder / 'part-3.parquet'}' is not a parquet file: it looks like JSON Lines" in message
    assert not (tmp_path / "tok").exists() and not (tmp_path / "run").exists()


# ----- the progress bar, and the log lines ----------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_is_drawn_on_a_terminal_only_and_unless_turned_off(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with progress_bar(total=3, enabled=True) as bar:
        assert not bar.disable
    with progress_bar(total=3, enabled=False) as bar:
        assert bar.disable
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a file
    with progress_bar(total=3, enabled=True) as bar:
        assert bar.disable
