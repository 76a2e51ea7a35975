"""The type check (`mypy lowmem`, with the settings in pyproject.toml) as one of the tests: it runs on one core while
the suite keeps the other busy, instead of before every test as a step of its own (45 s on the 2-core machine)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from training_helpers import ROOT


@pytest.mark.over_a_minute("mypy reads the package and the parts of torch, accelerate and transformers it uses, "
                           "from an empty cache: 45 CPU-seconds alone, more beside the other worker")
@pytest.mark.slow
def test_mypy_finds_no_error_in_the_package():
    done = subprocess.run([sys.executable, "-m", "mypy", "lowmem"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "Success: no issues found" in done.stdout, done.stdout[-3000:]
