"""WAL exceptions; the engine maps them to back-pressure or storage errors."""


class WALError(Exception):
    """Any failure of the WAL (device, format, state)."""


class OverCapacityError(WALError):
    """The ring is full of untrimmed data: the caller must upload and trim, then retry."""


class CapacityMismatchError(WALError):
    """Configured capacity differs from the header on the device, or the device is too small."""


class FencedError(WALError):
    """The header was written by a newer epoch of this node: another owner took the WAL over."""


class WALClosedError(WALError):
    """append/trim after close(), or the IO path failed and the WAL stopped accepting writes."""


class RecordTooLargeError(WALError, ValueError):
    """A record body exceeds max_record_size or cannot fit in the ring at all."""


class ChecksumMismatchError(WALError):
    """append_loop(check=...): the record's checked range did not have the CRC-32C the caller
    gave. Raised before the record is part of a block: nothing was appended."""


class WALLockedError(WALError):
    """Another process holds the WAL's exclusive lock (a second broker on the same WAL)."""


class WALPathError(WALError):
    """The WAL path cannot be used as given: missing device, a directory, foreign data, no
    space. Nothing was changed on disk when this is raised."""
