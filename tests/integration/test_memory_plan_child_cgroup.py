"""The memory budget seen from inside a real memory cgroup: a child process puts itself in a cgroup made for
the test (where it can: root, cgroup v1 or v2 writable) and reads that cgroup's limit as its budget."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lowmem.units import GIB


def _writable_cgroup_root() -> Path | None:
    if os.geteuid() != 0:
        return None
    for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").is_file() and os.access(root, os.W_OK):
            limit_file = "memory.limit_in_bytes" if root.name == "memory" else "memory.max"
            if (root / limit_file).exists() or root.name != "memory":
                return root
    return None


@pytest.mark.skipif(_writable_cgroup_root() is None, reason="needs root and a writable memory cgroup hierarchy")
def test_a_real_child_cgroup_is_seen_from_inside():
    root = _writable_cgroup_root()
    group = root / f"lowmem-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create a cgroup here: {error}")
    try:
        limit_file = group / ("memory.limit_in_bytes" if (group / "memory.limit_in_bytes").exists() else "memory.max")
        limit_file.write_text(str(3 * GIB))
        script = ("import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); "
                  "from lowmem.memory.budget import memory_budget_bytes, budget_source; "
                  "print(memory_budget_bytes(), budget_source())")
        # The child puts itself in the group before it reads anything.
        done = subprocess.run([sys.executable, "-c", script, str(group / "cgroup.procs")], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        detected, source = done.stdout.split(" ", 1)
        assert int(detected) == 3 * GIB
        assert group.name in source
    finally:
        group.rmdir()
