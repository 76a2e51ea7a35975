"""How the user started us, so that usage lines and hints name a command they can paste: `lowmem train ...`
after the installed command or `python -m lowmem`, `python train_low_mem.py train ...` after the script.

Under `accelerate launch`, `sys.argv[0]` is the script's path (or lowmem's `__main__.py` with `-m lowmem`), so
the same rule holds there.
"""

from __future__ import annotations

import os
import sys

SCRIPT = "train_low_mem.py"


def program_name() -> str:
    """`train_low_mem.py` when the script was run, else `lowmem` (the installed command, `python -m lowmem`)."""
    started = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return SCRIPT if started == SCRIPT else "lowmem"


def command_line(rest: str) -> str:
    """The command that runs `rest` (a command and its flags) the way the user started us, e.g.
    "lowmem train --is_keep_training=True" or "python train_low_mem.py train --is_keep_training=True"."""
    name = program_name()
    return f"python {name} {rest}" if name == SCRIPT else f"{name} {rest}"


def launch_line(launcher_options: str, rest: str) -> str:
    """`accelerate launch LAUNCHER_OPTIONS` running `rest` the way the user started us: the script, or `-m lowmem`."""
    target = SCRIPT if program_name() == SCRIPT else "-m lowmem"
    return f"accelerate launch {launcher_options} {target} {rest}"
