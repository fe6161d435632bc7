"""Write WAL images by hand (headers, records, garbage at chosen logical offsets) so recovery
can be tested against exactly the states a crash can leave behind."""
from __future__ import annotations

import os

from storage.wal.format import (HEADER_AREA, RECORD_HEADER_SIZE, WALHeader, body_crc,
                                pack_record_header)


class Image:
    """A preallocated WAL file whose contents the test controls byte by byte."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        self.ring = capacity - HEADER_AREA
        self.counter = 0
        with open(path, "wb") as f:
            f.truncate(capacity)

    def _pwrite(self, data: bytes, pos: int) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.pwrite(fd, data, pos)
            os.fsync(fd)
        finally:
            os.close(fd)

    def header(self, trim: int, window: int, counter: int | None = None,
               slot: int | None = None, capacity: int | None = None, epoch: int = 0) -> None:
        """Write a header copy; by default into the slot its counter selects."""
        if counter is None:
            self.counter += 1
            counter = self.counter
        h = WALHeader(capacity=capacity or self.capacity, trim_offset=trim,
                      window_max_length=window, node_epoch=epoch, write_counter=counter)
        pos = WALHeader.slot_position(counter) if slot is None else slot * 4096
        self._pwrite(h.encode(), pos)

    def record(self, offset: int, body: bytes, stored_offset: int | None = None,
               corrupt_body: bool = False) -> int:
        """Write a record at logical offset; returns the next offset."""
        buf = bytearray(RECORD_HEADER_SIZE + len(body))
        crc = body_crc(body) ^ (1 if corrupt_body else 0)
        pack_record_header(buf, 0, len(body),
                           offset if stored_offset is None else stored_offset, crc)
        buf[RECORD_HEADER_SIZE:] = body
        phys = HEADER_AREA + offset % self.ring
        assert offset % self.ring + len(buf) <= self.ring, "a record never crosses the ring end"
        self._pwrite(bytes(buf), phys)
        return offset + len(buf)

    def fill(self, offset: int, data: bytes) -> None:
        """Raw bytes at a logical offset (garbage, zeros, torn pages)."""
        self._pwrite(data, HEADER_AREA + offset % self.ring)

    def corrupt_slot(self, slot: int) -> None:
        self._pwrite(b"\xff" * 64, slot * 4096 + 8)
