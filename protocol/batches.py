"""Record batches (magic 2) read in place: header view, CRC-32C validation, offset and
timestamp rewrites.  Records are never decoded here except where a caller asks for it
(:func:`fill_max_timestamp`, :func:`record_timestamps`).

Batch header layout (61 bytes): baseOffset i64 | batchLength i32 | partitionLeaderEpoch i32 |
magic i8 | crc u32 | attributes i16 | lastOffsetDelta i32 | baseTimestamp i64 |
maxTimestamp i64 | producerId i64 | producerEpoch i16 | baseSequence i32 | recordCount i32.
The CRC-32C covers everything from attributes (byte 21) to the end of the batch, so the base
offset and leader epoch can be rewritten without recomputing it.
"""
from __future__ import annotations

import struct
from typing import Iterator

import crc32c

from .errors import CorruptRecordError

HEADER_SIZE = 61
LOG_OVERHEAD = 12  # baseOffset + batchLength: bytes not counted in batchLength
MIN_BATCH_LENGTH = HEADER_SIZE - LOG_OVERHEAD
CRC_START = 21
_HEADER = struct.Struct(">qiibIhiqqqhii")
_I64 = struct.Struct(">q")
_U32 = struct.Struct(">I")
_I16 = struct.Struct(">h")

COMPRESSION_MASK = 0x07
TIMESTAMP_TYPE_MASK = 0x08
TRANSACTIONAL_MASK = 0x10
CONTROL_MASK = 0x20
DELETE_HORIZON_MASK = 0x40
NO_TIMESTAMP = -1
Buffer = bytes | bytearray | memoryview


class BatchView:
    """Header fields of one v2 batch at ``pos`` of ``buf`` (decoded once, read many)."""

    __slots__ = ("buf", "pos", "base_offset", "length", "partition_leader_epoch", "magic",
                 "crc", "attributes", "last_offset_delta", "base_timestamp", "max_timestamp",
                 "producer_id", "producer_epoch", "base_sequence", "record_count")

    def __init__(self, buf: Buffer, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos
        if len(buf) - pos < HEADER_SIZE:
            raise CorruptRecordError(f"record batch header truncated at {pos}")
        (self.base_offset, self.length, self.partition_leader_epoch, self.magic, self.crc,
         self.attributes, self.last_offset_delta, self.base_timestamp, self.max_timestamp,
         self.producer_id, self.producer_epoch, self.base_sequence,
         self.record_count) = _HEADER.unpack_from(buf, pos)

    @property
    def size(self) -> int:
        """Total bytes of the batch including the 12-byte log overhead."""
        return self.length + LOG_OVERHEAD

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.last_offset_delta + 1

    @property
    def compression(self) -> int:
        return self.attributes & COMPRESSION_MASK

    @property
    def timestamp_type(self) -> int:
        """0 = CreateTime, 1 = LogAppendTime."""
        return 1 if self.attributes & TIMESTAMP_TYPE_MASK else 0

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & TRANSACTIONAL_MASK)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & CONTROL_MASK)

    def records_view(self) -> memoryview:
        """The (possibly compressed) record bytes after the header, not copied."""
        return memoryview(self.buf)[self.pos + HEADER_SIZE:self.pos + self.size]

    def __repr__(self) -> str:
        return (f"BatchView(base_offset={self.base_offset}, length={self.length}, "
                f"magic={self.magic}, records={self.record_count}, "
                f"compression={self.compression}, attributes={self.attributes:#x})")


def iter_batches(buf: Buffer) -> Iterator[BatchView]:
    """Split a payload of v2 batches; CorruptRecordError on partial batches or bad lengths.

    Only sizes and magic are checked here; call :func:`validate_batch` for the CRC.
    """
    end = len(buf)
    pos = 0
    while pos < end:
        if end - pos < HEADER_SIZE:
            raise CorruptRecordError(f"{end - pos} trailing bytes are not a record batch")
        view = BatchView(buf, pos)
        if view.magic != 2:
            raise CorruptRecordError(f"record batch magic {view.magic} where 2 was expected")
        if view.length < MIN_BATCH_LENGTH or pos + view.size > end:
            raise CorruptRecordError(f"record batch length {view.length} at {pos} is invalid")
        yield view
        pos += view.size


_LENGTH_MAGIC = struct.Struct(">i4xb")     # batchLength, (partitionLeaderEpoch), magic
_LAST_DELTA = struct.Struct(">i")            # lastOffsetDelta, at 23


