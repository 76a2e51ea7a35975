"""lowmem's command line, the same as the installed `lowmem` command: `python train_low_mem.py COMMAND [--flag=value ...]`.

`python train_low_mem.py --help` lists the commands; `python train_low_mem.py COMMAND --help` documents one.
"""

import sys

from lowmem.__main__ import main  # the command line, imported as lowmem/__main__.py says

if __name__ == "__main__":
    sys.exit(main())
