"""Request/response framing: request headers v1/v2, response headers v0/v1, ApiVersions fallback.

A frame here is the bytes after the 4-byte length prefix. Every decode failure becomes one of
the typed errors in :mod:`protocol.errors`, so a bad client can never crash the broker.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from .apis import _SUPPORTED, API_VERSIONS_KEY, PRODUCE_KEY, SUPPORTED_APIS
from .errors import ErrorCode, MalformedRequestError, UnknownApiError, UnsupportedVersionError

_HDR = struct.Struct(">hhi")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")


@dataclass(slots=True)
class RequestHeader:
    """The decoded request header; ``flexible`` tells whether header v2 (tagged fields) was used."""

    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None = None
    flexible: bool = False
    tagged_fields: dict[int, bytes] = field(default_factory=dict)


def read_uvarint(buf: memoryview | bytes, pos: int) -> tuple[int, int]:
    """Decode an unsigned varint (KIP-482) at ``pos``; returns (value, new pos)."""
    value = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise MalformedRequestError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise MalformedRequestError("varint too long")


def read_tagged_fields(buf: memoryview | bytes, pos: int) -> tuple[dict[int, bytes], int]:
    """Skip/collect a tagged-field section; returns ({tag: raw bytes}, new pos)."""
    count, pos = read_uvarint(buf, pos)
    tags: dict[int, bytes] = {}
    for _ in range(count):
        tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        if pos + size > len(buf):
            raise MalformedRequestError("truncated tagged field")
        tags[tag] = bytes(buf[pos:pos + size])
        pos += size
    return tags, pos


# (api key, version) -> whether its request header is v2 (flexible), for the versions of the
# APIs served, filled as they are first seen
_FLEXIBLE: dict[tuple[int, int], bool] = {}


def parse_header(frame: memoryview | bytes) -> tuple[RequestHeader, int]:
    """Decode the request header and return it with the offset where the body starts.

    Header version follows the API's flexible versions (v2 with tagged fields, else v1).
    For unknown APIs or versions the v1 form is read, which is enough to answer
    with the correlation id (clients send v2 headers only to flexible versions we know, or
    to ApiVersions, whose fallback answer is v0 anyway).
    """
    if len(frame) < 8:
        raise MalformedRequestError(f"frame of {len(frame)} bytes is shorter than a header")
    api_key, api_version, correlation_id = _HDR.unpack_from(frame, 0)
    header = RequestHeader(api_key, api_version, correlation_id)
    # Header v0 (no client id) exists only for ControlledShutdown v0, which we do not serve,
    # so every request we accept carries a (nullable) client id.
    if len(frame) < 10:
        raise MalformedRequestError("truncated request header", header)
    (n,) = _I16.unpack_from(frame, 8)
    pos = 10
    if n >= 0:
        if pos + n > len(frame):
            raise MalformedRequestError("truncated client id", header)
        try:
            header.client_id = str(frame[pos:pos + n], "utf-8")   # no bytes copy first
        except UnicodeDecodeError:
            raise MalformedRequestError("client id is not utf-8", header) from None
        pos += n
    flexible = _FLEXIBLE.get((api_key, api_version))
    if flexible is None:
        entry = _SUPPORTED.get(api_key)
        if entry is None:
            raise UnknownApiError(header)
        req_cls = entry[2]
        if api_key == API_VERSIONS_KEY and api_version > entry[1]:
            # Newer ApiVersions versions are flexible; the fallback answer needs only the header.
            flexible = True
        elif 0 <= api_version <= req_cls.max_version:
            flexible = bool(req_cls.flexible_version_q(api_version))
            _FLEXIBLE[(api_key, api_version)] = flexible
        else:
            flexible = False
    header.flexible = flexible
    if header.flexible:
        try:
            header.tagged_fields, pos = read_tagged_fields(frame, pos)
        except MalformedRequestError as exc:
            raise MalformedRequestError(str(exc), header) from None
    return header, pos


def parse_request(frame: memoryview | bytes) -> tuple[RequestHeader, Any]:
    """Decode header and body of one request frame (bytes after the length prefix).

    Returns (header, kafka-python request object with ``.version`` set).  Produce requests are
    decoded by a specialised parser whose ``records`` are memoryviews into ``frame`` (no copy):
    keep ``frame`` alive and unchanged while using them.
    """
    if not isinstance(frame, memoryview):
        frame = memoryview(frame)
    if _scan_produce is not None:
        # the common one-partition Produce envelope in one C call (None: anything else,
        # decoded below as before)
        got = _scan_produce(frame)
        if got is not None and got[0] in _PRODUCE_FLEXIBLE:
            # the same header and request objects the Python decoder builds (records: a
            # view into the frame)
            version, corr, client_id, acks, timeout_ms, name, index, start, n = got
            return RequestHeader(PRODUCE_KEY, version, corr, client_id,
                                 _PRODUCE_FLEXIBLE[version]), FastProduceRequest(
                version, None, acks, timeout_ms, [TopicProduceData(name, None, [
                    PartitionProduceData(index, frame[start:start + n])])], True)
    header, pos = parse_header(frame)
    lo, hi = SUPPORTED_APIS[header.api_key]
    if not lo <= header.api_version <= hi:
        raise UnsupportedVersionError(header)
    if header.api_key == PRODUCE_KEY:
        return header, parse_produce_body(frame, pos, header)
    body = decode_body(header.api_key, header.api_version, frame, pos, header)
    return header, body


def decode_body(api_key: int, version: int, buf: memoryview, pos: int,
                header: RequestHeader | None = None, response: bool = False) -> Any:
    """Decode a request (or response) body with kafka-python's compiled codec; typed errors."""
    entry = _SUPPORTED[api_key]
    cls = entry[3] if response else entry[2]
    flexible = bool(cls.flexible_version_q(version))
    try:
        fn = cls._struct.compiled_decode_from(version, compact=flexible, tagged=flexible,
                                              data_class=cls)
        obj, end = fn(buf, pos)
    except MalformedRequestError:
        raise
    except Exception as exc:  # any codec failure (struct.error, ValueError, ...) is bad input
        raise MalformedRequestError(f"cannot decode {cls.__name__} v{version}: {exc!r}",
                                    header) from None
    if end > len(buf):
        raise MalformedRequestError(f"truncated {cls.__name__} v{version}", header)
    _finish_decoded(obj, version)
    return obj


