"""Runs lowmem's command line with the test callbacks that LOWMEM_* variables ask for (see fault_injection.py
beside it).

Used like train_low_mem.py, alone or under `accelerate launch`: `python tests/train_with_faults.py train ...`.
"""

import sys

from lowmem.__main__ import main  # first: torch and lowmem imported as by every entry point (lowmem/__main__.py)

from fault_injection import apply_test_overrides, callbacks_from_environment

if __name__ == "__main__":
    apply_test_overrides()
    sys.exit(main(callbacks=callbacks_from_environment()))