def count_offsets(buf: Buffer) -> int:
    """The offsets a payload of v2 batches takes (the sum of lastOffsetDelta + 1), with
    exactly :func:`iter_batches`' checks and errors but no BatchView per batch (the count of
    each request of a produce run)."""
    end = len(buf)
    pos = 0
    n = 0
    while pos < end:
        if end - pos < HEADER_SIZE:
            raise CorruptRecordError(f"{end - pos} trailing bytes are not a record batch")
        length, magic = _LENGTH_MAGIC.unpack_from(buf, pos + 8)
        if magic != 2:
            raise CorruptRecordError(f"record batch magic {magic} where 2 was expected")
        if length < MIN_BATCH_LENGTH or pos + length + LOG_OVERHEAD > end:
            raise CorruptRecordError(f"record batch length {length} at {pos} is invalid")
        n += _LAST_DELTA.unpack_from(buf, pos + 23)[0] + 1
        pos += length + LOG_OVERHEAD
    return n


def compute_crc(buf: Buffer, pos: int, length: int) -> int:
    """CRC-32C of the batch at ``pos`` (attributes to end)."""
    mv = memoryview(buf)[pos + CRC_START:pos + LOG_OVERHEAD + length]
    return crc32c.crc32c(mv)


def validate_batch(view: BatchView, strict: bool = True, crc: bool = True) -> None:
    """Size, magic and CRC-32C checks of one batch, without decoding its records.

    ``strict`` (produce path) also requires a non-empty batch whose record count matches
    its last offset delta, since offsets are assigned from that delta. ``crc=False``: the
    caller checks the CRC-32C of bytes [CRC_START:] against ``view.crc`` itself (the broker
    has the storage engine do it while copying a large batch into the WAL).
    """
    if view.magic != 2:
        raise CorruptRecordError(f"unsupported batch magic {view.magic}")
    if view.length < MIN_BATCH_LENGTH or view.pos + view.size > len(view.buf):
        raise CorruptRecordError(f"record batch length {view.length} is invalid")
    if crc and compute_crc(view.buf, view.pos, view.length) != view.crc:
        raise CorruptRecordError("record batch CRC-32C mismatch")
    if strict:
        if view.record_count <= 0:
            raise CorruptRecordError("record batch holds no records")
        if view.last_offset_delta != view.record_count - 1:
            raise CorruptRecordError("record count does not match last offset delta")


def set_base_offset(buf: bytearray | memoryview, pos: int, base_offset: int) -> None:
    """Write the assigned base offset in place (outside the CRC, so nothing else changes)."""
    _I64.pack_into(buf, pos, base_offset)


def set_partition_leader_epoch(buf: bytearray | memoryview, pos: int, epoch: int) -> None:
    """Write the partition leader epoch in place (outside the CRC)."""
    struct.pack_into(">i", buf, pos + 12, epoch)


def rewrite_crc(buf: bytearray | memoryview, pos: int) -> None:
    """Recompute and store the CRC after a header field under it changed."""
    (length,) = struct.unpack_from(">i", buf, pos + 8)
    _U32.pack_into(buf, pos + 17, compute_crc(buf, pos, length))


def set_log_append_time(buf: bytearray | memoryview, pos: int, ts: int) -> None:
    """Mark the batch LogAppendTime with ``ts`` as max timestamp and fix the CRC.

    Works on compressed batches too: v2 keeps both in the batch header, and consumers take
    every record's timestamp from maxTimestamp when the type is LogAppendTime.
    """
    (attributes,) = _I16.unpack_from(buf, pos + 21)
    _I16.pack_into(buf, pos + 21, attributes | TIMESTAMP_TYPE_MASK)
    _I64.pack_into(buf, pos + 35, ts)
    rewrite_crc(buf, pos)


def fill_max_timestamp(buf: bytearray | memoryview, pos: int) -> int:
    """Set max timestamp from the records when a producer left it -1; returns the value.

    Decodes the records' timestamp deltas (decompressing if needed) - only for the rare
    producers that omit it, since timestamp lookups depend on it.
    """
    view = BatchView(buf, pos)
    if view.max_timestamp != NO_TIMESTAMP:
        return view.max_timestamp
    from .records import iter_record_timestamps

    max_ts = NO_TIMESTAMP
    for _, ts in iter_record_timestamps(view):
        if ts > max_ts:
            max_ts = ts
    if max_ts != NO_TIMESTAMP:
        _I64.pack_into(buf, pos + 35, max_ts)
        rewrite_crc(buf, pos)
    return max_ts


def record_timestamps(buf: Buffer, pos: int) -> Iterator[tuple[int, int]]:
    """(absolute offset, timestamp) of every record of the batch at ``pos`` (decodes records)."""
    from .records import iter_record_timestamps

    return iter_record_timestamps(BatchView(buf, pos))
