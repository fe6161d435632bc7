"""Legacy message sets (magic 0 and 1): CRC32 validation, up-conversion to one v2 batch on
produce (storage only ever holds v2) and down-conversion for old consumers.

Message layout: offset i64 | size i32 | crc u32 | magic i8 | attributes i8 |
[timestamp i64, magic 1] | key bytes(i32 length) | value bytes(i32 length); the CRC covers
magic to end.  A compressed message's value holds an inner message set.
"""
from __future__ import annotations

import struct
import zlib
from typing import Iterator

from . import compression as codecs
from .batches import NO_TIMESTAMP, Buffer, iter_batches
from .errors import CorruptRecordError
from .records import Record, build_batch, decode_records

_OFFSET_SIZE = struct.Struct(">qi")
_CRC_MAGIC_ATTR = struct.Struct(">Ibb")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
LOG_OVERHEAD = 12
MIN_MESSAGE_SIZE = {0: 14, 1: 22}  # crc + magic + attributes [+ timestamp] + two lengths


def is_legacy(buf: Buffer) -> bool:
    """True when the payload starts with a magic 0/1 message (byte 16 is the magic in both)."""
    return len(buf) > 16 and buf[16] in (0, 1)


def _read_blob(mv: memoryview, pos: int, end: int) -> tuple[bytes | None, int]:
    if pos + 4 > end:
        raise CorruptRecordError("truncated legacy message")
    (n,) = _I32.unpack_from(mv, pos)
    pos += 4
    if n < 0:
        return None, pos
    if pos + n > end:
        raise CorruptRecordError("legacy message field runs past the message")
    return bytes(mv[pos:pos + n]), pos + n


def _iter_messages(buf: Buffer, depth: int = 0
                   ) -> Iterator[tuple[int, int, int, int, bytes | None, bytes | None]]:
    """(magic, attributes, timestamp, codec, key, value) of each message, inner ones flattened."""
    mv = memoryview(buf)
    pos = 0
    end = len(mv)
    if end == 0:
        raise CorruptRecordError("empty message set")
    while pos < end:
        if end - pos < LOG_OVERHEAD:
            raise CorruptRecordError("truncated legacy message header")
        _offset, size = _OFFSET_SIZE.unpack_from(mv, pos)
        start = pos + LOG_OVERHEAD
        stop = start + size
        if size < 14 or stop > end:
            raise CorruptRecordError(f"legacy message size {size} is invalid")
        crc, magic, attributes = _CRC_MAGIC_ATTR.unpack_from(mv, start)
        if magic not in (0, 1) or size < MIN_MESSAGE_SIZE[magic]:
            raise CorruptRecordError(f"legacy message magic {magic} / size {size} is invalid")
        if zlib.crc32(mv[start + 4:stop]) != crc:
            raise CorruptRecordError("legacy message CRC32 mismatch")
        p = start + 6
        timestamp = NO_TIMESTAMP
        if magic == 1:
            (timestamp,) = _I64.unpack_from(mv, p)
            p += 8
        key, p = _read_blob(mv, p, stop)
        value, p = _read_blob(mv, p, stop)
        codec = attributes & 0x07
        if codec:
            if depth > 0:
                raise CorruptRecordError("nested compressed legacy messages")
            if codec == codecs.ZSTD or value is None:
                raise CorruptRecordError("invalid compressed legacy message")
            inner = codecs.decompress(codec, value)
            log_append = magic == 1 and attributes & 0x08
            for m in _iter_messages(inner, depth + 1):
                ts = timestamp if log_append else m[2]
                yield m[0], m[1], ts, codec, m[4], m[5]
        else:
            yield magic, attributes, timestamp, 0, key, value
        pos = stop


def convert_legacy(buf: Buffer) -> bytes:
    """Validate a magic 0/1 message set and return the same records as one v2 batch.

    Offsets restart at 0 (the broker assigns them), magic 1 timestamps are kept (magic 0 has
    none: -1), and the wrapper's codec (gzip/snappy/lz4) is reused for the new batch.
    """
    records: list[Record] = []
    codec = 0
    for i, (_magic, _attr, ts, c, key, value) in enumerate(_iter_messages(buf)):
        codec = codec or c
        records.append(Record(i, ts, key, value))
    return build_batch(records, compression=codec)


def _legacy_message(magic: int, offset: int, timestamp: int, key: bytes | None,
                    value: bytes | None, attributes: int = 0) -> bytes:
    body = bytearray(struct.pack(">bb", magic, attributes))
    if magic == 1:
        body += _I64.pack(timestamp)
    for blob in (key, value):
        if blob is None:
            body += _I32.pack(-1)
        else:
            body += _I32.pack(len(blob))
            body += blob
    crc = zlib.crc32(body)
    return _OFFSET_SIZE.pack(offset, len(body) + 4) + struct.pack(">I", crc) + bytes(body)


def down_convert(payload: Buffer, magic: int) -> bytes:
    """v2 batches -> an uncompressed magic 0/1 message set for Fetch/Produce-era clients.

    Control batches are dropped; LogAppendTime batches keep that timestamp type (magic 1).
    """
    if magic not in (0, 1):
        raise ValueError("down-conversion targets magic 0 or 1")
    out = []
    for view in iter_batches(payload):
        if view.is_control:
            continue
        attributes = 0x08 if (magic == 1 and view.timestamp_type == 1) else 0
        for r in decode_records(view):
            out.append(_legacy_message(magic, r.offset, r.timestamp, r.key, r.value, attributes))
    return b"".join(out)


def build_message_set(magic: int, pairs: list[tuple[bytes | None, bytes | None]],
                      timestamp: int = NO_TIMESTAMP, compression: int = 0,
                      base_offset: int = 0) -> bytes:
    """Encode a legacy message set (used by tests and tools speaking magic 0/1)."""
    msgs = b"".join(_legacy_message(magic, base_offset + i if not compression or magic == 0 else i,
                                    timestamp, k, v) for i, (k, v) in enumerate(pairs))
    if not compression:
        return msgs
    return _legacy_message(magic, base_offset + len(pairs) - 1, timestamp, None,
                           codecs.compress(compression, msgs), attributes=compression)
