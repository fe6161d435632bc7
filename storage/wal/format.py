"""On-disk layout: the WAL header (two 4 KiB slots) and the per-record header.

Everything is big-endian and protected by CRC-32C. The newest header copy is chosen by a
monotonic write counter, never by a clock, so it stays correct across reboots and hosts.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c

ALIGN = 4096
HEADER_SLOT_SIZE = 4096
HEADER_AREA = 2 * HEADER_SLOT_SIZE          # the ring starts after both slots

WAL_MAGIC = 0x53_4B_57_4C                    # "SKWL"
WAL_VERSION = 1
SHUTDOWN_UNCLEAN = 0
SHUTDOWN_CLEAN = 1

# magic, version, capacity, trim_offset, window_max_length, shutdown, node_id, node_epoch,
# write_counter, crc
_WAL_HDR = struct.Struct(">IHQQQBxIQQ")
_CRC = struct.Struct(">I")
WAL_HEADER_SIZE = _WAL_HDR.size + _CRC.size

RECORD_MAGIC = 0x52_45_43_31                 # "REC1"
# magic, body_length, logical offset, body crc, header crc (over the first 20 bytes)
_REC_HDR = struct.Struct(">IIQII")
RECORD_HEADER_SIZE = _REC_HDR.size           # 24
_REC_PREFIX = struct.Struct(">IIQI")


def align_up(n: int, a: int = ALIGN) -> int:
    """Round n up to a multiple of a."""
    return (n + a - 1) // a * a


@dataclass
class WALHeader:
    """The durable facts recovery needs: where live data starts and how far holes may reach."""

    capacity: int
    trim_offset: int = 0
    window_max_length: int = 0
    shutdown_type: int = SHUTDOWN_UNCLEAN
    node_id: int = 0
    node_epoch: int = 0
    write_counter: int = 0

    def encode(self) -> bytes:
        """Serialise into one full 4 KiB slot."""
        body = _WAL_HDR.pack(WAL_MAGIC, WAL_VERSION, self.capacity, self.trim_offset,
                             self.window_max_length, self.shutdown_type, self.node_id,
                             self.node_epoch, self.write_counter)
        out = body + _CRC.pack(crc32c.crc32c(body))
        return out + bytes(HEADER_SLOT_SIZE - len(out))

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> "WALHeader | None":
        """Parse one slot; None when the magic, version or CRC does not match."""
        if len(buf) < WAL_HEADER_SIZE:
            return None
        body = bytes(buf[:_WAL_HDR.size])
        (crc,) = _CRC.unpack_from(buf, _WAL_HDR.size)
        if crc32c.crc32c(body) != crc:
            return None
        (magic, version, capacity, trim, window, shutdown, node_id, epoch,
         counter) = _WAL_HDR.unpack(body)
        if magic != WAL_MAGIC or version != WAL_VERSION:
            return None
        return cls(capacity, trim, window, shutdown, node_id, epoch, counter)

    @staticmethod
    def slot_position(write_counter: int) -> int:
        """Copies alternate between the slots by counter parity, so a torn write keeps the other."""
        return (write_counter % 2) * HEADER_SLOT_SIZE


def newest_header(slot0: bytes | memoryview, slot1: bytes | memoryview) -> WALHeader | None:
    """Pick the valid copy with the highest write counter."""
    valid = [h for h in (WALHeader.decode(slot0), WALHeader.decode(slot1)) if h is not None]
    if not valid:
        return None
    return max(valid, key=lambda h: h.write_counter)


def pack_record_header(buf, pos: int, body_length: int, offset: int, body_crc: int) -> None:
    """Write a record header into buf at pos (in place, no temporary copies of the body)."""
    prefix = _REC_PREFIX.pack(RECORD_MAGIC, body_length, offset, body_crc)
    _REC_HDR.pack_into(buf, pos, RECORD_MAGIC, body_length, offset, body_crc,
                       crc32c.crc32c(prefix))


def unpack_record_header(buf, pos: int = 0) -> tuple[int, int, int] | None:
    """Return (body_length, offset, body_crc) when the header at pos is intact, else None."""
    magic, length, offset, body_crc, hcrc = _REC_HDR.unpack_from(buf, pos)
    if magic != RECORD_MAGIC:
        return None
    if crc32c.crc32c(bytes(buf[pos:pos + 20])) != hcrc:
        return None
    return length, offset, body_crc


def body_crc(body) -> int:
    """CRC-32C of a record body."""
    return crc32c.crc32c(body)
