"""Progress bars, shown only where someone watches them: on a terminal, and unless `--progress=False`.

Into a pipe or a file (a scheduler's log, `nohup`, `2> run.log`) a bar is a stream of carriage returns
that breaks the log lines around it, so it is off there.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def progress_bar(iterable: Any = None, total: int | None = None, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, disabled (it draws nothing) unless `enabled` and stderr is a terminal.

    Args:
        iterable: what to iterate over, as tqdm's first argument; None for a bar updated by hand.
        total: the number of steps, when `iterable` has no length.
        enabled: False turns the bar off wherever the output goes (`--progress=False`, ranks other than the main one).
        kwargs: tqdm's other arguments (desc, unit, initial, leave, ...).
    """
    stream = sys.stderr
    on_terminal = hasattr(stream, "isatty") and stream.isatty()
    return tqdm(iterable, total=total, file=stream, disable=not (enabled and on_terminal), **kwargs)
