"""Installing lowmem as a user does (not editable), and the `lowmem` console command on the packaged demo data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the version the README's install commands pin
# Flags that only make the run quicker: BLEU-4 on 8 validation prompts (instead of all 766), shorter answers, the
# validation loss on 2 batches; a log line every 5 steps, so that a resumed run's first line shows where it started.
QUICK = ["--eval_bleu_samples=8", "--eval_max_new_tokens=16", "--sample_max_new_tokens=16", "--eval_batches=2",
         "--logging_steps=5"]


def _copy_of_the_repository(dest: Path) -> Path:
    """The repository's files (tracked, and new ones git does not ignore) in `dest`, so that building the wheel
    leaves no build/ or *.egg-info in the checkout."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is left out, as a commit would
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: int) -> str:
    """Run `command` and return its output (stdout, then stderr, where the log lines go); fail with it on an error."""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout + done.stderr


@pytest.mark.over_a_minute("a fresh virtual environment and pip install of the project, then the installed command "
                           "trains and resumes")
@pytest.mark.slow
def test_installed_command_trains_on_the_packaged_demo_data_and_resumes(tmp_path):
    """In a fresh virtual environment, `pip install --no-compile torch==2.13.0 <copy of the repository>`; then, from
    an empty folder, `lowmem train --help`, `lowmem train --max_steps=10` and `lowmem train --max_steps=15
    --is_keep_training=True` (both with the QUICK flags). The first run trains on the demo data inside the
    installed package and saves checkpoint-10; the second resumes from it and finishes at step 15 with an
    exported final/ model."""
    if shutil.which("git") is None:
        pytest.skip("git is needed to list the repository's files")
    source = _copy_of_the_repository(tmp_path / "source")
    venv = tmp_path / "venv"
    # Byte-code is written as the commands import their modules (conftest.py lets the suite's processes write it),
    # not for every file at install (`--no-compile`): pip's compiling all of torch took about half the install's
    # time, and the files installed are what is under test, not their byte-code.
    env = {name: value for name, value in os.environ.items() if name not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile", TORCH, str(source)],
         cwd=tmp_path, env=env, timeout=900)

    work = tmp_path / "work"  # empty: no data/, no model_save/
    work.mkdir()
    lowmem = str(venv / "bin" / "lowmem")
    usage = _run([lowmem, "train", "--help"], cwd=work, env=env, timeout=120)
    assert "lowmem train <flags>" in usage and "--keep_latest_n_ckp=3 (also --keep_best_n)" in usage, usage[-3000:]
    first = _run([lowmem, "train", "--max_steps=10", *QUICK], cwd=work, env=env, timeout=900)
    site_packages = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert "using the demo data set that ships with lowmem" in first, first[-3000:]
    assert str((site_packages / "lowmem" / "demo_data").resolve()) in first, "not the installed package's demo data"
    assert "step 10/10" in first, first[-3000:]
    run = work / "model_save" / "demo"
    assert (run / "checkpoint-10").is_dir(), sorted(path.name for path in run.iterdir())

    second = _run([lowmem, "train", "--max_steps=15", "--is_keep_training=True", *QUICK], cwd=work, env=env,
                  timeout=900)
    assert "Resumed from" in second and "checkpoint-10" in second, second[-3000:]
    assert "step 15/15" in second and "step 10/15" not in second, second[-3000:]
    assert (run / "checkpoint-15").is_dir()
    assert (run / "final" / "model.safetensors").is_file()
