"""Record-level decode/encode of v2 batches, for the paths that need records (tests,
timestamp lookups, LogAppendTime fills, down-conversion, legacy up-conversion).

Record layout: length varint | attributes i8 | timestampDelta varlong | offsetDelta varint |
keyLength varint | key | valueLength varint | value | headerCount varint |
(headerKeyLength varint | key | headerValueLength varint | value)*  (varints are zigzag).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from . import compression as codecs
from .batches import (
    COMPRESSION_MASK, CONTROL_MASK, DELETE_HORIZON_MASK, HEADER_SIZE, LOG_OVERHEAD, NO_TIMESTAMP, TIMESTAMP_TYPE_MASK,
    TRANSACTIONAL_MASK, BatchView, Buffer, iter_batches, rewrite_crc,
)
from .errors import CorruptRecordError


@dataclass(slots=True)
class Record:
    """One decoded record; ``offset``/``timestamp`` are absolute."""

    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)


def _read_varint(buf: Buffer, pos: int) -> tuple[int, int]:
    """Zigzag varint (up to 64 bits) at ``pos``; returns (value, new pos)."""
    raw = 0
    shift = 0
    try:
        while True:
            b = buf[pos]
            pos += 1
            raw |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise CorruptRecordError("varint too long")
    except IndexError:
        raise CorruptRecordError("truncated varint in record") from None
    return (raw >> 1) ^ -(raw & 1), pos


def _write_varint(out: bytearray, value: int) -> None:
    raw = (value << 1) ^ (value >> 63)
    raw &= 0xFFFFFFFFFFFFFFFF
    while raw >= 0x80:
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7
    out.append(raw)


def _read_bytes(buf: Buffer, pos: int) -> tuple[bytes | None, int]:
    n, pos = _read_varint(buf, pos)
    if n < 0:
        return None, pos
    if pos + n > len(buf):
        raise CorruptRecordError("record field runs past the batch")
    return bytes(buf[pos:pos + n]), pos + n


def _records_bytes(view: BatchView) -> Buffer:
    raw = view.records_view()
    if view.compression:
        return codecs.decompress(view.compression, raw)
    return raw


def _record_spans(data: Buffer, count: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each of `count` length-prefixed records in a batch's record section:
    start just past the length varint (at the attributes byte), end where the next begins."""
    pos = 0
    for _ in range(max(count, 0)):
        length, pos = _read_varint(data, pos)
        end = pos + length
        if length < 0 or end > len(data):
            raise CorruptRecordError("record length runs past the batch")
        yield pos, end
        pos = end


def decode_records(view: BatchView) -> list[Record]:
    """All records of one batch (decompressed); LogAppendTime batches report maxTimestamp."""
    data = _records_bytes(view)
    log_append = view.timestamp_type == 1
    out: list[Record] = []
    for pos, end in _record_spans(data, view.record_count):
        pos += 1  # attributes (unused)
        ts_delta, pos = _read_varint(data, pos)
        off_delta, pos = _read_varint(data, pos)
        key, pos = _read_bytes(data, pos)
        value, pos = _read_bytes(data, pos)
        nh, pos = _read_varint(data, pos)
        headers = []
        for _ in range(max(nh, 0)):
            hk, pos = _read_bytes(data, pos)
            hv, pos = _read_bytes(data, pos)
            try:
                headers.append(((hk or b"").decode("utf-8"), hv))
            except UnicodeDecodeError:
                raise CorruptRecordError("record header key is not utf-8") from None
        if pos != end:
            raise CorruptRecordError("record length does not match its fields")
        ts = view.max_timestamp if log_append else view.base_timestamp + ts_delta
        out.append(Record(view.base_offset + off_delta, ts, key, value, headers))
    return out


def has_keyless_record(buf: Buffer) -> bool:
    """True when a data record of these v2 batches has a null key (control batches skipped).

    Compacted topics refuse such records (INVALID_RECORD), so only their produce path decodes
    records; CorruptRecordError for payloads that do not decode.
    """
    for view in iter_batches(buf):
        if view.is_control:
            continue
        for rec in decode_records(view):
            if rec.key is None:
                return True
    return False


def iter_record_timestamps(view: BatchView) -> Iterator[tuple[int, int]]:
    """(offset, timestamp) per record, skipping keys/values without copying them."""
    if view.timestamp_type == 1:
        for i in range(view.last_offset_delta + 1):
            yield view.base_offset + i, view.max_timestamp
        return
    data = _records_bytes(view)
    for pos, _ in _record_spans(data, view.record_count):
        ts_delta, p = _read_varint(data, pos + 1)
        off_delta, _ = _read_varint(data, p)
        yield view.base_offset + off_delta, view.base_timestamp + ts_delta


