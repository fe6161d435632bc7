"""Delta WAL: the durable write buffer in front of the object store (see docs/wal.md)."""
from .config import WALConfig
from .errors import (CapacityMismatchError, ChecksumMismatchError, FencedError, OverCapacityError, RecordTooLargeError,
                     WALClosedError, WALError, WALLockedError, WALPathError)
from .format import RECORD_HEADER_SIZE
from .wal import AppendResult, DeltaWAL

__all__ = [
    "WALConfig", "DeltaWAL", "AppendResult", "OverCapacityError", "WALError",
    "CapacityMismatchError", "FencedError", "RecordTooLargeError", "WALClosedError",
    "RECORD_HEADER_SIZE", "WALLockedError", "WALPathError", "ChecksumMismatchError",
]
