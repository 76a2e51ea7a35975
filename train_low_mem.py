"""lowmem's command line, the same as the installed `lowmem` command: `python train_low_mem.py COMMAND [--flag=value ...]`.

`python train_low_mem.py --help` lists the commands; `python train_low_mem.py COMMAND --help` documents one.
"""

import gc
import sys

# Importing torch and lowmem makes about a million objects and next to no garbage: the collector's passes over
# them took a tenth of the import's CPU time (0.15 s a process, in every rank of a launch).
gc.disable()
from lowmem.cli import main  # noqa: E402

gc.enable()

if __name__ == "__main__":
    sys.exit(main())
