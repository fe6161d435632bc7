"""Object format: data blocks, an index block and a footer (the layout of AutoMQ's S3Stream objects).

Layout of one object::

    [data block]* [index block] [footer]

Data block: a 14-byte header (magic 0x5A, flags, record count, data length, CRC-32C of the data)
followed by stream records, each a 33-byte header (magic 0x22, stream id, epoch, base offset,
last offset delta, payload length) and the opaque payload. Within a block, one stream's records
are contiguous and sorted by offset; blocks are sorted by (stream, offset).

Index block: fixed 36-byte entries (stream id, start offset, end offset delta, record count,
block position, block size) - one entry per (stream, data block) run - so a reader finds the
blocks of a range with one ranged GET of the index. Footer: 48 bytes (index position, index
length, CRC-32C of the index, zero padding, magic), so a reader fetches the tail first.

All integers are big-endian. Every structure is checked (magic, lengths, CRC) and a mismatch
raises CorruptObjectError, which the engine reports as a storage error for that range.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple

import crc32c

BLOCK_MAGIC = 0x5A
RECORD_MAGIC = 0x22
FOOTER_MAGIC = 0x88E241B785F4CFF7

BLOCK_HEADER = struct.Struct(">BBiiI")          # magic, flags, record count, data length, crc32c
RECORD_HEADER = struct.Struct(">BqqqiI")        # magic, stream id, epoch, base offset, last delta, len
INDEX_ENTRY = struct.Struct(">qqiiqi")          # stream, start, end delta, records, position, size
FOOTER = struct.Struct(">qiI24sQ")              # index pos, index len, index crc32c, pad, magic
assert BLOCK_HEADER.size == 14 and RECORD_HEADER.size == 33
assert INDEX_ENTRY.size == 36 and FOOTER.size == 48

DEFAULT_BLOCK_SIZE = 512 << 10


class CorruptObjectError(Exception):
    """An object's bytes fail a magic, length or checksum check."""


class Record(NamedTuple):
    """One stream batch as stored: the payload covers offsets [base_offset, base_offset + count)."""

    stream_id: int
    base_offset: int
    count: int
    payload: bytes | memoryview

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.count


class IndexEntry(NamedTuple):
    """Where one stream's run of records sits inside an object."""

    stream_id: int
    start_offset: int
    end_offset: int
    record_count: int
    position: int
    size: int


@dataclass
class StreamRange:
    """The offsets of one stream an object holds (what the metadata store records)."""

    stream_id: int
    start_offset: int
    end_offset: int


def encode_object(records: Iterable[Record], block_size: int = DEFAULT_BLOCK_SIZE
                  ) -> tuple[bytearray, list[IndexEntry], list[StreamRange]]:
    """Serialise records (already sorted by stream, offset) into one object.

    Returns the object bytes, its index and the per-stream ranges it covers. A block is closed
    once it passes ``block_size``; a block never splits a record. Every payload is copied
    exactly once, straight into the object buffer (a block's header is written in place once
    its length and checksum are known): this runs in an IO thread but holds the GIL while it
    copies, so each extra copy is taken from the event loop."""
    out = bytearray()
    index: list[IndexEntry] = []
    ranges: dict[int, StreamRange] = {}
    block_pos = -1                      # where the open block's header sits in ``out``
    block_records = 0
    runs: list[list[int]] = []          # [stream, start, end, count] within the current block
    hdr = BLOCK_HEADER.size

    def close_block() -> None:
        nonlocal block_pos, block_records, runs
        if not block_records:
            return
        pos = block_pos
        length = len(out) - pos - hdr
        with memoryview(out) as mv, mv[pos + hdr:] as body:
            crc = crc32c.crc32c(body)
        BLOCK_HEADER.pack_into(out, pos, BLOCK_MAGIC, 0, block_records, length, crc)
        size = len(out) - pos
        for sid, start, end, cnt in runs:
            index.append(IndexEntry(sid, start, end, cnt, pos, size))
        block_pos = -1
        block_records = 0
        runs = []

    last: tuple[int, int] | None = None
    for r in records:
        if last is not None and (r.stream_id, r.base_offset) < last:
            raise ValueError("records must be sorted by stream and offset")
        last = (r.stream_id, r.base_offset)
        if block_pos < 0:
            block_pos = len(out)
            out += bytes(hdr)           # filled in by close_block
        out += RECORD_HEADER.pack(RECORD_MAGIC, r.stream_id, 0, r.base_offset, r.count - 1,
                                  len(r.payload))
        out += r.payload
        block_records += 1
        if runs and runs[-1][0] == r.stream_id:
            runs[-1][2] = r.end_offset
            runs[-1][3] += 1
        else:
            runs.append([r.stream_id, r.base_offset, r.end_offset, 1])
        rng = ranges.get(r.stream_id)
        if rng is None:
            ranges[r.stream_id] = StreamRange(r.stream_id, r.base_offset, r.end_offset)
        else:
            rng.end_offset = r.end_offset
        if len(out) - block_pos - hdr >= block_size:
            close_block()
    close_block()
    index_pos = len(out)
    index_bytes = b"".join(INDEX_ENTRY.pack(e.stream_id, e.start_offset,
                                            e.end_offset - e.start_offset, e.record_count,
                                            e.position, e.size) for e in index)
    out += index_bytes
    out += FOOTER.pack(index_pos, len(index_bytes), crc32c.crc32c(index_bytes), bytes(24),
                       FOOTER_MAGIC)
    return out, index, list(ranges.values())


