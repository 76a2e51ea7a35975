"""The test workers' fork server (tests/fork_server.py): a rank forked from it runs its script as a process started
for it would (arguments, environment, working directory, standard streams, exit code), its client passes signals
on and exits as the rank did, and a client killed outright takes its rank with it; `accelerate launch` is forked
too, and its client killed outright takes every rank with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from fork_server import ForkServer

SCRIPT = """
import os, signal, sys, time
from pathlib import Path
print("argv", sys.argv[1:], "cwd", os.getcwd(), "variable", os.environ.get("FORK_TEST"), "path", sys.path[0])
print("to stderr", file=sys.stderr)
Path("pid").write_text(str(os.getpid()))
action = sys.argv[1]
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "term":
    signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM received", flush=True), sys.exit(7)))
    Path("ready").write_text("")
    time.sleep(60)
if action == "wait":
    Path("ready").write_text("")
    time.sleep(60)
if action == "rank":  # outlives its launcher's SIGHUP, as a lowmem rank does until its save
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    Path(f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = ForkServer(tmp_path_factory.mktemp("server"))
    yield started
    started.stop()


def _client(server: ForkServer, folder: Path, *args: str) -> subprocess.Popen:
    script = folder / "script.py"
    script.write_text(SCRIPT)
    command = server.command([sys.executable, "-u"], str(script), list(args))
    return subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "FORK_TEST": "seen"})


def _wait_for(path: Path) -> None:
    for _ in range(300):
        if path.exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def test_a_forked_rank_runs_its_script_as_a_process_started_for_it_would(server, tmp_path):
    client = _client(server, tmp_path, "exit", "3")
    out, err = client.communicate(timeout=60)
    assert client.returncode == 3, err
    assert f"argv ['exit', '3'] cwd {tmp_path} variable seen path {tmp_path}" in out
    assert "to stderr" in err
    assert int((tmp_path / "pid").read_text()) != client.pid  # a fork of the server, not the client


def test_the_client_passes_sigterm_on_and_exits_with_the_ranks_code(server, tmp_path):
    client = _client(server, tmp_path, "term")
    _wait_for(tmp_path / "ready")
    client.send_signal(signal.SIGTERM)
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 7 and "SIGTERM received" in out


def test_a_client_killed_outright_takes_its_rank_with_it(server, tmp_path):
    client = _client(server, tmp_path, "wait")
    _wait_for(tmp_path / "ready")
    rank = psutil.Process(int((tmp_path / "pid").read_text()))
    client.kill()
    client.wait(timeout=60)
    rank.wait(timeout=30)  # raises TimeoutExpired while the rank lives on
    assert not psutil.pid_exists(rank.pid) or rank.status() == psutil.STATUS_ZOMBIE


def test_a_rank_killed_by_a_signal_makes_its_client_end_by_that_signal(server, tmp_path):
    client = _client(server, tmp_path, "wait")
    _wait_for(tmp_path / "ready")
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    client.wait(timeout=60)
    assert client.returncode == -signal.SIGKILL


def test_a_forked_launcher_runs_its_ranks_as_forks_and_its_client_killed_takes_them_all(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    launcher = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0"]
    command = server.command(launcher, str(script), ["rank"])
    assert command[:4] == [sys.executable, "-u", str(Path(command[2])), server.address] and command[4] == "--tree"
    client = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "ACCELERATE_USE_CPU": "1"})
    for rank in (0, 1):
        _wait_for(tmp_path / f"pid-{rank}")
    ranks = [psutil.Process(int((tmp_path / f"pid-{rank}").read_text())) for rank in (0, 1)]
    server_pid = server.process.pid
    assert {rank.ppid() for rank in ranks} == {server_pid}  # forks of the server, not interpreters of their own
    # The launcher: the server's other child (a fork too: its command line is the server's).
    launcher_process, = [child for child in psutil.Process(server_pid).children()
                         if child.pid not in {rank.pid for rank in ranks}]
    client.kill()
    client.wait(timeout=60)
    gone, alive = psutil.wait_procs([*ranks, launcher_process], timeout=30)
    assert not alive, [process.pid for process in alive]
