"""The `lowmem` command line: `python -m lowmem COMMAND ...`, `accelerate launch -m lowmem COMMAND ...`, the installed
`lowmem` command (pyproject.toml's scripts) and `python train_low_mem.py COMMAND ...` all start here."""

import gc
import sys

# Importing torch and lowmem makes about a million objects that live as long as the process. Made with the collector
# off, then frozen out of its walks, they cost no collection pass: 0.55 of a small training run's 4.5 CPU-seconds,
# in every rank of a launch (with the collector only paused, the passes came after the import instead).
gc.disable()
from lowmem.cli import main  # noqa: E402

gc.freeze()
gc.enable()

if __name__ == "__main__":
    sys.exit(main())
