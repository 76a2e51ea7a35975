"""Commands' docstrings as fire prints them whole.

fire reads a docstring's `Args:` section line by line: a continuation line that holds a colon is read as the
start of another argument (`without it: ...` becomes an argument `without`) or is cut at the colon (`(needs
matplotlib: pip install ...)` ends at "matplotlib"). An argument written on one line is read whole, whatever
it holds, since fire splits it at its first colon only. So each argument's continuation lines are joined onto
its first line before fire sees the docstring; the source keeps its wrapped lines.
"""

from __future__ import annotations

import re
from typing import Iterable

ARGS_HEADER = re.compile(r"^\s*(Args|Arguments):\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def args_on_one_line(docstring: str) -> str:
    """`docstring` with each argument of its `Args:` section on one line (its wrapped lines joined by spaces)."""
    lines: list[str] = []
    in_args, arg_indent = False, 0
    for line in docstring.split("\n"):
        if ARGS_HEADER.match(line):
            in_args, arg_indent = True, 0
            lines.append(line)
            continue
        if in_args and line.strip():
            if not arg_indent:
                arg_indent = _indent(line)  # the first argument's indent: deeper lines continue an argument
            elif _indent(line) > arg_indent:
                lines[-1] = f"{lines[-1]} {line.strip()}"
                continue
            elif _indent(line) < arg_indent:
                in_args = False  # the next section
        elif in_args:
            in_args = False  # a blank line ends the section
        lines.append(line)
    return "\n".join(lines)


def join_args_of(commands: Iterable[object]) -> None:
    """Rewrite each command's docstring with `args_on_one_line`."""
    for command in commands:
        if command.__doc__:
            command.__doc__ = args_on_one_line(command.__doc__)
