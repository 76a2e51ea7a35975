"""Ranks of a launched command started from one pre-imported parent, for tests where the process's own start is not
under test: each rank of `accelerate launch` is a fork of a server that imported torch and lowmem once, instead of
an interpreter that imports them again (about 2 CPU-seconds a rank on the 2-core machine).

The launcher runs `python -u fork_server.py ADDRESS SCRIPT ARGS...` as each rank (`client`): it hands the server its
arguments, environment, working directory and standard streams, and then stands for the rank: it passes on the
signals it gets (the launcher's SIGTERM, the SIGHUP of a launcher that died) and exits as the rank exited, with its
code or its signal. The forked rank watches the client's connection: a client killed with SIGKILL (a test's kill of
a rank, the launcher's last resort) takes its rank with it. Tests that read what a process is (its memory cgroup, its
parent, its RSS against the plan, the kernel's kill of it) start real processes (`machine`, `own_process`).
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_HEADER = struct.Struct("!Q")
_PR_SET_PDEATHSIG = 1


# --- the client: what the launcher starts as a rank -------------------------------------------------------------


def _read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(1)
        if not chunk:
            return ""
        data += chunk
    return data.decode()


def client(address: str, argv: list[str]) -> None:
    """Have the server fork a rank that runs `argv` (a script and its arguments) as this process would, and exit as
    it exits."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(address)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(connection, [_HEADER.pack(len(request))], [0, 1, 2])
    connection.sendall(request)
    pid = int(_read_line(connection).split()[1])
    for number in FORWARDED:
        signal.signal(number, lambda received, frame: os.kill(pid, received))
    try:  # a launcher that dies is told to its rank as to a real one (lowmem/distributed/launcher_watch.py)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGHUP), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    line = _read_line(connection)
    status = int(line.split()[1]) if line.startswith("exit ") else 1 << 8  # the server went away: a failure
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number != signal.SIGKILL and number != signal.SIGSTOP:  # the others may have a handler here
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


# --- the server: one per test worker ----------------------------------------------------------------------------


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, 3)
    (size,) = _HEADER.unpack(header)
    data = b""
    while len(data) < size:
        data += connection.recv(size - len(data))
    return json.loads(data), fds


def _watch_client(connection: socket.socket) -> None:
    """In the rank: end it at once when its client is gone (killed)."""
    while True:
        try:
            if not connection.recv(1):
                break
        except OSError:
            break
    os.kill(os.getpid(), signal.SIGKILL)


def _run_rank(request: dict, fds: list[int], connection: socket.socket) -> int:
    """In the forked child: become the rank the client asked for, run its script, return its exit code."""
    import runpy

    for number, fd in enumerate(fds):
        os.dup2(fd, number)
        os.close(fd)
    for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(script).resolve().parent)
    threading.Thread(target=_watch_client, args=(connection,), daemon=True, name="fork-server-client").start()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def serve(address: str) -> None:
    """Import what a rank imports, then fork a rank for each client until stdin closes (the test worker is gone)."""
    import accelerate  # noqa: F401
    import torch  # noqa: F401

    import lowmem.cli.commands  # noqa: F401
    import lowmem.train.trainer  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    print("ready", flush=True)
    ranks: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is sys.stdin:
                if not sys.stdin.readline():
                    for connection in ranks.values():
                        connection.close()
                    return
                continue
            connection, _ = listener.accept()
            request, fds = _receive(connection)
            pid = os.fork()
            if pid == 0:  # the rank
                selector.close()
                listener.close()
                for other in ranks.values():
                    other.close()
                code = 1
                try:
                    code = _run_rank(request, fds, connection)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                sys.exit(code)
            for fd in fds:
                os.close(fd)
            connection.sendall(f"pid {pid}\n".encode())
            ranks[pid] = connection
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # for the test times (conftest.py)
            Path(address + ".cpu").write_text(str(usage.ru_utime + usage.ru_stime))
            connection = ranks.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(f"exit {status}\n".encode())
                except OSError:
                    pass
                connection.close()


class ForkServer:
    """The server of this test worker, started on first use and stopped when the worker ends."""

    def __init__(self, folder: Path) -> None:
        self.address = str(folder / "fork-server.sock")
        environment = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen([sys.executable, "-u", __file__, "--serve", self.address],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment, text=True)
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"

    def command(self, launcher: list[str], script: str, args: list[str]) -> list[str]:
        """The launcher's command line with each rank forked by this server."""
        return [*launcher, __file__, self.address, script, *args]

    def children_cpu_seconds(self) -> float:
        """The CPU seconds of the ranks forked and reaped so far."""
        try:
            return float(Path(self.address + ".cpu").read_text() or 0)
        except (OSError, ValueError):
            return 0.0

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1], sys.argv[2:])
