"""The command line: `lowmem COMMAND [--flag=value ...]` (also `python train_low_mem.py COMMAND ...`)."""

from lowmem.cli.commands import COMMANDS, main

__all__ = ["COMMANDS", "main"]
