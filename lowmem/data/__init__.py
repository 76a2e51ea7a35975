"""The data layer: parquet streaming, batching and repacking."""

from lowmem.data.loader import StreamLoader
from lowmem.data.stream import ParquetStream

__all__ = ["ParquetStream", "StreamLoader"]