def _finish_decoded(obj: Any, version: int) -> None:
    """Set what the compiled decoder leaves unset (it skips ApiMessage.__init__)."""
    obj._version = version
    obj._header = None
    obj._min_version = None
    obj._max_version = None


def response_header_flexible(header: RequestHeader) -> bool:
    """Response header v1 (tagged fields) for flexible versions, except ApiVersions (always v0)."""
    if header.api_key == API_VERSIONS_KEY:
        return False
    entry = _SUPPORTED.get(header.api_key)
    return entry is not None and bool(entry[3].flexible_version_q(header.api_version))


def encode_response(header: RequestHeader, response_obj: Any) -> bytes:
    """Full response frame: length prefix, response header of the right version, body.

    Fetch responses may carry ``records`` as a list of buffers (see
    :func:`encode_response_buffers`, which avoids even the final join). A body that is already
    encoded (bytes, e.g. from :func:`encode_produce_response`) is framed as it is.
    """
    if isinstance(response_obj, (bytes, bytearray, memoryview)):
        return b"".join(encode_response_parts(header, [response_obj]))
    if header.api_key == 1:
        from .fetch_fast import encode_fetch_response

        return b"".join(encode_fetch_response(header, response_obj))
    body = response_obj.encode(version=header.api_version)
    flexible = response_header_flexible(header)
    prefix = struct.pack(">ii", len(body) + 4 + flexible, header.correlation_id)
    if flexible:
        return prefix + b"\x00" + body
    return prefix + body


def encode_response_parts(header: RequestHeader, body_parts: list[bytes | memoryview]) -> list[
        bytes | memoryview]:
    """Frame pre-encoded body buffers (e.g. a zero-copy Fetch body) for ``writelines``."""
    size = sum(len(p) for p in body_parts)
    flexible = response_header_flexible(header)
    prefix = struct.pack(">ii", size + 4 + flexible, header.correlation_id)
    return [prefix + b"\x00" if flexible else prefix, *body_parts]


def api_versions_body_v0(error_code: int) -> bytes:
    """ApiVersions v0 body: error code plus all our (key, min, max) ranges."""
    parts = [struct.pack(">hi", error_code, len(SUPPORTED_APIS))]
    for key, (lo, hi) in sorted(SUPPORTED_APIS.items()):
        parts.append(struct.pack(">hhh", key, lo, hi))
    return b"".join(parts)


def api_versions_fallback(header: RequestHeader) -> bytes:
    """Answer to an ApiVersions request of a version we do not support (KIP-511).

    The body is v0-encoded with UNSUPPORTED_VERSION and our ranges, and the header is v0, so a
    client of any version can read it and retry with a version we advertise.
    """
    body = api_versions_body_v0(ErrorCode.UNSUPPORTED_VERSION)
    return struct.pack(">ii", len(body) + 4, header.correlation_id) + body