def encode_records(records: Sequence[Record], base_offset: int, base_timestamp: int) -> bytes:
    """The (uncompressed) record section of a batch."""
    out = bytearray()
    body = bytearray()
    for r in records:
        body.clear()
        body.append(0)
        _write_varint(body, r.timestamp - base_timestamp if r.timestamp >= 0 else 0)
        _write_varint(body, r.offset - base_offset)
        for blob in (r.key, r.value):
            if blob is None:
                _write_varint(body, -1)
            else:
                _write_varint(body, len(blob))
                body += blob
        _write_varint(body, len(r.headers))
        for hk, hv in r.headers:
            kb = hk.encode("utf-8")
            _write_varint(body, len(kb))
            body += kb
            if hv is None:
                _write_varint(body, -1)
            else:
                _write_varint(body, len(hv))
                body += hv
        _write_varint(out, len(body))
        out += body
    return bytes(out)


def build_batch(records: Sequence[Record] | Sequence[tuple[bytes | None, bytes | None]],
                base_offset: int = 0, compression: int = codecs.NONE, timestamp: int | None = None,
                producer_id: int = -1, producer_epoch: int = -1, base_sequence: int = -1,
                log_append_time: bool = False, transactional: bool = False,
                control: bool = False, partition_leader_epoch: int = -1,
                max_timestamp: int | None = None) -> bytes:
    """Encode one v2 batch.  ``records`` may be Record objects or (key, value) pairs, which
    get consecutive offsets from ``base_offset`` and ``timestamp`` (default: -1)."""
    recs: list[Record] = []
    for i, r in enumerate(records):
        if isinstance(r, Record):
            recs.append(r)
        else:
            ts = NO_TIMESTAMP if timestamp is None else timestamp
            recs.append(Record(base_offset + i, ts, r[0], r[1]))
    if not recs:
        raise ValueError("a record batch needs at least one record")
    first = recs[0]
    base_ts = first.timestamp if first.timestamp >= 0 else NO_TIMESTAMP
    if max_timestamp is None:
        max_timestamp = max(r.timestamp for r in recs)
    body = encode_records(recs, recs[0].offset, base_ts if base_ts >= 0 else 0)
    if compression:
        body = codecs.compress(compression, body)
    attributes = compression
    if log_append_time:
        attributes |= TIMESTAMP_TYPE_MASK
    if transactional:
        attributes |= TRANSACTIONAL_MASK
    if control:
        attributes |= CONTROL_MASK
    length = HEADER_SIZE - LOG_OVERHEAD + len(body)
    buf = bytearray(HEADER_SIZE + len(body))
    struct.pack_into(">qiibIhiqqqhii", buf, 0, recs[0].offset, length, partition_leader_epoch,
                     2, 0, attributes, recs[-1].offset - recs[0].offset, base_ts, max_timestamp,
                     producer_id, producer_epoch, base_sequence, len(recs))
    buf[HEADER_SIZE:] = body
    rewrite_crc(buf, 0)
    return bytes(buf)


def rebuild_batch(view: BatchView, records: Sequence[Record],
                  delete_horizon: int | None = None) -> bytes:
    """``view``'s batch holding only ``records`` (a subset of its own, as a log cleaner keeps).

    As Kafka's cleaner writes it: base offset, last offset delta, producer id/epoch, base
    sequence, leader epoch and attributes stay, so the producer's sequence window and the
    batch's offset span survive; the records keep their offsets and timestamps and the
    CRC-32C is recomputed. No records: an empty batch (header only, uncompressed), which
    preserves the last offset and sequence. ``delete_horizon`` sets the delete-horizon flag
    with the horizon as base timestamp (KIP-534); an existing horizon is kept."""
    attributes = view.attributes
    base_ts = view.base_timestamp
    if delete_horizon is not None:
        attributes |= DELETE_HORIZON_MASK
        base_ts = delete_horizon
    max_ts = view.max_timestamp
    if records and view.timestamp_type == 0:
        max_ts = max(r.timestamp for r in records)
    if records:
        body = encode_records(records, view.base_offset, base_ts)
        if view.compression:
            body = codecs.compress(view.compression, body)
    else:
        body = b""
        attributes &= ~COMPRESSION_MASK
    length = HEADER_SIZE - LOG_OVERHEAD + len(body)
    buf = bytearray(HEADER_SIZE + len(body))
    struct.pack_into(">qiibIhiqqqhii", buf, 0, view.base_offset, length,
                     view.partition_leader_epoch, 2, 0, attributes, view.last_offset_delta,
                     base_ts, max_ts, view.producer_id, view.producer_epoch,
                     view.base_sequence, len(records))
    buf[HEADER_SIZE:] = body
    rewrite_crc(buf, 0)
    return bytes(buf)


def decode_batches(buf: Buffer) -> list[Record]:
    """Every record of a payload of v2 batches, control batches skipped."""
    out: list[Record] = []
    for view in iter_batches(buf):
        if not view.is_control:
            out.extend(decode_records(view))
    return out
