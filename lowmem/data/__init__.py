"""The data layer: parquet streaming, batching and repacking."""

from lowmem.data.loader import StreamLoader
from lowmem.data.mixture import MixedStream  # also registers how mixtures' saved states merge
from lowmem.data.stream import ParquetStream

__all__ = ["MixedStream", "ParquetStream", "StreamLoader"]