def unsupported_version_response(header: RequestHeader) -> bytes | None:
    """An error answer to a request of a version we do not advertise, or None (close instead).

    Possible when kafka-python's codec knows that version of the API and its response carries a
    top-level error code: the response is then encoded at the asked version with
    UNSUPPORTED_VERSION and every other field at its default, so the client sees a clear error
    instead of a closed connection. ApiVersions has its own fallback (KIP-511).
    """
    entry = _SUPPORTED.get(header.api_key)
    if entry is None or header.api_key == API_VERSIONS_KEY:
        return None
    req_cls, resp_cls = entry[2], entry[3]
    v = header.api_version
    if not 0 <= v <= req_cls.max_version or v < req_cls.min_version:
        return None   # request header form unknown: the correlation id may be all we have
    try:
        fields = {f.name for f in resp_cls._struct._fields if f.for_version_q(v)}
        if "error_code" not in fields:
            return None
        kwargs: dict[str, Any] = {"error_code": int(ErrorCode.UNSUPPORTED_VERSION)}
        if "throttle_time_ms" in fields:
            kwargs["throttle_time_ms"] = 0
        return encode_response(header, resp_cls(version=v, **kwargs))
    except Exception:  # noqa: BLE001 - any codec gap: the caller closes the connection
        return None


def build_api_versions_response(header: RequestHeader, throttle_time_ms: int = 0) -> Any:
    """A filled ApiVersionsResponse object of the request's version (a convenience for handlers)."""
    cls = _SUPPORTED[API_VERSIONS_KEY][3]
    version = header.api_version
    keys = [cls.ApiVersion(api_key=k, min_version=lo, max_version=hi, version=version)
            for k, (lo, hi) in sorted(SUPPORTED_APIS.items())]
    kwargs: dict[str, Any] = {"error_code": 0, "api_keys": keys}
    if version >= 1:
        kwargs["throttle_time_ms"] = throttle_time_ms
    return cls(version=version, **kwargs)


def encode_response_buffers(header: RequestHeader, response_obj: Any) -> list[
        bytes | bytearray | memoryview]:
    """Like :func:`encode_response` but as a list of buffers for ``transport.writelines``.

    Fetch responses go through the zero-copy encoder: record payloads (bytes,
    memoryviews or lists of them in ``records``) are not copied. Pre-encoded bodies (bytes)
    are framed without a copy.
    """
    if isinstance(response_obj, (bytes, bytearray, memoryview)):
        return encode_response_parts(header, [response_obj])
    if header.api_key == 1:
        from .fetch_fast import encode_fetch_response

        return encode_fetch_response(header, response_obj)
    return [encode_response(header, response_obj)]


def parse_response(api_key: int, api_version: int, frame: memoryview | bytes) -> tuple[int, Any]:
    """Client side: decode a response frame (bytes after the length prefix) of a request we
    sent; returns (correlation id, response object).  Strict: every byte must be consumed.

    Used by tests and tools that speak to a broker over a raw socket.
    """
    if not isinstance(frame, memoryview):
        frame = memoryview(frame)
    if len(frame) < 4:
        raise MalformedRequestError("response shorter than its header")
    (correlation_id,) = _I32.unpack_from(frame, 0)
    pos = 4
    header = RequestHeader(api_key, api_version, correlation_id)
    if response_header_flexible(header):
        _, pos = read_tagged_fields(frame, pos)
    cls = _SUPPORTED[api_key][3]
    if (api_key == API_VERSIONS_KEY and len(frame) >= pos + 2
            and _I16.unpack_from(frame, pos)[0] == ErrorCode.UNSUPPORTED_VERSION):
        api_version = 0  # the KIP-511 fallback answer is a v0 body whatever was asked
    flexible = bool(cls.flexible_version_q(api_version))
    try:
        fn = cls._struct.compiled_decode_from(api_version, compact=flexible, tagged=flexible,
                                              data_class=cls)
        obj, end = fn(frame, pos)
    except Exception as exc:
        raise MalformedRequestError(f"cannot decode {cls.__name__} v{api_version}: {exc!r}",
                                    header) from None
    if end != len(frame):
        raise MalformedRequestError(
            f"{cls.__name__} v{api_version}: {len(frame) - end} bytes left over", header)
    _finish_decoded(obj, api_version)
    return correlation_id, obj


# at the end: produce_fast imports the readers defined above
from .produce_fast import (FastProduceRequest, PartitionProduceData,  # noqa: E402
                           TopicProduceData, parse_produce_body)

try:    # built by setup.py beside storage._copycrc; without it every frame is read in Python
    from ._produce import scan_produce as _scan_produce
except ImportError:  # pragma: no cover - the extension is optional
    _scan_produce = None
# the Produce versions served that scan_produce reads (v3-v12) -> whether their header is v2
_PRODUCE_FLEXIBLE = {v: bool(_SUPPORTED[PRODUCE_KEY][2].flexible_version_q(v))
                     for v in range(max(3, SUPPORTED_APIS[PRODUCE_KEY][0]),
                                    min(12, SUPPORTED_APIS[PRODUCE_KEY][1]) + 1)}
