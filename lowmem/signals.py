"""Stopping cleanly on SIGINT / SIGTERM: finish the step, save, exit; a second signal exits at once."""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

logger = logging.getLogger(__name__)

# Tests set this to stop after a given optimizer step exactly as a signal arriving during it would.
STOP_AFTER_STEP_ENV = "LOWMEM_STOP_AFTER_STEP"


class GracefulStop:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current optimizer step.

    The training loop shares the request with every rank at the end of each step (in the collective it
    already makes), so all ranks save together and exit. A second signal ends the process at once with
    `os._exit`, touching nothing: an interrupted save leaves only its temporary folder, which the next
    run removes, and the existing checkpoints stay as they were.
    """

    def __init__(self) -> None:
        self.requested_by: str | None = None
        self._stop_after_step = int(os.environ.get(STOP_AFTER_STEP_ENV, "0") or 0)
        self._previous: dict[int, object] = {}

    def install(self) -> "GracefulStop":
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested_by is not None:
            os.write(2, f"\n{name} again: exiting now; checkpoints on disk are left as they are.\n".encode())
            os._exit(128 + signum)
        self.requested_by = name
        logger.warning("%s received: finishing this step, saving a checkpoint, then exiting "
                       "(send it again to exit at once).", name)

    def requested(self, step: int) -> bool:
        """True once a stop was asked for (by a signal, or by the test setting at `step`)."""
        if self._stop_after_step and step >= self._stop_after_step and self.requested_by is None:
            self.requested_by = f"{STOP_AFTER_STEP_ENV}={self._stop_after_step}"
        return self.requested_by is not None
