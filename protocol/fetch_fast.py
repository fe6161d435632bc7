"""Zero-copy Fetch response encoding.

A Fetch response is mostly record bytes that already sit in the log cache; the generic codec
would copy them into one buffer.  This encoder writes the small envelope itself and returns a
list of buffers for ``transport.writelines`` in which record payloads appear as the very
objects the handler supplied (a partition's ``records`` may be bytes, a memoryview or a
list/tuple of such buffers, sent back to back without being joined).  Tagged fields are
encoded with kafka-python's schema codec, so the output equals the generic encoding.
"""
from __future__ import annotations

import struct
from typing import Any, Sequence

from kafka.protocol.consumer import FetchResponse

from .frames import RequestHeader

_Part = FetchResponse.FetchableTopicResponse.PartitionData
_TOP_TAGS = FetchResponse._struct.tagged_fields
_PART_TAGS = _Part._struct.tagged_fields
Buf = bytes | bytearray | memoryview
SMALL = 4096  # payload pieces below this are copied into the envelope buffer (fewer writes)


def _uvarint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _string(out: bytearray, s: str | None, flexible: bool) -> None:
    if s is None:
        if flexible:
            out.append(0)
        else:
            out += b"\xff\xff"
        return
    b = s.encode("utf-8")
    if flexible:
        _uvarint(out, len(b) + 1)
    else:
        out += struct.pack(">h", len(b))
    out += b


def _count(out: bytearray, n: int | None, flexible: bool) -> None:
    if flexible:
        _uvarint(out, 0 if n is None else n + 1)
    else:
        out += struct.pack(">i", -1 if n is None else n)


def encode_fetch_body(resp: Any, version: int) -> list[Buf]:
    """Body buffers of a FetchResponse object, records passed through uncopied.

    Versions 0-3 predate record batches: their clients read magic 0 (v0-1) or magic 1 (v2-3)
    message sets, so stored v2 batches are down-converted here (that path copies).
    """
    flexible = version >= 12
    parts: list[Buf] = []
    out = bytearray()
    if version >= 1:
        out += struct.pack(">i", resp.throttle_time_ms or 0)
    if version >= 7:
        out += struct.pack(">hi", resp.error_code or 0, resp.session_id or 0)
    topics = resp.responses or []
    _count(out, len(topics), flexible)
    for t in topics:
        if version >= 13:
            out += t.topic_id.bytes if t.topic_id is not None else bytes(16)
        else:
            _string(out, t.topic, flexible)
        plist = t.partitions or []
        _count(out, len(plist), flexible)
        for p in plist:
            out += struct.pack(">ihq", p.partition_index, p.error_code, p.high_watermark)
            if version >= 4:
                out += struct.pack(">q", p.last_stable_offset)
            if version >= 5:
                out += struct.pack(">q", p.log_start_offset)
            if version >= 4:
                aborted = p.aborted_transactions
                _count(out, None if aborted is None else len(aborted), flexible)
                for a in aborted or ():
                    out += struct.pack(">qq", a.producer_id, a.first_offset)
                    if flexible:
                        out.append(0)
            if version >= 11:
                out += struct.pack(">i", p.preferred_read_replica)
            records = p.records
            if version < 4 and records:
                from .legacy import down_convert

                joined = b"".join(records) if isinstance(records, (list, tuple)) else records
                records = down_convert(joined, 0 if version < 2 else 1)
            pieces: Sequence[Buf]
            if records is None:
                pieces = ()
                total = -1
            elif isinstance(records, (list, tuple)):
                pieces = records
                total = sum(len(r) for r in records)
            else:
                pieces = (records,)
                total = len(records)
            if flexible:
                _uvarint(out, total + 1)
            else:
                out += struct.pack(">i", total)
            for piece in pieces:
                if len(piece) < SMALL:
                    out += piece
                else:
                    parts.append(out)
                    parts.append(piece)
                    out = bytearray()
            if flexible:
                if (p.diverging_epoch is None and p.current_leader is None
                        and p.snapshot_id is None):
                    out.append(0)  # the common case: no tagged fields set
                else:
                    out += _PART_TAGS(version).encode(p, version=version)
        if flexible:
            out.append(0)  # FetchableTopicResponse has no tagged fields
    if flexible:
        if not resp.node_endpoints:
            out.append(0)
        else:
            out += _TOP_TAGS(version).encode(resp, version=version)
    parts.append(out)
    return parts


def encode_fetch_response(header: RequestHeader, resp: Any) -> list[Buf]:
    """Whole response frame (length prefix, header, body) as buffers for writelines."""
    version = header.api_version
    body = encode_fetch_body(resp, version)
    flexible = version >= 12
    size = sum(len(b) for b in body) + 4 + flexible
    prefix = struct.pack(">ii", size, header.correlation_id) + (b"\x00" if flexible else b"")
    return [prefix, *body]
