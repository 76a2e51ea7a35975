"""Stopping cleanly on SIGINT / SIGTERM (or the launcher's end): finish the step, save, exit; a second signal
exits at once."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any
from types import FrameType

from lowmem.distributed.launcher_watch import LAUNCHER_GONE_SIGNAL, launcher_watched

logger = logging.getLogger(__name__)


class GracefulStop:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current optimizer step.

    `request(reason)` asks for the same stop from code (a callback, a time limit). The training loop shares
    the request with every rank at the end of each step (in the collective it already makes), so all ranks
    save together and exit. A second signal ends the process at once with
    `os._exit`, touching nothing: an interrupted save leaves only its temporary folder, which the next
    run removes, and the existing checkpoints stay as they were.
    """

    def __init__(self) -> None:
        self.requested_by: str | None = None
        self._previous: dict[int, Any] = {}  # the handlers found, as signal.signal returned them

    def install(self) -> "GracefulStop":
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        if launcher_watched():
            # The launcher's death arrives as SIGHUP, once per thread of this process: each is the same request.
            self._previous[LAUNCHER_GONE_SIGNAL] = signal.signal(LAUNCHER_GONE_SIGNAL, self._launcher_gone)
        return self

    def _launcher_gone(self, signum: int, frame: FrameType | None) -> None:
        if self.requested_by is None:
            self.requested_by = "the launcher's end"
            logger.warning("The launcher is gone: finishing this step, saving a checkpoint, then exiting.")

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

    def request(self, reason: str) -> None:
        """Ask for a stop after the current step, as a signal would; `reason` is what the log names."""
        if self.requested_by is None:
            self.requested_by = reason

    @property
    def requested(self) -> bool:
        """True once a stop was asked for, by a signal or by `request`."""
        return self.requested_by is not None
