"""A first day with lowmem: hints name the command the user ran, data that is not parquet stops before anything
starts, no progress bar in a pipe, and one format for every log line."""

from __future__ import annotations

import io
import json
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from training_helpers import run_command, tiny_overrides, write_chat_rows

from lowmem.checkpoint.run_lock import start_fresh_run
from lowmem.cli import main
from lowmem.errors import ConfigError
from lowmem.program import command_line, program_name
from lowmem.progress import progress_bar

ONE_PROCESS = SimpleNamespace(is_main_process=True, num_processes=1)
# The one format: date and time, level, rank, message (lowmem.log_format).
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) \[rank \d+\] \S")
PYTHON_WARNING = re.compile(r"\S+:\d+: \w*Warning: ")


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


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory) -> SimpleNamespace:
    """The stderr of the tokenizer command and then of a 6-step training, each run as a user runs it (into a
    pipe), with their folder and flags."""
    folder = tmp_path_factory.mktemp("first_day")
    overrides = tiny_overrides(folder, write_chat_rows(folder / "train.parquet", 200, seed=1),
                               write_chat_rows(folder / "valid.parquet", 30, seed=2))
    tokenizer = run_command(["tokenizer", *overrides], cwd=folder)
    assert tokenizer.returncode == 0, tokenizer.stderr[-3000:]
    train = run_command(["train", *overrides, "--max_steps=6"], cwd=folder)
    assert train.returncode == 0, train.stderr[-3000:]
    return SimpleNamespace(folder=folder, overrides=overrides, tokenizer=tokenizer.stderr, train=train.stderr)


PROGRESS_BAR = re.compile(r"train: +\d+%\|")


def test_no_progress_bar_in_a_pipe(first_runs):
    # Read as text, a bar's carriage returns come back as line ends: the bar itself is looked for.
    assert "step 6/6 |" in first_runs.train
    assert not PROGRESS_BAR.search(first_runs.train) and "step/s]" not in first_runs.train, first_runs.train


def _stderr_on_a_terminal(command: list[str], cwd: Path) -> str:
    """Run `command` with its stderr on a pseudo-terminal, as in an interactive shell; what it wrote there."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import termios
    import threading

    main_end, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new one is 0 columns wide
    chunks: list[bytes] = []

    def drain() -> None:  # read as it comes: a full terminal buffer would block the writer
        while True:
            try:
                chunk = os.read(main_end, 65536)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        done = subprocess.run(command, cwd=cwd, stderr=terminal, stdout=subprocess.DEVNULL, timeout=600, check=False)
    finally:
        os.close(terminal)
        reader.join(timeout=30)
        os.close(main_end)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert done.returncode == 0, text[-3000:]
    return text


@pytest.mark.parametrize("progress", [True, False])
def test_the_progress_bar_on_a_terminal_unless_turned_off(first_runs, progress):
    from training_helpers import command_line as script_command

    flags = [*first_runs.overrides, f"--output_dir={first_runs.folder / f'run-{progress}'}", "--max_steps=3",
             f"--progress={progress}"]
    text = _stderr_on_a_terminal(script_command(["train", *flags]), first_runs.folder)
    assert "step 3/3 |" in text
    assert bool(PROGRESS_BAR.search(text)) == progress, text[-3000:]


def test_every_log_line_has_the_one_format(first_runs):
    tokenizer, train = first_runs.tokenizer, first_runs.train
    assert "training the tokenizer on" in tokenizer and "Training:" in train
    for output in (tokenizer, train):
        for line in output.splitlines():
            if line and not line[0].isspace() and not PYTHON_WARNING.match(line):  # indented: a message's next lines
                assert LOG_LINE.match(line), line
