"""`lowmem bench_train` run as a command: it runs its phases (data, ceiling, pipeline, the training loop, plain
PyTorch loop) and prints a table with every field, and lowmem's step and loop as ratios of the plain loop's (its
speed is not tested)."""

from __future__ import annotations

import re

import pytest
from training_helpers import run_command, tiny_overrides, write_chat_rows

NUMBER = r"[\d,]+(?:\.\d+)?"


def table_rows(output: str) -> dict[str, list[str]]:
    rows = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 7 and not set(cells[1]) <= set("-:"):
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("source", ["file", "generated"])
def test_bench_train_prints_every_field(tmp_path, source):
    train = write_chat_rows(tmp_path / "train.parquet", 300, seed=1)
    valid = write_chat_rows(tmp_path / "valid.parquet", 20, seed=2)
    data = [f"--data_file={train}"] if source == "file" else ["--rows=400"]
    done = run_command(["bench_train", *tiny_overrides(tmp_path, train, valid), "--steps=3", "--skip_steps=1", *data],
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = table_rows(done.stdout)
    assert set(rows) == {"phase", "data pipeline alone", "(a) batches in memory (ceiling)", "(b) real pipeline",
                         "(t) the training loop (Trainer.fit)", "(r) plain PyTorch loop (reference)"}
    assert rows["phase"] == ["tokens/s", "vs ceiling", "data wait", "peak RSS per process MB", "peak GPU MB", "MFU"]
    for name in ("(a) batches in memory (ceiling)", "(b) real pipeline", "(r) plain PyTorch loop (reference)"):
        tokens_per_second, ratio, wait, rss, gpu, mfu = rows[name]
        assert float(tokens_per_second.replace(",", "")) > 0
        assert re.fullmatch(r"\d+\.\d\d%", wait) and float(wait[:-1]) < 100
        assert float(rss.replace(",", "")) > 50  # MB: at least the interpreter and torch
        assert gpu == mfu == "-"  # CPU: no GPU memory, no MFU
    loop = rows["(t) the training loop (Trainer.fit)"]
    assert float(loop[0].replace(",", "")) > 0 and loop[2] == "-" and float(loop[3].replace(",", "")) > 50
    assert rows["(a) batches in memory (ceiling)"][1] == "1.00"
    assert re.search(rf"\(b\)/\(a\) = {NUMBER}; RSS the data pipeline adds per process: -?{NUMBER} MB", done.stdout)
    reference = re.search(r"lowmem's step / plain loop: \(a\)/\(r\) = (\d+\.\d\d) \(same batches, same model, same "
                          r"attention\)", done.stdout)
    assert reference and float(reference.group(1)) > 0
    loop_ratio = re.search(r"the training loop / plain loop: \(t\)/\(r\) = (\d+\.\d\d) \(what the users' command pays",
                           done.stdout)
    assert loop_ratio and float(loop_ratio.group(1)) > 0
    assert "1 process(es) on cpu" in done.stdout and "3 timed steps after 1" in done.stdout
    if source == "generated":
        assert "rows.parquet" in done.stdout
