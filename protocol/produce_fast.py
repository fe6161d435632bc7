"""Zero-copy Produce request decoding and a direct ProduceResponse encoder.

The generic codec copies every ``records`` field into new bytes and builds a tree of
schema-driven objects; a Produce request is mostly records and its envelope is tiny, so this
parser walks the envelope by hand and hands out memoryviews into the request frame.  The result
is a tree of light slotted objects with the attribute names of kafka-python's
``ProduceRequest`` (``acks``, ``timeout_ms``, ``transactional_id``, ``topic_data[].name`` /
``.topic_id``, ``.partition_data[].index`` / ``.records``); ``to_codec()`` builds the
kafka-python object when one is needed (tests, tools).

``encode_produce_response`` writes the response body with ``struct`` from plain tuples: the
answer to every produce request, so the generic encoder's per-field dispatch showed up in
profiles of small requests.
"""
from __future__ import annotations

import struct
import uuid
from typing import Any

from kafka.protocol.producer import ProduceRequest

from .errors import MalformedRequestError
from .frames import RequestHeader, read_tagged_fields, read_uvarint

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_ACKS_TIMEOUT = struct.Struct(">hi")
# per-partition response fields: index, error, base offset (v0), log append time (v2+),
# log start offset (v5+)
_PART_V0 = struct.Struct(">ihq")
_PART_V2 = struct.Struct(">ihqq")
_PART_V5 = struct.Struct(">ihqqq")
PRODUCE_MAX_VERSION = 13


class PartitionProduceData:
    """One partition of a Produce request: ``records`` is a view into the request frame."""

    __slots__ = ("index", "records")

    def __init__(self, index: int, records: memoryview | None) -> None:
        self.index = index
        self.records = records


class TopicProduceData:
    """One topic of a Produce request (by ``name`` before v13, by ``topic_id`` from v13)."""

    __slots__ = ("name", "topic_id", "partition_data")

    def __init__(self, name: str | None, topic_id: uuid.UUID | None,
                 partition_data: list[PartitionProduceData]) -> None:
        self.name = name
        self.topic_id = topic_id
        self.partition_data = partition_data


class FastProduceRequest:
    """A decoded Produce request, shaped like kafka-python's ``ProduceRequest``."""

    __slots__ = ("version", "transactional_id", "acks", "timeout_ms", "topic_data", "plain")

    def __init__(self, version: int, transactional_id: str | None, acks: int, timeout_ms: int,
                 topic_data: list[TopicProduceData], plain: bool = False) -> None:
        self.version = version
        self.transactional_id = transactional_id
        self.acks = acks
        self.timeout_ms = timeout_ms
        self.topic_data = topic_data
        # True when the C envelope scan read it (protocol.frames): one topic by name, one
        # partition, acks -1 or 1, no transactional id, records of at least 61 bytes that
        # start with a v2 batch header without a producer id
        self.plain = plain

    def to_codec(self) -> Any:
        """The equivalent kafka-python ``ProduceRequest`` (records copied to bytes)."""
        v = self.version
        part_cls = ProduceRequest.TopicProduceData.PartitionProduceData
        topics = []
        for td in self.topic_data:
            parts = [part_cls(version=v, index=pd.index,
                              records=None if pd.records is None else bytes(pd.records))
                     for pd in td.partition_data]
            key = {"topic_id": td.topic_id} if v >= 13 else {"name": td.name}
            topics.append(ProduceRequest.TopicProduceData(version=v, partition_data=parts, **key))
        kwargs: dict[str, Any] = {"transactional_id": self.transactional_id} if v >= 3 else {}
        return ProduceRequest(version=v, acks=self.acks, timeout_ms=self.timeout_ms,
                              topic_data=topics, **kwargs)

    def encode(self, version: int | None = None) -> bytes:
        """Body bytes as the generic codec writes them (for comparisons in tests)."""
        return self.to_codec().encode(version=self.version if version is None else version)


def parse_produce_body(buf: memoryview, pos: int, header: RequestHeader) -> Any:
    """Decode a Produce request body at ``pos``; ``records`` are memoryviews into ``buf``."""
    try:
        return _parse(buf, pos, header)
    except MalformedRequestError as exc:
        if exc.header is None:
            exc.header = header
        raise


