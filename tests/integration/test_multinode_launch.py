"""Two machines on one: two `accelerate launch` commands of 2 CPU processes each, as on two hosts.

Each "node" is started exactly as on its own host (`--num_machines 2 --machine_rank 0/1 --main_process_ip
127.0.0.1 --main_process_port P`, `--num_processes 4`, the total), and they meet over gloo on localhost.
The run is stopped after a save and resumed, again on two nodes, and must continue exactly: the same
losses (to 1e-6) and rows as an uninterrupted two-node run, every row seen once.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from training_helpers import command_line, tiny_overrides
from training_helpers import workspace as workspace  # a fixture, imported as itself so that pytest finds it here

pytestmark = pytest.mark.slow

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
STEPS, STOP_AT = 8, 5  # 900 rows / 4 ranks: 225 rows per rank, far more than 8 steps' worth: no epoch ends here


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_two_nodes(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 240) -> list[str]:
    """Start both nodes' `accelerate launch` at once; wait for both; return each node's output."""
    port = free_port()
    full_env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", **env}
    nodes = []
    for machine_rank in range(NODES):
        # The launcher and its ranks forked from the test worker's fork server (tests/fork_server.py).
        command = command_line(args, env, launcher=[
            "accelerate", "launch", "--multi_gpu", "--num_machines", str(NODES), "--num_processes", str(WORLD),
            "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)])
        nodes.append(subprocess.Popen(command, cwd=cwd, env=full_env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=timeout)[1])
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
                node.wait()
    for machine_rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {machine_rank} failed:\n{output[-4000:]}"
    return outputs


def overrides(folder: Path, data: tuple[Path, Path], run: str, *extra: str) -> list[str]:
    # One tokenizer for all runs (trained by the first); dropout on, so the random states must be restored too.
    args = [arg for arg in tiny_overrides(folder, *data) if not arg.startswith("--output_dir=")]
    return ["train", *args, f"--output_dir={folder / run}", "--dropout=0.1", f"--max_steps={STEPS}", "--save_steps=4",
            "--logging_steps=1", "--eval_bleu_samples=4", *extra]


def trace(folder: Path, rank: int) -> dict:
    return json.loads((folder / f"trace-rank{rank}.json").read_text())


@pytest.mark.over_a_minute("three launches of two nodes of two processes each: 6 launchers and 12 ranks started")
def test_two_nodes_train_checkpoint_and_resume_exactly(workspace):
    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate launcher is not on PATH")
    folder, data = workspace

    # The uninterrupted two-node run.
    outputs = launch_two_nodes(overrides(folder, data, "reference"), folder,
                               {"LOWMEM_TRACE_DIR": str(folder / "trace-reference")})
    assert "Processes: 4" in outputs[0]
    assert "for 2 process(es)" in outputs[0], "the memory budget is shared by a node's own processes"
    reference = [trace(folder / "trace-reference", rank) for rank in range(WORLD)]
    rows = [row for ranks in reference for row in ranks["rows"]]
    assert len(rows) >= WORLD * STEPS and len(set(rows)) == len(rows), "every row seen once, on one rank"

    # Stopped after step 5 (a clean stop saves on every rank), then resumed on two nodes again.
    run = folder / "resumed"
    launch_two_nodes(overrides(folder, data, "resumed"), folder, {"LOWMEM_STOP_AFTER_STEP": str(STOP_AT)})
    checkpoint = run / f"checkpoint-{STOP_AT}"
    assert (checkpoint / "COMPLETE.json").is_file()
    assert sorted(p.name for p in checkpoint.glob("rank*")) == [f"rank{r}" for r in range(WORLD)], \
        "every rank of both nodes wrote its part into the one checkpoint folder"
    outputs = launch_two_nodes(overrides(folder, data, "resumed", "--is_keep_training=True"), folder,
                               {"LOWMEM_TRACE_DIR": str(folder / "trace-resumed")})
    assert f"Resumed from {checkpoint}: epoch 0, step {STOP_AT}" in outputs[0]

    for rank in range(WORLD):
        got, expected = trace(folder / "trace-resumed", rank), reference[rank]
        # Rows per step vary when rows are packed: the resumed run's rows are the reference's last ones, and the
        # losses below, step by step, show that none was replayed or skipped.
        assert 0 < len(got["rows"]) < len(expected["rows"]), rank
        assert got["rows"] == expected["rows"][-len(got["rows"]):], f"rank {rank}: rows after the resume differ"
        assert got["steps"] == STEPS
    losses = {int(step): loss for step, loss in trace(folder / "trace-resumed", 0)["losses"].items()}
    expected_losses = {int(step): loss for step, loss in reference[0]["losses"].items()}
    assert sorted(losses) == list(range(STOP_AT + 1, STEPS + 1))
    for step, loss in losses.items():
        assert loss == pytest.approx(expected_losses[step], rel=1e-6), step
