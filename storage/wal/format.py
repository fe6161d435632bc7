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
WAL_VERSION_1 = 1                            # no takeover fields (every WAL before session 11)
WAL_VERSION_2 = 2                            # + takeover state, taker node id and epoch
WAL_VERSION = WAL_VERSION_2                  # the newest version this code reads and writes
SHUTDOWN_UNCLEAN = 0
SHUTDOWN_CLEAN = 1

# takeover_state: who may write this WAL (docs/wal.md "Takeover and fencing")
TAKEOVER_NONE = 0          # its owner (node_id at node_epoch)
TAKEOVER_FENCED = 1        # another node (taken_over_by) is recovering it: nobody appends
TAKEOVER_DONE = 2          # recovered and committed elsewhere; only an explicit re-format
TAKEOVER_STATES = {TAKEOVER_NONE: "none", TAKEOVER_FENCED: "in progress",
                   TAKEOVER_DONE: "done"}

# v1: magic, version, capacity, trim_offset, window_max_length, shutdown, node_id, node_epoch,
# write_counter, crc
_WAL_HDR = struct.Struct(">IHQQQBxIQQ")
# v2: the v1 fields, then takeover_state, taken_over_by (node id), taken_over_epoch; crc
_WAL_HDR_V2 = struct.Struct(">IHQQQBxIQQBxxxIQ")
_CRC = struct.Struct(">I")
WAL_HEADER_SIZE = _WAL_HDR.size + _CRC.size
WAL_HEADER_V2_SIZE = _WAL_HDR_V2.size + _CRC.size
_VERSION_AT = struct.Struct(">IH")

RECORD_MAGIC = 0x52_45_43_31                 # "REC1"
# magic, body_length, logical offset, body crc, header crc (over the first 20 bytes)
_REC_HDR = struct.Struct(">IIQII")
RECORD_HEADER_SIZE = _REC_HDR.size           # 24
_REC_PREFIX = struct.Struct(">IIQI")


def align_up(n: int, a: int = ALIGN) -> int:
    """Round n up to a multiple of a."""
    return (n + a - 1) // a * a


# align_up(n) spelled inline where a call per block or append is worth avoiding:
# (n + ALIGN_MASK) & ALIGN_DOWN
ALIGN_MASK = ALIGN - 1
ALIGN_DOWN = ~ALIGN_MASK


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
    takeover_state: int = TAKEOVER_NONE
    taken_over_by: int = 0
    taken_over_epoch: int = 0

    @property
    def fenced(self) -> bool:
        """True once another node took (or is taking) this WAL over: its owner may not write."""
        return self.takeover_state != TAKEOVER_NONE

    def describe_takeover(self) -> str:
        """One line for errors: who took this WAL over and how far that got."""
        return (f"taken over by node {self.taken_over_by} at epoch {self.taken_over_epoch} "
                f"(takeover {TAKEOVER_STATES.get(self.takeover_state, '?')}); it belonged to "
                f"node {self.node_id} epoch {self.node_epoch}")

    def encode(self) -> bytes:
        """Serialise into one full 4 KiB slot: version 1 while nobody took the WAL over (so
        a WAL that was never taken over stays readable by older code), version 2 otherwise
        (older code then sees no valid header and refuses the WAL: a fence it cannot miss)."""
        if self.takeover_state == TAKEOVER_NONE:
            body = _WAL_HDR.pack(WAL_MAGIC, WAL_VERSION_1, self.capacity, self.trim_offset,
                                 self.window_max_length, self.shutdown_type, self.node_id,
                                 self.node_epoch, self.write_counter)
        else:
            body = _WAL_HDR_V2.pack(WAL_MAGIC, WAL_VERSION_2, self.capacity, self.trim_offset,
                                    self.window_max_length, self.shutdown_type, self.node_id,
                                    self.node_epoch, self.write_counter, self.takeover_state,
                                    self.taken_over_by, self.taken_over_epoch)
        out = body + _CRC.pack(crc32c.crc32c(body))
        return out + bytes(HEADER_SLOT_SIZE - len(out))

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> "WALHeader | None":
        """Parse one slot (version 1 or 2); None when the magic, version or CRC does not
        match."""
        if len(buf) < WAL_HEADER_SIZE:
            return None
        magic, version = _VERSION_AT.unpack_from(buf, 0)
        if magic != WAL_MAGIC:
            return None
        fmt = {WAL_VERSION_1: _WAL_HDR, WAL_VERSION_2: _WAL_HDR_V2}.get(version)
        if fmt is None or len(buf) < fmt.size + _CRC.size:
            return None
        body = bytes(buf[:fmt.size])
        (crc,) = _CRC.unpack_from(buf, fmt.size)
        if crc32c.crc32c(body) != crc:
            return None
        fields = fmt.unpack(body)
        hdr = cls(*fields[2:9])
        if version == WAL_VERSION_2:
            hdr.takeover_state, hdr.taken_over_by, hdr.taken_over_epoch = fields[9:12]
        return hdr

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