def _length(buf: memoryview, pos: int, flexible: bool, wide: bool) -> tuple[int, int]:
    """A string/bytes/array length: compact (uvarint - 1) when flexible, else int16/int32."""
    if flexible:
        n, pos = read_uvarint(buf, pos)
        return n - 1, pos
    if wide:
        return _I32.unpack_from(buf, pos)[0], pos + 4
    return _I16.unpack_from(buf, pos)[0], pos + 2


def _string(buf: memoryview, pos: int, flexible: bool, header: RequestHeader,
            nullable: bool) -> tuple[str | None, int]:
    n, pos = _length(buf, pos, flexible, False)
    if n < 0:
        if not nullable:
            raise MalformedRequestError("null string in Produce request", header)
        return None, pos
    if pos + n > len(buf):
        raise MalformedRequestError("truncated Produce request", header)
    try:
        return str(buf[pos:pos + n], "utf-8"), pos + n
    except UnicodeDecodeError:
        raise MalformedRequestError("bad utf-8 in Produce request", header) from None


def _parse(buf: memoryview, pos: int, header: RequestHeader) -> Any:
    """Straight-line walk of the envelope (no closures: this runs once per request)."""
    version = header.api_version
    flexible = version >= 9
    end = len(buf)
    try:
        transactional_id = None
        if version >= 3:
            transactional_id, pos = _string(buf, pos, flexible, header, True)
        acks, timeout_ms = _ACKS_TIMEOUT.unpack_from(buf, pos)
        pos += 6
        n_topics, pos = _length(buf, pos, flexible, True)
        if n_topics < 0 or n_topics > end - pos:  # each element takes at least one byte
            raise MalformedRequestError(f"bad array length {n_topics} in Produce request",
                                        header)
        topics = []
        for _ in range(n_topics):
            if version >= 13:
                if pos + 16 > end:
                    raise MalformedRequestError("truncated Produce request", header)
                topic_id: uuid.UUID | None = uuid.UUID(bytes=bytes(buf[pos:pos + 16]))
                pos += 16
                name = None
            else:
                name, pos = _string(buf, pos, flexible, header, False)
                topic_id = None
            n_parts, pos = _length(buf, pos, flexible, True)
            if n_parts < 0 or n_parts > end - pos:
                raise MalformedRequestError(f"bad array length {n_parts} in Produce request",
                                            header)
            parts = []
            for _ in range(n_parts):
                (index,) = _I32.unpack_from(buf, pos)
                n, pos = _length(buf, pos + 4, flexible, True)
                if n < 0:
                    records = None
                else:
                    if pos + n > end:
                        raise MalformedRequestError("truncated Produce request", header)
                    records = buf[pos:pos + n]
                    pos += n
                if flexible:
                    _, pos = read_tagged_fields(buf, pos)
                parts.append(PartitionProduceData(index, records))
            if flexible:
                _, pos = read_tagged_fields(buf, pos)
            topics.append(TopicProduceData(name, topic_id, parts))
        if flexible:
            _, pos = read_tagged_fields(buf, pos)
    except struct.error:
        raise MalformedRequestError("truncated Produce request", header) from None
    return FastProduceRequest(version, transactional_id, acks, timeout_ms, topics)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _put_string(s: str | None, flexible: bool) -> bytes:
    if s is None:
        return b"\x00" if flexible else b"\xff\xff"
    raw = s.encode("utf-8")
    return (_uvarint(len(raw) + 1) if flexible else _I16.pack(len(raw))) + raw


def _count(n: int, flexible: bool) -> bytes:
    return _uvarint(n + 1) if flexible else _I32.pack(n)


# (index, error code, base offset, log append time, log start offset, error message)
PartitionResult = tuple[int, int, int, int, int, "str | None"]


