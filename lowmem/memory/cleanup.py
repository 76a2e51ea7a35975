"""Giving memory back to the operating system."""

from __future__ import annotations

import pyarrow as pa


def release_arrow_memory() -> None:
    """Return the Arrow pool's unused memory to the OS.

    Arrow's default allocator (mimalloc or jemalloc) keeps freed blocks for reuse, so RSS stays high
    after a row group is dropped unless the pool is asked to let go. The call is cheap.
    """
    pa.default_memory_pool().release_unused()
