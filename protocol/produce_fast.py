"""Zero-copy Produce request decoding.

The generic codec copies every ``records`` field into new bytes; a Produce request is mostly
records, so this parser walks the (small) envelope by hand and hands out memoryviews into the
request frame instead.  The result has the same shape as kafka-python's ``ProduceRequest``.
"""
from __future__ import annotations

import struct
import uuid
from typing import Any

from kafka.protocol.producer import ProduceRequest

from .errors import MalformedRequestError
from .frames import RequestHeader, read_tagged_fields, read_uvarint

_TopicData = ProduceRequest.TopicProduceData
_PartData = ProduceRequest.TopicProduceData.PartitionProduceData
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_ACKS_TIMEOUT = struct.Struct(">hi")


def parse_produce_body(buf: memoryview, pos: int, header: RequestHeader) -> Any:
    """Decode a Produce request body at ``pos``; ``records`` are memoryviews into ``buf``."""
    try:
        return _parse(buf, pos, header)
    except MalformedRequestError as exc:
        if exc.header is None:
            exc.header = header
        raise


def _parse(buf: memoryview, pos: int, header: RequestHeader) -> Any:
    version = header.api_version
    flexible = version >= 9
    end = len(buf)

    def need(n: int) -> None:
        if pos + n > end:
            raise MalformedRequestError("truncated Produce request", header)

    def read_string(nullable: bool) -> str | None:
        nonlocal pos
        if flexible:
            n, pos = read_uvarint(buf, pos)
            n -= 1
        else:
            need(2)
            (n,) = _I16.unpack_from(buf, pos)
            pos += 2
        if n < 0:
            if not nullable:
                raise MalformedRequestError("null string in Produce request", header)
            return None
        need(n)
        try:
            s = bytes(buf[pos:pos + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedRequestError("bad utf-8 in Produce request", header) from None
        pos += n
        return s

    def read_count() -> int:
        nonlocal pos
        if flexible:
            n, pos = read_uvarint(buf, pos)
            n -= 1
        else:
            need(4)
            (n,) = _I32.unpack_from(buf, pos)
            pos += 4
        if n < 0 or n > end - pos:  # each element takes at least one byte
            raise MalformedRequestError(f"bad array length {n} in Produce request", header)
        return n

    transactional_id = read_string(True) if version >= 3 else None
    need(6)
    acks, timeout_ms = _ACKS_TIMEOUT.unpack_from(buf, pos)
    pos += 6
    topics = []
    for _ in range(read_count()):
        if version >= 13:
            need(16)
            topic_id = uuid.UUID(bytes=bytes(buf[pos:pos + 16]))
            pos += 16
            name = None
        else:
            name = read_string(False)
            topic_id = None
        parts = []
        for _ in range(read_count()):
            need(4)
            (index,) = _I32.unpack_from(buf, pos)
            pos += 4
            if flexible:
                n, pos = read_uvarint(buf, pos)
                n -= 1
            else:
                need(4)
                (n,) = _I32.unpack_from(buf, pos)
                pos += 4
            if n < 0:
                records = None
            else:
                need(n)
                records = buf[pos:pos + n]
                pos += n
            if flexible:
                _, pos = read_tagged_fields(buf, pos)
            parts.append(_PartData(version=version, index=index, records=records))
        if flexible:
            _, pos = read_tagged_fields(buf, pos)
        if version >= 13:
            topics.append(_TopicData(version=version, topic_id=topic_id, partition_data=parts))
        else:
            topics.append(_TopicData(version=version, name=name, partition_data=parts))
    if flexible:
        _, pos = read_tagged_fields(buf, pos)
    kwargs: dict[str, Any] = {"acks": acks, "timeout_ms": timeout_ms, "topic_data": topics}
    if version >= 3:
        kwargs["transactional_id"] = transactional_id
    return ProduceRequest(version=version, **kwargs)
