"""Errors a user can cause and fix: each carries a message that says what to do."""


class LowmemError(Exception):
    """Base class for errors caused by user input; the command line prints the message, not a traceback."""


class DataError(LowmemError, ValueError):
    """A data file or path is missing, unreadable or of the wrong shape."""


class DataContentChanged(DataError):
    """A data file holds other rows than when a data position was saved; never taken for a mere change of layout."""


class ConfigError(LowmemError, ValueError):
    """A configuration value or command-line flag is invalid."""


class DiskWriteError(LowmemError, OSError):
    """A write failed for want of space or permission; the message says what was written, where, and what to do."""


class CheckpointError(DiskWriteError):
    """A checkpoint could not be written (disk full, no permission, ...); the message says what to free or change."""


class UnsafeCheckpointError(LowmemError):
    """A checkpoint file asks, when loaded, for code a lowmem checkpoint never holds: nothing of it is loaded."""
