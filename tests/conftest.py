"""How the suite runs (two xdist workers, the machine-wide tests one at a time on one of them, commands in the test's
process and `accelerate launch` and its ranks forked from a pre-imported server unless a test is marked `own_process`
or `machine`, a budget per test, each test's times on request) and shared test helpers: small generated parquet
files.

pytest puts this folder on the import path (its conftest.py, in a folder that is no package): the helper modules
beside it (training_helpers.py, trainer_fixtures.py, data_helpers.py, ...) are what tests/unit/ and
tests/integration/ share. A test file never imports another (tests/unit/test_architecture.py checks it)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# Inductor compiles in the process that compiles, not in a pool of worker processes of its own: each pool's
# processes import torch (a few CPU-seconds each, one per core, in every compiling rank), more than a test's few
# small graphs gain from them. Set before torch is imported here or in a command the tests start, which inherit it;
# tests/unit/test_performance.py takes it out where it checks torch's default.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The C++ inductor generates for the CPU is compiled without SIMD (scalar loops instead of AVX2 vectors): what the
# compile tests check (the graphs, recompiles and breaks, the caches, the eager run's losses) does not depend on it,
# and on the 2-core machine the vectorised kernels took a third longer to compile (the compiled-training test: 87
# CPU-seconds from an empty cache, 65 without SIMD). A GPU runs the Triton kernels inductor writes for it, not these.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# And each compiled graph is one C++ file and one compiler run, its kernels and the code that calls them together
# (inductor's C++ wrapper), instead of a compiler run for each kernel behind a Python wrapper: each run of g++ first
# loads a 132 MB precompiled header (0.36 of its 0.5 CPU-seconds). The CUDA mirror and compiled-training tests: 290
# CPU-seconds from an empty cache, 259 with it (169 compiler runs, 35 with it). The wrapper is inductor's code, not
# lowmem's; the graphs, their recompiles and the losses the tests check are the same.
os.environ.setdefault("TORCHINDUCTOR_CPP_WRAPPER", "1")

# Tests that read or change state the whole machine shares (memory cgroups, the kernel's OOM-kill count, processes
# killed while another run could be labelled by that count) run one after another on one pytest-xdist worker. They are
# marked `machine`, and named here too: xdist's scheduler sees only test ids (its own `xdist_group` does not reach it
# under pytest 9), so the scheduler below groups by these names; collection checks that the two agree.
MACHINE_GROUP = "machine"
MACHINE_TESTS = (
    "tests/integration/test_sharded_half_billion_runs.py::",
    "tests/integration/test_rank_death.py::",
    "tests/integration/test_resume_runs.py::test_sigkill_of_the_launcher_alone_stops_every_worker_after_a_save",
    "tests/integration/test_resume_runs.py::test_sigkill_of_one_worker_ends_the_others_and_the_resume_is_exact",
)
# The tests of a module run on one worker, where the module's fixtures (a reference run, a trained run folder, a model
# written once) are made once: handed out test by test, each worker that got one of its tests made them again. The
# modules named here are handed out test by test all the same: long tests that share nothing costly, which keep the
# two workers' loads even. test_resume_runs.py's other tests join the machine-wide tests, with which they share the
# module's three-process reference run.
SPLIT_MODULES = (
    "tests/integration/test_cuda_mirror.py",
    "tests/integration/test_gpu_check_command.py",
    "tests/integration/test_plan_accuracy.py",
    "tests/integration/test_preference_training.py",
)
WITH_THE_MACHINE_TESTS = ("tests/integration/test_resume_runs.py",)
# A test's budget: longer (its call, on the 2-core machine CI runs on) only with a reason beside it,
# `@pytest.mark.over_a_minute("why it cannot be cheaper")`. The summary after the durations lists every test over it
# (LOWMEM_TEST_BUDGET_SECONDS sets another budget for that list).
BUDGET_SECONDS = float(os.environ.get("LOWMEM_TEST_BUDGET_SECONDS", "60"))


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _write_byte_code()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two workers on two cores: one compute thread each, in the worker and in the commands it starts, or the
        # threads of both wait on each other (results are unchanged: every process of a test computes alike).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _write_byte_code() -> None:
    """The suite's processes write the byte-code of what they import, even where the environment asks Python not to
    (PYTHONDONTWRITEBYTECODE, as on CI's machine): the README's test command installs with `pip install
    --no-compile`, so that nothing compiles the thousands of modules no test imports (about 45 s of the install),
    and the first process that imports a module compiles it for the hundreds the suite starts after it (torch,
    lowmem and transformers from source: about 17 s a process instead of 7). Set in the controller, before the
    workers start: they and every command they run inherit it."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


# The environment once the tests are collected (the helper modules set what they need on import): what a test (or a
# library it calls in this process) leaves in os.environ is taken out after it, so that the commands a later test
# starts do not inherit it.
_SESSION_ENVIRONMENT: dict[str, str] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    _SESSION_ENVIRONMENT.update(os.environ)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _SESSION_ENVIRONMENT and os.environ != _SESSION_ENVIRONMENT:
        os.environ.clear()
        os.environ.update(_SESSION_ENVIRONMENT)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` (pyproject.toml's addopts): each module is a unit (SPLIT_MODULES: each test), and the
    machine-wide tests are one unit, run in order on one worker."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class MachineTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if nodeid.startswith(MACHINE_TESTS) or module in WITH_THE_MACHINE_TESTS:
                return MACHINE_GROUP
            return nodeid if module in SPLIT_MODULES else module

    return MachineTestsTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The machine-wide tests are marked as MACHINE_TESTS names them; they and the slow tests go first, so that the
    long ones do not start last while the other worker has nothing left to do."""
    for item in items:
        if (item.get_closest_marker("machine") is not None) != item.nodeid.startswith(MACHINE_TESTS):
            raise pytest.UsageError(f"{item.nodeid}: marked `machine` but not in conftest.py's MACHINE_TESTS, or the "
                                    "other way round: name it in both or in neither")
        long = item.get_closest_marker("over_a_minute")
        if long is not None:  # on the report, which reaches the summary from an xdist worker too
            item.user_properties.append(("over_a_minute", long.args[0]))
    # The machine-wide tests (the longest unit of work, one worker's) first, then the slow ones; stable: the files'
    # order otherwise.
    items.sort(key=lambda item: 0 if item.nodeid.startswith(MACHINE_TESTS) else 1 if item.get_closest_marker("slow")
               else 2)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures: a module's fixture runs its commands for it
def pytest_runtest_setup(item: pytest.Item) -> None:
    """`training_helpers.run_command` runs a command without a launcher in this process, unless the test is marked
    `own_process`."""
    import in_process

    in_process.OWN_PROCESS = item.get_closest_marker("own_process") is not None
    in_process.REAL_PROCESSES = in_process.OWN_PROCESS or item.get_closest_marker("machine") is not None


def pytest_sessionfinish(session: pytest.Session) -> None:
    import in_process

    in_process.stop_fork_server()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With LOWMEM_TEST_TIMES=PATH, a JSON line per test: its wall seconds and the CPU seconds of the test's
    process and of the commands it waited for (what to trim; the worker's share of a core is wall / CPU)."""
    import in_process

    path = os.environ.get("LOWMEM_TEST_TIMES")
    if not path:
        return (yield)
    wall, own, children = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF), \
        resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = in_process.forked_cpu_seconds()
    try:
        return (yield)
    finally:
        own_after, children_after = resource.getrusage(resource.RUSAGE_SELF), \
            resource.getrusage(resource.RUSAGE_CHILDREN)
        # The launchers and ranks the fork server forked are its children, not this process's: it counts their CPU.
        record = {"test": item.nodeid, "wall": round(time.monotonic() - wall, 2),
                  "cpu": round(own_after.ru_utime + own_after.ru_stime - own.ru_utime - own.ru_stime, 2),
                  "children_cpu": round(children_after.ru_utime + children_after.ru_stime - children.ru_utime
                                        - children.ru_stime + in_process.forked_cpu_seconds() - forked, 2)}
        with open(path, "a") as log:
            log.write(json.dumps(record) + "\n")


def write_rows(path: Path, ids: list[str], row_group_rows: int, **extra_columns) -> Path:
    """Write rows whose prompt is `id` and response `r:id` (plus any extra columns)."""
    table = pa.table({"prompt": ids, "response": [f"r:{i}" for i in ids], **extra_columns})
    pq.write_table(table, path, row_group_size=row_group_rows)
    return path


@pytest.fixture
def three_files(tmp_path: Path) -> list[Path]:
    """Three files with different row-group sizes, each with a short last row group: 3,278 rows."""
    specs = [("a", 1000, 100), ("b", 777, 64), ("c", 1501, 250)]
    return [
        write_rows(tmp_path / f"{name}.parquet", [f"{name}{i}" for i in range(rows)], group)
        for name, rows, group in specs
    ]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Every test whose call took over BUDGET_SECONDS, with the reason written beside it, or a request for one: what
    review reads (no test asserts its own time)."""
    over = sorted(((report.duration, report.nodeid, dict(report.user_properties).get("over_a_minute"))
                   for stat in ("passed", "failed") for report in terminalreporter.stats.get(stat, [])
                   if report.when == "call" and report.duration > BUDGET_SECONDS), reverse=True)
    if not over:
        return
    terminalreporter.section(f"tests over {BUDGET_SECONDS:.0f} s")
    for seconds, nodeid, reason in over:
        terminalreporter.write_line(f"{seconds:6.0f} s {nodeid}: " + (reason or "NO REASON GIVEN: make it cheaper, or "
                                                                          "give the reason (over_a_minute)"))
