"""Runs lowmem's command line with the test callbacks that LOWMEM_* variables ask for (see fault_injection.py
beside it).

Used like train_low_mem.py, alone or under `accelerate launch`: `python tests/train_with_faults.py train ...`.
"""

import sys

from fault_injection import (callbacks_from_environment, override_base_memory, override_memory_budget,
                             override_plan_device)

from lowmem.cli import main

if __name__ == "__main__":
    override_memory_budget()
    override_base_memory()
    override_plan_device()
    sys.exit(main(callbacks=callbacks_from_environment()))