def decode_footer(tail: bytes | memoryview, object_size: int) -> tuple[int, int, int]:
    """(index position, index length, index crc) from the last 48 bytes of an object."""
    if len(tail) < FOOTER.size:
        raise CorruptObjectError("object shorter than its footer")
    pos, length, crc, pad, magic = FOOTER.unpack_from(tail, len(tail) - FOOTER.size)
    if magic != FOOTER_MAGIC or pad != bytes(24):
        raise CorruptObjectError("bad footer magic")
    if pos < 0 or length < 0 or length % INDEX_ENTRY.size or pos + length + FOOTER.size != object_size:
        raise CorruptObjectError("footer points outside the object")
    return pos, length, crc


def decode_index(data: bytes | memoryview, crc: int) -> list[IndexEntry]:
    """Parse and check the index block."""
    if crc32c.crc32c(data) != crc:
        raise CorruptObjectError("index checksum mismatch")
    entries = []
    for sid, start, delta, cnt, pos, size in INDEX_ENTRY.iter_unpack(data):
        if delta < 0 or cnt < 0 or pos < 0 or size < BLOCK_HEADER.size:
            raise CorruptObjectError("bad index entry")
        entries.append(IndexEntry(sid, start, start + delta, cnt, pos, size))
    return entries


def decode_block(data: bytes | memoryview) -> list[Record]:
    """Parse and check one data block (header included); payloads are views into ``data``."""
    mv = memoryview(data)
    if len(mv) < BLOCK_HEADER.size:
        raise CorruptObjectError("truncated block header")
    magic, flags, count, length, crc = BLOCK_HEADER.unpack_from(mv, 0)
    if magic != BLOCK_MAGIC or flags != 0 or length != len(mv) - BLOCK_HEADER.size or count < 0:
        raise CorruptObjectError("bad block header")
    body = mv[BLOCK_HEADER.size:]
    if crc32c.crc32c(body) != crc:
        raise CorruptObjectError("block checksum mismatch")
    out: list[Record] = []
    pos = 0
    for _ in range(count):
        if pos + RECORD_HEADER.size > len(body):
            raise CorruptObjectError("truncated record header")
        rmagic, sid, _epoch, base, delta, plen = RECORD_HEADER.unpack_from(body, pos)
        pos += RECORD_HEADER.size
        if rmagic != RECORD_MAGIC or delta < 0 or pos + plen > len(body):
            raise CorruptObjectError("bad record header")
        out.append(Record(sid, base, delta + 1, body[pos:pos + plen]))
        pos += plen
    if pos != len(body):
        raise CorruptObjectError("trailing bytes in block")
    return out


def decode_object(data: bytes | memoryview) -> Iterator[Record]:
    """Every record of a whole object (compaction, tests)."""
    mv = memoryview(data)
    pos, length, crc = decode_footer(mv[-FOOTER.size:], len(mv))
    seen: set[int] = set()
    for e in decode_index(mv[pos:pos + length], crc):
        if e.position in seen:
            continue
        seen.add(e.position)
        if e.position + e.size > pos:
            raise CorruptObjectError("index entry points outside the data")
        yield from decode_block(mv[e.position:e.position + e.size])
