"""`lowmem gpu_check` and `lowmem gpu_bundle` run as commands where there is no GPU: `--device=cpu` runs every
stage, reduced; unknown stages and foreign folders are refused in one line; the bundle's wheels install
without network over the machine's own packages and run the check."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import in_process
import pytest
from run_outputs import check_results

FORKED_GPU_CHECK = Path(__file__).parents[1] / "forked_gpu_check.py"
STAGE_NAMES = ["environment", "source_logits", "dpo_compile", "flex_attention", "fsdp_dpo", "pinned_copy",
               "trainer_dpo", "fused_clip", "ddp_hook", "copy_reference", "train", "bench", "speed", "parallel",
               "memory_log"]


def gpu_check(folder: Path, *flags: str, forked: bool = False) -> subprocess.CompletedProcess:
    """`python -m lowmem gpu_check --device=cpu ...`; `forked`: the check and the commands it starts are forks of the
    worker's fork server (forked_gpu_check.py), not interpreters of their own."""
    args = ["gpu_check", "--device=cpu", f"--folder={folder / 'check'}", *flags]
    server = in_process.fork_server() if forked else None
    command = ([sys.executable, "-m", "lowmem", *args] if server is None
               else server.command(None, str(FORKED_GPU_CHECK), [server.address, *args]))
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=1200)


@pytest.mark.over_a_minute("the 15 stages of the GPU script, each a short run of its own, several under a launcher")
@pytest.mark.slow
def test_every_stage_passes_on_the_cpu(tmp_path):
    done = gpu_check(tmp_path, forked=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("gpu_check [")]
    assert [line.split("] ", 1)[1].split(":")[0] for line in lines] == STAGE_NAMES
    # Every stage passes but the one that needs a GPU, which says so.
    assert all(": PASS (" in line for line in lines if "pinned_copy" not in line), lines
    by_stage = {record["stage"]: record for record in check_results(tmp_path)}
    assert by_stage.pop("pinned_copy")["verdict"] == "SKIP"
    assert all(record["verdict"] == "PASS" and record["device"] == "cpu" for record in by_stage.values())
    assert by_stage["source_logits"]["figures"]["largest_logit_difference"] <= 1e-4
    compiled = by_stage["dpo_compile"]["figures"]
    assert compiled["graph_breaks"] == 0 and max(compiled["policy_graphs"], compiled["reference_graphs"]) <= 3
    assert by_stage["flex_attention"]["figures"]["largest_loss_difference"] <= 1e-4
    fsdp = by_stage["fsdp_dpo"]["figures"]
    assert abs(fsdp["step_0_loss"] - math.log(2)) <= 1e-4 and fsdp["adapters_with_gradients"] > 0
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(by_stage["trainer_dpo"]["figures"]["peft_files"])
    assert by_stage["fused_clip"]["figures"]["nan_step_skipped"] is True
    assert by_stage["ddp_hook"]["figures"]["largest_difference_from_bf16_rounding"] == 0
    assert by_stage["copy_reference"]["figures"]["largest_difference"] <= 1e-4
    train = by_stage["train"]["figures"]
    assert train["precision"] == "bf16" and train["resumed_from"] == 50 and train["killed_at_step"] == 51
    assert train["largest_relative_difference"] <= 1e-6
    bench = by_stage["bench"]["figures"]
    assert {"eager", "compiled"} <= bench.keys() and "(a) batches in memory (ceiling)" in bench["eager"]["phases"]
    speed = by_stage["speed"]["figures"]
    assert speed["users_command_tokens_per_s"] > 0 and speed["users_command_shapes"]  # fixed shapes were on
    assert speed["attention_vs_causal"]["causal (the floor)"] == 1.0
    assert "packed rows, sdpa with a mask" in speed["attention_vs_causal"]
    parallel = by_stage["parallel"]["figures"]
    assert parallel["ddp"]["resumed_from"] == 3 and "DDP" in parallel["ddp"]["strategy"]
    assert parallel["fsdp"]["resumed_from"] == 3 and "FSDP2" in parallel["fsdp"]["strategy"]
    assert parallel["deepspeed"].startswith("skipped: ")
    assert by_stage["memory_log"]["figures"]["rank0"]["verdict"] == "FLAT"
    assert by_stage["environment"]["figures"]["torch"]


def test_unknown_stages_and_foreign_folders_are_refused_in_one_line(tmp_path):
    done = gpu_check(tmp_path, "--stages=train,warp")
    assert done.returncode == 2 and "Unknown stage warp" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "check").mkdir()
    (tmp_path / "check" / "notes.txt").write_text("mine")
    done = gpu_check(tmp_path, "--stages=environment")
    assert done.returncode == 2 and "not a gpu_check's" in done.stderr
    assert (tmp_path / "check" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_the_bundle_installs_without_network_over_the_machine_packages_and_runs(tmp_path):
    built = subprocess.run([sys.executable, "-m", "lowmem", "gpu_bundle", f"--out={tmp_path / 'bundle'}"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheels = sorted(path.name.split("-")[0] for path in (tmp_path / "bundle").glob("*.whl"))
    assert wheels == ["fire", "lowmem", "termcolor"]
    assert sum(path.stat().st_size for path in (tmp_path / "bundle").iterdir()) < 30e6  # it has to be carried

    # A fresh environment that sees this one's packages (torch, pyarrow, ...) as a GPU machine sees its image's.
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=300)
    python = fresh / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "machine_image.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run(["bash", str(tmp_path / "bundle" / "install_and_check.sh"), "--device=cpu",
                           "--stages=environment", f"--folder={tmp_path / 'check'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": str(python), "PIP_NO_INDEX": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "environment: PASS" in done.stdout
    where = subprocess.run([python, "-c", "import fire, lowmem; print(lowmem.__file__); print(fire.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert all(path.startswith(str(fresh)) for path in where), where  # the bundle's copies, not this machine's
    helped = subprocess.run([fresh / "bin" / "lowmem", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert helped.returncode == 0 and "gpu_check" in helped.stdout + helped.stderr
