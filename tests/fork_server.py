"""Launched commands started from one pre-imported parent, for tests where the processes' own start is not under
test: `accelerate launch` itself and each of its ranks are forks of a server that imported torch, accelerate,
transformers, torch.compile's front end and lowmem once, instead of interpreters that import them again (2.5 CPU-
seconds for the launcher, 2 to 4 for a rank, on the 2-core machine).

The test runs `python -u fork_server.py ADDRESS --tree ACCELERATE launch ... fork_server.py ADDRESS SCRIPT ARGS...`,
and the forked launcher runs `python -u fork_server.py ADDRESS SCRIPT ARGS...` as each rank. Each of these small
processes is a `client`: it hands the server its arguments, environment, working directory and standard streams, and
then stands for the process forked for it: it passes on the signals it gets (a test's SIGTERM, the launcher's, the
SIGHUP of a launcher that died) and exits as that process exited, with its code or its signal. The forked process
watches its client's connection: a client killed with SIGKILL (a test's kill of a rank, the launcher's last resort)
takes it with it, and a launcher's client (`--tree`) takes the launcher's whole tree, as a test's SIGKILL of every
process below the launcher does. Tests that read what a process is (its memory cgroup, its parent, its RSS against
the plan, the kernel's kill of it) start real processes (`machine`, `own_process`).
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
# The server and what it forks keep the memory they free for their next tensors (glibc's heap only, never trimmed):
# the forked processes are those whose memory no test reads (a test that reads a process's memory starts a real one),
# and on the CI machine's VM a page new to a process costs as much as the work done on it (the host backs it anew and
# the kernel zeroes it): the cuda mirror's file alone (a warm inductor cache) took 129 s instead of 179, 183 CPU-s
# instead of 233.
KEEP_FREED_MEMORY = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


# --- the client: what the launcher starts as a rank -------------------------------------------------------------


def _read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(1)
        if not chunk:
            return ""
        data += chunk
    return data.decode()


def client(address: str, argv: list[str], tree: bool = False) -> None:
    """Have the server fork a process that runs `argv` (a script and its arguments) as this process would, and exit
    as it exits. With `tree`, this client's death (SIGKILL) ends every process below the forked one too."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(address)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "tree": tree}).encode()
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


def client_command(address: str, launcher: list[str] | None, script: str, args: list[str]) -> list[str]:
    """The command line that has the server at `address` fork `script ARGS` (a client stands for it), or, under
    `launcher`, the launcher's command line with each rank forked by the server; `accelerate ...` is forked by it
    too."""
    if launcher is None:
        return [sys.executable, "-u", __file__, address, script, *args]
    ranks = [*launcher, __file__, address, script, *args]
    if launcher[:1] != ["accelerate"]:
        return ranks
    import shutil

    accelerate = shutil.which("accelerate")
    assert accelerate is not None, "the accelerate launcher is not on PATH"
    return [sys.executable, "-u", __file__, address, "--tree", accelerate, *ranks[1:]]


# --- the server: one per test worker ----------------------------------------------------------------------------


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, 3)
    (size,) = _HEADER.unpack(header)
    data = b""
    while len(data) < size:
        data += connection.recv(size - len(data))
    return json.loads(data), fds


def _watch_client(connection: socket.socket, tree: bool) -> None:
    """In the forked process: end it at once when its client is gone (killed), with every process below it when
    `tree` (a launcher: its ranks' clients, whose ranks then go with them)."""
    while True:
        try:
            if not connection.recv(1):
                break
        except OSError:
            break
    if tree:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    os.kill(os.getpid(), signal.SIGKILL)


def _run_rank(request: dict, fds: list[int], connection: socket.socket) -> int:
    """In the forked child: become the process the client asked for, run its script, return its exit code."""
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
    threading.Thread(target=_watch_client, args=(connection, bool(request.get("tree"))), daemon=True,
                     name="fork-server-client").start()
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
    """Import what the launcher and the ranks import, then fork a process for each client until stdin closes (the
    test worker is gone)."""
    import accelerate.commands.launch  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.compile's front end, a second on each rank that compiles)
    import torch._inductor.compile_fx  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401  (the models tests start from)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    import lowmem.cli.commands  # noqa: F401
    import lowmem.train.trainer  # noqa: F401
    from lowmem.memory.collector import freeze_set_up_objects

    # The imported modules' objects out of the collector's walks: a fork's collections would otherwise visit every
    # one of them, writing to each page they lie on and so copying it out of the server (a small training run forked
    # from here: 0.76 CPU-seconds instead of 1.00, half the page faults).
    freeze_set_up_objects()
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
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": KEEP_FREED_MEMORY}
        self.process = subprocess.Popen([sys.executable, "-u", __file__, "--serve", self.address],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment, text=True)
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "ready"

    def command(self, launcher: list[str] | None, script: str, args: list[str]) -> list[str]:
        """The command line (`script ARGS`, under `launcher` if any) with its processes forked by this server."""
        return client_command(self.address, launcher, script, args)

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
    elif sys.argv[2:3] == ["--tree"]:
        client(sys.argv[1], sys.argv[3:], tree=True)
    else:
        client(sys.argv[1], sys.argv[2:])