def encode_produce_response(version: int,
                            topics: list[tuple[str | uuid.UUID | None, list[PartitionResult]]],
                            throttle_time_ms: int = 0) -> bytes:
    """ProduceResponse body (no response header) of ``version``.

    ``topics``: (name, or topic id from v13, [(index, error code, base offset, log append
    time, log start offset, error message), ...]). Record errors are always empty and the
    tagged fields (current leader, node endpoints) absent: one broker, leadership never moves.
    """
    if not 0 <= version <= PRODUCE_MAX_VERSION:
        raise ValueError(f"ProduceResponse v{version} is not supported")
    flexible = version >= 9
    out = [_count(len(topics), flexible)]
    for key, parts in topics:
        if version >= 13:
            tid = key if isinstance(key, uuid.UUID) else uuid.UUID(int=0)
            out.append(tid.bytes)
        else:
            out.append(_put_string(key if isinstance(key, str) else None, flexible))
        out.append(_count(len(parts), flexible))
        for index, error, base, append_time, start, message in parts:
            if version >= 5:
                out.append(_PART_V5.pack(index, error, base, append_time, start))
            elif version >= 2:
                out.append(_PART_V2.pack(index, error, base, append_time))
            else:
                out.append(_PART_V0.pack(index, error, base))
            if version >= 8:
                out.append(_count(0, flexible))  # record errors
                out.append(_put_string(message, flexible))
            if flexible:
                out.append(b"\x00")  # partition tagged fields
        if flexible:
            out.append(b"\x00")  # topic tagged fields
    if version >= 1:
        out.append(_I32.pack(throttle_time_ms))
    if flexible:
        out.append(b"\x00")
    return b"".join(out)


_FRAME_HEAD = struct.Struct(">ii")
# (version, topic name or id, partition) -> (bytes before the partition's fields, after them,
# response header tag byte, which partition fields: 0 = v0-v1, 1 = + log append time (v2-v4),
# 2 = + log start offset (v5+)): the parts of a one-partition answer that do not change from
# request to request
_OK_TEMPLATES: dict[tuple[int, Any, int], tuple[bytes, bytes, bytes, int]] = {}
_OK_TEMPLATES_MAX = 4096
_PART_FIELDS = (_PART_V0, _PART_V2, _PART_V5)
try:    # the frame packed in one C call (protocol/_produce.c); the same bytes as below
    from ._produce import frame_ok as _frame_ok
except ImportError:  # pragma: no cover - the extension is optional
    _frame_ok = None


def _ok_template(version: int, key: Any, index: int) -> tuple[bytes, bytes, bytes, int]:
    flexible = version >= 9
    if version >= 13:
        tid = key if isinstance(key, uuid.UUID) else uuid.UUID(int=0)
        name = tid.bytes
    else:
        name = _put_string(key if isinstance(key, str) else None, flexible)
    pre = _count(1, flexible) + name + _count(1, flexible)
    suf = b""
    if version >= 8:
        suf += _count(0, flexible) + _put_string(None, flexible)
    if flexible:
        suf += b"\x00\x00"      # partition, then topic tagged fields
    if version >= 1:
        suf += _I32.pack(0)     # throttle time
    if flexible:
        suf += b"\x00"
    fields = 2 if version >= 5 else 1 if version >= 2 else 0
    tpl = (pre, suf, b"\x00" if flexible else b"", fields)
    if len(_OK_TEMPLATES) >= _OK_TEMPLATES_MAX:
        _OK_TEMPLATES.clear()
    _OK_TEMPLATES[(version, key, index)] = tpl
    return tpl


def frame_produce_ok(version: int, correlation_id: int, key: str | uuid.UUID | None, index: int,
                     base_offset: int, append_time: int, log_start: int) -> bytes:
    """The whole response frame (length prefix, response header, body) of a successful
    one-partition Produce: ``encode_produce_response(version, [(key, [(index, 0, base_offset,
    append_time, log_start, None)])])`` behind its header, in one piece. The task-less path
    answers every small request this way (no per-field encoding per answer)."""
    tpl = _OK_TEMPLATES.get((version, key, index))
    if tpl is None:
        if not 0 <= version <= PRODUCE_MAX_VERSION:
            raise ValueError(f"ProduceResponse v{version} is not supported")
        tpl = _ok_template(version, key, index)
    if _frame_ok is not None:
        return _frame_ok(*tpl, correlation_id, index, base_offset, append_time, log_start)
    return _frame_ok_py(*tpl, correlation_id, index, base_offset, append_time, log_start)


def _frame_ok_py(pre: bytes, suf: bytes, tag: bytes, fields: int, correlation_id: int,
                 index: int, base_offset: int, append_time: int, log_start: int) -> bytes:
    """``_produce.frame_ok`` in Python (without the extension): the same bytes."""
    part = _PART_FIELDS[fields]
    if fields == 2:
        packed = part.pack(index, 0, base_offset, append_time, log_start)
    elif fields == 1:
        packed = part.pack(index, 0, base_offset, append_time)
    else:
        packed = part.pack(index, 0, base_offset)
    body = pre + packed + suf
    return _FRAME_HEAD.pack(len(body) + 4 + len(tag), correlation_id) + tag + body
