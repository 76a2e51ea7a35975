"""The type check (`mypy lowmem`, with the settings in pyproject.toml) as one of the tests: it runs on one core while
the suite keeps the other busy, instead of before every test as a step of its own (19 CPU-seconds from an empty cache
on the 2-core machine, with transformers and peft not followed: pyproject.toml says why)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from training_helpers import ROOT


@pytest.mark.slow
def test_mypy_finds_no_error_in_the_package():
    done = subprocess.run([sys.executable, "-m", "mypy", "lowmem"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "Success: no issues found" in done.stdout, done.stdout[-3000:]
