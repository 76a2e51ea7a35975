"""`python -m lowmem COMMAND ...` (and `accelerate launch -m lowmem COMMAND ...`): the `lowmem` command line."""

import gc
import sys

# Importing torch and lowmem makes about a million objects and next to no garbage: the collector's passes over
# them took a tenth of the import's CPU time (0.15 s a process, in every rank of a launch).
gc.disable()
from lowmem.cli import main  # noqa: E402

gc.enable()

if __name__ == "__main__":
    sys.exit(main())
