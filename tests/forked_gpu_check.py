"""`lowmem gpu_check` whose commands are forks of the test worker's fork server (fork_server.py) instead of new
interpreters: `forked_gpu_check.py ADDRESS gpu_check [--flag=value ...]`, itself forked by that server.

A check on the CPU starts about twenty commands (each stage's `train`, `bench_train` and `dpo_reference` runs, and the
launchers and ranks of its parallel ones), each paying 2.5 to 3 CPU-seconds to import torch before it does anything.
What the test checks is what the stages do with those commands: their runs, kills, resumes and logs. The check's own
command line and its one-line refusals run as real processes in the other gpu_check tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fork_server import client_command

import lowmem.gpucheck.paths
import lowmem.gpucheck.stages
from lowmem.cli import main

SCRIPT = str(Path(__file__).resolve().parents[1] / "train_low_mem.py")  # lowmem's command line, as `-m lowmem`


def forked_lowmem_command(address: str):
    """`lowmem.gpucheck.runs.lowmem_command` with the command (and, under a launcher, the launcher and each rank)
    forked by the server at `address`."""
    def command(args: list[str], launcher: list[str] | None = None) -> list[str]:
        return client_command(address, None if launcher is None else ["accelerate", "launch", *launcher], SCRIPT,
                              args)
    return command


if __name__ == "__main__":
    address, arguments = sys.argv[1], sys.argv[2:]
    for module in (lowmem.gpucheck.paths, lowmem.gpucheck.stages):  # where the stages took the name from
        module.lowmem_command = forked_lowmem_command(address)  # type: ignore[attr-defined]
    sys.exit(main(arguments))
