"""Helpers for tests that run the training command."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import in_process
from in_process import commands_run_in as commands_run_in  # where the tests have imported it from

ROOT = Path(__file__).resolve().parents[1]
_SYLLABLES = list("春风明月江南归去相思落花流水千里故人长亭夜雨西楼山青云白酒醉梦")


def write_chat_rows(path: Path, rows: int, seed: int, row_group_rows: int = 64) -> Path:
    """Unique prompt/response rows of made-up text from a small alphabet (so a small vocabulary fits)."""
    import random

    rng = random.Random(seed)
    prompts = [f"题{seed}-{i}：" + "".join(rng.choices(_SYLLABLES, k=rng.randint(4, 12))) for i in range(rows)]
    responses = ["".join(rng.choices(_SYLLABLES, k=rng.randint(6, 30))) + "。" for _ in range(rows)]
    pq.write_table(pa.table({"prompt": prompts, "response": responses}), path, row_group_size=row_group_rows)
    return path


def resume_chat_data(folder: Path) -> tuple[Path, Path]:
    """The training and validation files of the resume tests: 900 and 60 rows."""
    return write_chat_rows(folder / "train.parquet", 900, seed=1), write_chat_rows(folder / "valid.parquet", 60, seed=2)


# The fixtures below reach a test module that imports them as themselves (`from training_helpers import chat_data
# as chat_data`): each such module makes its own.
@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """The resume tests' data (`resume_chat_data`), made once per module."""
    return resume_chat_data(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The multi-node tests' folder, with the resume tests' data in it: (folder, (train, valid))."""
    folder = tmp_path_factory.mktemp("multinode")
    return folder, resume_chat_data(folder)


def chat_project(folder: Path) -> Path:
    """A folder with data of one's own: data/train.parquet (300 rows), valid (40) and test (40)."""
    (folder / "data").mkdir(parents=True)
    for name, rows, seed in (("train", 300, 1), ("valid", 40, 2), ("test", 40, 3)):
        write_chat_rows(folder / "data" / f"{name}.parquet", rows, seed=seed)
    return folder


def tiny_overrides(tmp_path: Path, train_file: Path, valid_file: Path) -> list[str]:
    """Command-line overrides for a model that trains in seconds."""
    return [
        f"--train_file={train_file}", f"--validation_file={valid_file}", f"--test_file={valid_file}",
        f"--tokenizer_dir={tmp_path / 'tok'}", f"--output_dir={tmp_path / 'run'}", "--vocab_size=400",
        "--n_layer=2", "--n_head=2", "--n_embd=32", "--max_seq_len=64", "--batch_size_per_gpu=8",
        "--dataloader_buffer_size=50", "--logging_steps=5", "--warmup_steps=2", "--sample_max_new_tokens=8",
        "--eval_bleu_samples=8", "--eval_max_new_tokens=8", "--epochs=1",  # later flags win: tests may change it
    ]


HARNESS = ROOT / "tests" / "train_with_faults.py"


def command_line(args: list[str], env: dict[str, str] | None = None,
                 launcher: list[str] | None = None) -> list[str]:
    """`train_low_mem.py ARGS`, or the test harness when `env` asks for test callbacks (LOWMEM_* variables),
    optionally under a launcher."""
    script = _script(env)
    if launcher is not None:  # ranks forked from a pre-imported parent where the test allows it (fork_server.py)
        forked = in_process.forked_ranks(launcher, str(script), args)
        if forked is not None:
            return forked
    return (launcher if launcher is not None else [sys.executable]) + [str(script), *args]


def _script(env: dict[str, str] | None) -> Path:
    """The test harness where `env` asks for test callbacks (LOWMEM_* variables), else `train_low_mem.py`."""
    return HARNESS if any(name.startswith("LOWMEM_") for name in env or {}) else ROOT / "train_low_mem.py"


def run_command(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 600,
                launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `train_low_mem.py` or the harness (optionally under a launcher) and return the finished process.

    Without a launcher the command runs in this process (`in_process.run_in_process`: the same arguments, variables,
    output and exit status, without an interpreter's start-up), unless the test is marked `own_process` (it reads
    the process's memory, or holds what a second process must find held)."""
    if launcher is None and not in_process.OWN_PROCESS:
        return in_process.run_in_process(command_line(args, env)[1:], args, cwd, env)
    return run_in_own_process(args, cwd, env, timeout, launcher)


def run_in_own_process(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 600,
                       launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """`run_command` in a new process (or under `launcher`) whatever the test's marks: for one command of a test whose
    other commands may run in its process or as forks."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(command_line(args, env, launcher), cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def three_cpu_processes(rank_logs: Path) -> list[str]:
    """`accelerate launch` for 3 processes on the CPU (gloo). `--tee 3` also writes each rank's stderr to a file
    of its own under `rank_logs`, where its lines cannot interleave with the other ranks' (see `rank_matches`)."""
    return ["accelerate", "launch", "--multi_gpu", "--num_processes", "3", "--main_process_port", "0",
            "--tee", "3", "--log_dir", str(rank_logs)]


def launcher_args(name: str) -> argparse.Namespace:
    """The arguments `accelerate launch --config_file <name>` (a file of configs/accelerate/) works with, after it
    merged the file in."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    config_file = ROOT / "configs" / "accelerate" / name
    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train_low_mem.py", "train"])
    args, defaults, mixed_precision_from_file = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command does before starting DeepSpeed
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_file else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args


# FSDP2 over 3 processes on the CPU (gloo), as configs/accelerate/fsdp.yaml says; run with FSDP_CPU_ENV.
FSDP_CONFIG = ROOT / "configs" / "accelerate" / "fsdp.yaml"
FSDP_LAUNCHER = ["accelerate", "launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "3",
                 "--main_process_port", "0"]
# No GPU even where the machine has one: this is FSDP on the CPU. One thread per process on a small machine.
FSDP_CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def rank_matches(rank_logs: Path, pattern: str) -> list[str]:
    """Every match of `pattern` in each rank's own stderr file written by `three_cpu_processes`."""
    matches: list[str] = []
    for rank_stderr in sorted(rank_logs.glob("*/attempt_*/*/stderr.log")):
        matches += re.findall(pattern, rank_stderr.read_text())
    return matches


# ----- runs that are stopped and resumed ----------------------------------------------------------------------
STEP_LINE = re.compile(r"step (\d+)/(\d+) \| epoch \d+ \| loss ([\d.]+)")


def resume_overrides(folder: Path, chat_data: tuple[Path, Path], *extra: str) -> list[str]:
    """`tiny_overrides` for resume tests: dropout on, so the random states must be restored too; 2 epochs of 56
    steps (one process), accumulation over 2, a save every 25 steps, a log line every step."""
    return [*tiny_overrides(folder, *chat_data), "--dropout=0.1", "--epochs=2", "--gradient_accumulation_steps=2",
            "--save_steps=25", "--logging_steps=1", "--keep_latest_n_ckp=1", *extra]


def traced_run(folder: Path, chat_data: tuple[Path, Path], env: dict[str, str] | None = None, extra: tuple = (),
               launcher: list[str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """Train to the end with the training trace on; return the finished process and the trace folder."""
    trace = folder / "trace"
    done = run_command(["train", *resume_overrides(folder, chat_data, *extra)], cwd=folder,
                       env={"LOWMEM_TRACE_DIR": str(trace), **(env or {})}, launcher=launcher)
    assert done.returncode == 0, done.stderr[-4000:]
    return done, trace


def traced_losses(trace_dir: Path, rank: int = 0) -> dict[int, float]:
    """The loss of every step the run trained, from a rank's trace."""
    trace = json.loads((trace_dir / f"trace-rank{rank}.json").read_text())
    return {int(step): loss for step, loss in trace["losses"].items()}


def start_run(folder: Path, chat_data: tuple[Path, Path], env: dict[str, str], launcher: list[str] | None = None,
              extra: tuple = ()) -> subprocess.Popen:
    """Start the training command in its own process group (so a kill reaches every rank, as a scheduler's does).
    Without a launcher too, the run is a fork of the worker's fork server where the test allows it: a signal to it
    reaches the run as it would reach a process of its own, and `kill_all` waits for the run to be gone."""
    args = ["train", *resume_overrides(folder, chat_data, *extra)]
    forked = in_process.forked_command(None, str(_script(env)), args) if launcher is None else None
    command = forked or command_line(args, env, launcher)
    return subprocess.Popen(command, cwd=folder, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True, env={**os.environ, **env})


def kill_all(process: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process below it (torch's launcher starts ranks in their own sessions)."""
    import psutil

    parent = psutil.Process(process.pid)
    forked = in_process.forked_for(parent)
    for proc in [*parent.children(recursive=True), parent]:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    process.wait(timeout=60)
    # The processes forked for it end once they see their client gone: waited for, so that what they held (the run's
    # lock) is free for the command that comes next.
    _, alive = psutil.wait_procs(forked, timeout=60)
    assert not alive, f"forked processes still running after their client's kill: {alive}"


def wait_for_step(process: subprocess.Popen, step: int) -> str:
    """Read the run's stderr until it logs `step` (or a later one); return what it logged so far."""
    seen = []
    for line in process.stderr:
        seen.append(line)
        match = STEP_LINE.search(line)
        if match and int(match.group(1)) >= step:
            return "".join(seen)
    raise AssertionError("training ended before the step was reached:\n" + "".join(seen)[-3000:])


def resumed_from(output: str) -> int:
    """The step of the checkpoint a run says it resumed from."""
    match = re.search(r"Resumed from \S*checkpoint-(\d+):", output)
    assert match, output[-3000:]
    return int(match.group(1))


def assert_losses_match(resumed: dict[int, float], reference: dict[int, float], after_step: int) -> None:
    """The resumed run trained every step after `after_step` to the end, each with the reference's loss."""
    assert min(resumed) == after_step + 1 and max(resumed) == max(reference)
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), step


# Preference rows whose preference can be learned: each prompt names a topic, the chosen answer is the row's own
# response (written in that topic's characters) and the rejected one is another row's response, of another topic.
PREFERENCE_TOPICS = {"moon": "月星夜天云", "river": "江河水鱼海", "flower": "花草木春山", "wine": "酒醉梦人楼"}
_FILLER = ["please", "write", "a", "poem", "of", "the", "old", "friend", "in", "night"]


def write_preference_rows(path: Path, rows: int, seed: int, row_group_rows: int = 64) -> Path:
    """`rows` rows of prompt, chosen and rejected (see PREFERENCE_TOPICS), in row groups of `row_group_rows`."""
    import random

    rng = random.Random(seed)
    topics = [rng.choice(list(PREFERENCE_TOPICS)) for _ in range(rows)]
    prompts = [" ".join(rng.choices(_FILLER, k=rng.randint(2, 5))) + f" {topic}" for topic in topics]
    responses = ["".join(rng.choices(PREFERENCE_TOPICS[topic], k=rng.randint(5, 10))) + "。" for topic in topics]
    others = [rng.choice([other for other in range(rows) if topics[other] != topic]) for topic in topics]
    table = {"prompt": prompts, "chosen": responses, "rejected": [responses[other] for other in others]}
    pq.write_table(pa.table(table), path, row_group_size=row_group_rows)
    return path


def preference_project(folder: Path) -> Path:
    """A folder with preference data: data/train.parquet (400 rows) and data/valid.parquet (64 held-out rows)."""
    (folder / "data").mkdir(parents=True)
    write_preference_rows(folder / "data" / "train.parquet", 400, seed=1)
    write_preference_rows(folder / "data" / "valid.parquet", 64, seed=2)
    return folder


def traced_and_stopped_runs(make_project: "Callable[[Path], Path]", folder: Path, flags: list[str],
                            env: dict[str, str], stop_after: int) -> tuple[Path, Path]:
    """(a project that trained `flags` whole with a trace in `trace/`, a project whose same run stopped and saved after
    step `stop_after`): what an exact-resume test compares. `make_project(path)` writes a project's data."""
    reference = make_project(folder / "reference")
    done = run_command(["train", *flags], cwd=reference, env={**env, "LOWMEM_TRACE_DIR": str(reference / "trace")})
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = make_project(folder / "stopped")
    first = run_command(["train", *flags], cwd=stopped, env={**env, "LOWMEM_STOP_AFTER_STEP": str(stop_after)})
    assert first.returncode == 0 and f"at step {stop_after}" in first.stderr, first.stderr[-3000:]
    return reference, stopped
