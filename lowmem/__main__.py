"""`python -m lowmem COMMAND ...` (and `accelerate launch -m lowmem COMMAND ...`): the `lowmem` command line."""

import sys

from lowmem.cli import main

if __name__ == "__main__":
    sys.exit(main())
