"""Checkpoints: atomic folders with a completeness marker and retention, what a checkpoint holds, exports."""

from lowmem.atomic_files import write_json_atomic
from lowmem.checkpoint.folders import CheckpointManager
from lowmem.checkpoint.layout import MANIFEST_NAME, MARKER_NAME
from lowmem.checkpoint.marker import file_crc32, read_marker, verify_checkpoint

__all__ = ["MANIFEST_NAME", "MARKER_NAME", "CheckpointManager", "file_crc32", "read_marker", "verify_checkpoint",
           "write_json_atomic"]
