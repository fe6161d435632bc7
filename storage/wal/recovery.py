"""Recovery scan: find every intact record from the trim offset on.

Blocks complete out of order, so a crash can leave holes. After the first invalid record the
scan keeps going, 4 KiB boundary by 4 KiB boundary, for the window length recorded in the
header; a valid record found there clears the hole. Stale records from an earlier lap are
rejected because their stored logical offset differs from the position being read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .device import Device, aligned_buffer
from .format import (ALIGN, HEADER_AREA, RECORD_HEADER_SIZE, align_up, body_crc,
                     unpack_record_header)

_CHUNK = 4 << 20


class _RingReader:
    """Reads logical ranges of the ring in large aligned chunks (recovery is sequential)."""

    def __init__(self, device: Device, ring_size: int) -> None:
        self.device = device
        self.ring = ring_size
        self.buf = aligned_buffer(_CHUNK)
        self.lo = -1          # logical offset of buf[0]
        self.hi = -1

    def read(self, logical: int, length: int) -> bytes:
        """Bytes [logical, logical+length) that lie within one lap (callers guarantee it)."""
        if self.lo <= logical and logical + length <= self.hi:
            return bytes(self.buf[logical - self.lo:logical - self.lo + length])
        if length > _CHUNK // 2:
            phys = HEADER_AREA + logical % self.ring
            return self.device.read(phys, length)
        start = logical - logical % ALIGN
        lap_end = (start // self.ring + 1) * self.ring
        n = min(_CHUNK, lap_end - start)
        got = self.device.read_into(memoryview(self.buf)[:n], HEADER_AREA + start % self.ring)
        self.lo, self.hi = start, start + got
        if logical + length > self.hi:
            return b""
        return bytes(self.buf[logical - self.lo:logical - self.lo + length])

    def close(self) -> None:
        self.buf.close()


@dataclass
class RecoveryResult:
    records: list[tuple[int, bytes]] = field(default_factory=list)
    end_offset: int = 0          # where new appends may start (after every recovered record)
    invalid_skipped: int = 0     # 4 KiB steps taken over holes / garbage (diagnostics)


def scan(device: Device, ring_size: int, trim_offset: int, window: int,
         max_record_size: int) -> RecoveryResult:
    """Scan from trim_offset; see module docstring for the rules."""
    reader = _RingReader(device, ring_size)
    result = RecoveryResult(end_offset=align_up(trim_offset))
    pos = trim_offset
    limit = trim_offset + ring_size           # never read past one full lap of live data
    first_invalid: int | None = None
    try:
        while pos < limit:
            if first_invalid is not None and pos >= first_invalid + window:
                break
            in_lap = pos % ring_size
            valid = False
            if ring_size - in_lap >= RECORD_HEADER_SIZE:
                raw = reader.read(pos, RECORD_HEADER_SIZE)
                hdr = unpack_record_header(raw) if len(raw) == RECORD_HEADER_SIZE else None
                if hdr is not None:
                    length, offset, crc = hdr
                    end = pos + RECORD_HEADER_SIZE + length
                    if (offset == pos and length <= max_record_size
                            and in_lap + RECORD_HEADER_SIZE + length <= ring_size
                            and end <= limit):
                        body = reader.read(pos + RECORD_HEADER_SIZE, length)
                        if len(body) == length and body_crc(body) == crc:
                            result.records.append((pos, body))
                            pos = end
                            result.end_offset = align_up(end)
                            first_invalid = None
                            valid = True
            if not valid:
                if first_invalid is None:
                    first_invalid = pos
                result.invalid_skipped += 1
                pos = align_up(pos + 1)
    finally:
        reader.close()
    return result
