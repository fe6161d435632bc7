"""Request/response framing and the advertised API table, checked against kafka-python's client
encoders/decoders (the same code real kafka-python clients use on the wire)."""
from __future__ import annotations

import struct
import uuid

import pytest
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse, MetadataRequest
from kafka.protocol.producer import ProduceRequest

import protocol
from protocol import (
    SUPPORTED_APIS, ErrorCode, MalformedRequestError, UnknownApiError, UnsupportedVersionError,
    api_versions_fallback, encode_response, parse_request, request_class, response_class,
)
from protocol.examples import sample_message
from protocol.frames import decode_body

ALL_VERSIONS = [(k, v) for k, (lo, hi) in sorted(SUPPORTED_APIS.items()) for v in range(lo, hi + 1)]


def client_frame(req, correlation_id: int = 7, client_id: str | None = "cli") -> bytes:
    """What a kafka-python client puts on the wire after the length prefix."""
    req.with_header(correlation_id=correlation_id, client_id=client_id)
    return bytes(req.encode(header=True))


@pytest.mark.parametrize("api_key,version", ALL_VERSIONS)
def test_every_advertised_version_round_trips(api_key: int, version: int) -> None:
    for cls, is_response in ((request_class(api_key), False), (response_class(api_key), True)):
        for fill in (True, False):
            encoded = bytes(sample_message(cls, version, fill).encode(version=version))
            decoded = decode_body(api_key, version, memoryview(encoded), 0, response=is_response)
            assert decoded.version == version
            assert bytes(decoded.encode(version=version)) == encoded


@pytest.mark.parametrize("api_key,version", ALL_VERSIONS)
def test_parse_request_reads_client_frames_of_every_version(api_key: int, version: int) -> None:
    req = sample_message(request_class(api_key), version)
    header, body = parse_request(client_frame(req, correlation_id=1234, client_id="c-1"))
    assert (header.api_key, header.api_version, header.correlation_id) == (api_key, version, 1234)
    assert header.client_id == "c-1"
    assert header.flexible == bool(request_class(api_key).flexible_version_q(version))
    assert body.version == version
    assert bytes(body.encode(version=version)) == bytes(req.encode(version=version))


@pytest.mark.parametrize("api_key,version", ALL_VERSIONS)
def test_encode_response_is_readable_by_kafka_python(api_key: int, version: int) -> None:
    header, _ = parse_request(client_frame(sample_message(request_class(api_key), version), 99))
    resp = sample_message(response_class(api_key), version)
    if api_key == 18:
        resp.error_code = 0  # kafka-python reads any failed ApiVersions body as v0
    frame = encode_response(header, resp)
    (size,) = struct.unpack_from(">i", frame)
    assert size == len(frame) - 4
    cls = response_class(api_key)[version]
    decoded = cls.decode(frame[4:], header=True)
    assert decoded.header.correlation_id == 99
    decoded._header = None  # kafka-python cannot re-encode a response that carries its header
    assert bytes(decoded.encode(version=version)) == bytes(resp.encode(version=version))


def test_response_header_versions() -> None:
    # Metadata v9+ is flexible: response header v1 has one (empty) tagged-field byte
    h, _ = parse_request(client_frame(MetadataRequest(version=12, topics=None), 5))
    body = bytes(sample_message(response_class(3), 12).encode(version=12))
    frame = encode_response(h, sample_message(response_class(3), 12))
    assert frame[8:9] == b"\x00" and frame[9:] == body
    # ApiVersions v3 is flexible too, but its response header is always v0
    h, _ = parse_request(client_frame(sample_message(ApiVersionsRequest, 3), 6))
    body = bytes(sample_message(ApiVersionsResponse, 3).encode(version=3))
    frame = encode_response(h, sample_message(ApiVersionsResponse, 3))
    assert frame[8:] == body


def test_request_header_v2_tagged_fields_are_collected() -> None:
    raw = bytearray(client_frame(MetadataRequest(version=12, topics=None), 3))
    # header v2 = key(2) version(2) corr(4) client_id(2+3) tags(1): insert one tagged field
    assert raw[13] == 0
    raw[13:14] = b"\x01\x05\x02hi"
    header, body = parse_request(bytes(raw))
    assert header.tagged_fields == {5: b"hi"}
    assert body.topics is None


def test_null_client_id_and_header_v0_style_frames() -> None:
    header, _ = parse_request(client_frame(MetadataRequest(version=1, topics=None), 3, None))
    assert header.client_id is None


def test_build_api_versions_response_lists_our_ranges() -> None:
    for version in range(0, 5):
        h, _ = parse_request(client_frame(sample_message(ApiVersionsRequest, version), 11))
        frame = encode_response(h, protocol.build_api_versions_response(h))
        decoded = ApiVersionsResponse[version].decode(frame[4:], header=True)
        got = {k.api_key: (k.min_version, k.max_version) for k in decoded.api_keys}
        assert got == SUPPORTED_APIS and decoded.error_code == 0


def test_unsupported_api_versions_version_gets_v0_fallback() -> None:
    # a future client sends ApiVersions v9 with a v2 header
    frame = struct.pack(">hhih", 18, 9, 77, 3) + b"abc" + b"\x00" + b"\x00\x00"
    with pytest.raises(UnsupportedVersionError) as info:
        parse_request(frame)
    header = info.value.header
    assert header.correlation_id == 77 and header.api_version == 9
    answer = api_versions_fallback(header)
    decoded = ApiVersionsResponse.decode(answer, header=True, framed=True)
    assert decoded.header.correlation_id == 77
    assert decoded.error_code == ErrorCode.UNSUPPORTED_VERSION
    assert {k.api_key: (k.min_version, k.max_version) for k in decoded.api_keys}[18] == (0, 4)


def test_unsupported_version_and_unknown_api() -> None:
    hi = protocol.SUPPORTED_APIS[2][1]   # ListOffsets: kafka-python knows one version more
    with pytest.raises(UnsupportedVersionError) as info:
        parse_request(client_frame(sample_message(request_class(2), hi + 1), 4))
    assert info.value.header.correlation_id == 4
    # no top-level error code in a ListOffsets response: nothing to answer with (close)
    assert protocol.unsupported_version_response(info.value.header) is None
    with pytest.raises(UnsupportedVersionError) as info3:
        parse_request(client_frame(sample_message(request_class(22), 6), 9))
    answer = protocol.unsupported_version_response(info3.value.header)
    corr = struct.unpack_from(">i", answer, 4)[0]
    resp = response_class(22).decode(answer[9:], version=6)   # after length, corr, tags
    assert corr == 9 and resp.error_code == ErrorCode.UNSUPPORTED_VERSION
    with pytest.raises(UnknownApiError) as info2:
        parse_request(struct.pack(">hhih", 4242, 0, 5, -1) + b"junk")
    assert info2.value.header.api_key == 4242


@pytest.mark.parametrize("api_key,version", ALL_VERSIONS)
def test_truncated_frames_raise_typed_errors(api_key: int, version: int) -> None:
    frame = client_frame(sample_message(request_class(api_key), version), 8)
    header_len = 8 + 2 + 3
    for cut in range(0, len(frame)):
        try:
            parse_request(frame[:cut])
        except MalformedRequestError as exc:
            if cut >= header_len:
                assert exc.header is not None and exc.header.correlation_id == 8
        else:
            # a prefix can only parse if nothing after it was needed (trailing tags/empty arrays)
            assert cut >= header_len


def test_garbage_never_escapes_as_untyped_exception() -> None:
    import random

    rng = random.Random(1)
    for _ in range(3000):
        frame = bytearray(rng.randbytes(rng.randint(0, 64)))
        if len(frame) >= 4 and rng.random() < 0.8:
            key = rng.choice(list(SUPPORTED_APIS))
            struct.pack_into(">hh", frame, 0, key, rng.randint(*SUPPORTED_APIS[key]))
        try:
            parse_request(bytes(frame))
        except protocol.ProtocolError:
            pass


def test_kip896_minima_and_client_maxima_are_covered() -> None:
    minima = {1: 4, 2: 1, 8: 2, 9: 1, 11: 2, 19: 2, 20: 1, 32: 1, 23: 2}
    for key, lo in minima.items():
        assert SUPPORTED_APIS[key][0] <= lo <= SUPPORTED_APIS[key][1]
    librdkafka = {0: 10, 1: 16, 2: 7, 3: 12, 8: 9, 9: 9, 10: 2, 11: 5, 12: 3, 13: 1, 14: 3,
                  18: 3, 22: 4}
    for key, hi in librdkafka.items():
        assert SUPPORTED_APIS[key][1] >= hi
    assert SUPPORTED_APIS[0][0] == 0  # Produce from v0 (KAFKA-18659)
    assert SUPPORTED_APIS[23][1] >= 3


def test_error_codes() -> None:
    assert ErrorCode.NONE == 0 and ErrorCode.UNKNOWN_SERVER_ERROR == -1
    assert ErrorCode.CORRUPT_MESSAGE == 2 and ErrorCode.UNSUPPORTED_VERSION == 35
    assert ErrorCode.NOT_LEADER_OR_FOLLOWER == 6 and ErrorCode.UNKNOWN_TOPIC_ID == 100
    assert ErrorCode.UNSUPPORTED_COMPRESSION_TYPE == 76 and ErrorCode.KAFKA_STORAGE_ERROR == 56
    assert protocol.api_name(0) == "Produce" and protocol.api_name(75) == "DescribeTopicPartitions"


@pytest.mark.parametrize("version", range(0, 14))
def test_produce_fast_parser_matches_codec_and_does_not_copy(version: int) -> None:
    part_cls = ProduceRequest.TopicProduceData.PartitionProduceData
    records = bytes(range(256)) * 10
    topic_kwargs = {"topic_id": uuid.uuid4()} if version >= 13 else {"name": "t\u00e9"}
    topic = ProduceRequest.TopicProduceData(version=version, partition_data=[
        part_cls(version=version, index=3, records=records),
        part_cls(version=version, index=4, records=None)], **topic_kwargs)
    kwargs = {"transactional_id": "tx"} if version >= 3 else {}
    req = ProduceRequest(version=version, acks=-1, timeout_ms=1500, topic_data=[topic], **kwargs)
    frame = bytearray(client_frame(req, 21))
    header, body = parse_request(memoryview(frame))
    generic = decode_body(0, version, memoryview(frame), len(frame) - len(req.encode()))
    assert bytes(body.encode(version=version)) == bytes(generic.encode(version=version))
    rec = body.topic_data[0].partition_data[0].records
    assert isinstance(rec, memoryview) and bytes(rec) == records
    assert body.topic_data[0].partition_data[1].records is None
    assert body.acks == -1 and body.timeout_ms == 1500
    assert (body.transactional_id == "tx") if version >= 3 else True
    frame[len(frame) - 20] ^= 0xFF  # the view aliases the frame: no copy was made
    assert bytes(rec) != records
    for cut in range(len(frame) - len(req.encode()), len(frame) - 1, 97):
        with pytest.raises(MalformedRequestError):
            parse_request(bytes(frame[:cut]))


@pytest.mark.parametrize("version", range(4, 17))
def test_fetch_fast_encoder_matches_codec_with_tags_and_buffer_lists(version: int) -> None:
    from kafka.protocol.consumer import FetchResponse

    topic_cls = FetchResponse.FetchableTopicResponse
    part_cls = topic_cls.PartitionData
    big = memoryview(bytearray(b"r" * 100_000))
    small = b"s" * 10
    extra: dict = {}
    if version >= 12:
        extra["current_leader"] = part_cls.LeaderIdAndEpoch(version=version, leader_id=0,
                                                            leader_epoch=3)
    parts = [
        part_cls(version=version, partition_index=0, error_code=0, high_watermark=10,
                 last_stable_offset=10, log_start_offset=0, aborted_transactions=None,
                 preferred_read_replica=-1, records=[big, small], **extra),
        part_cls(version=version, partition_index=1, error_code=1, high_watermark=-1,
                 last_stable_offset=-1, log_start_offset=-1, aborted_transactions=[
                     part_cls.AbortedTransaction(version=version, producer_id=5,
                                                 first_offset=6)],
                 preferred_read_replica=-1, records=None),
    ]
    tkw = {"topic_id": uuid.uuid4()} if version >= 13 else {"topic": "t"}
    top: dict = {"throttle_time_ms": 0, "error_code": 0, "session_id": 0}
    if version >= 16:
        top["node_endpoints"] = [FetchResponse.NodeEndpoint(version=version, node_id=0,
                                                            host="h", port=1, rack=None)]
    resp = FetchResponse(version=version, responses=[topic_cls(version=version, partitions=parts,
                                                               **tkw)], **top)
    header = protocol.RequestHeader(1, version, 31)
    bufs = protocol.encode_response_buffers(header, resp)
    assert any(b is big for b in bufs)  # the payload object itself, not a copy
    frame = b"".join(bytes(b) for b in bufs)
    assert frame == encode_response(header, resp)
    parts[0].records = bytes(big) + small
    expect = bytes(resp.encode(version=version))
    assert frame[8 + (version >= 12):] == expect
    decoded = FetchResponse[version].decode(frame[4:], header=True)
    assert decoded.header.correlation_id == 31
    assert decoded.responses[0].partitions[0].records == bytes(big) + small


@pytest.mark.parametrize("api_key,version", ALL_VERSIONS)
def test_parse_response_reads_our_frames_exactly(api_key: int, version: int) -> None:
    header = protocol.RequestHeader(api_key, version, 17)
    resp = sample_message(response_class(api_key), version)
    if api_key == 18:
        resp.error_code = 0
    frame = encode_response(header, resp)
    corr, obj = protocol.parse_response(api_key, version, frame[4:])
    assert corr == 17 and bytes(obj.encode(version=version)) == bytes(resp.encode(version=version))
    with pytest.raises(MalformedRequestError):
        protocol.parse_response(api_key, version, frame[4:] + b"\x00")
    corr, obj = protocol.parse_response(18, 3, api_versions_fallback(header)[4:])
    assert corr == 17 and obj.error_code == ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize("version", range(0, 4))
def test_fetch_v0_to_v3_answers_carry_legacy_message_sets(version: int) -> None:
    from kafka.protocol.consumer import FetchResponse
    from kafka.record.memory_records import MemoryRecords

    topic_cls = FetchResponse.FetchableTopicResponse
    stored = [protocol.build_batch([(b"k", b"a"), (b"k", b"b")], base_offset=7, timestamp=50,
                                   compression=protocol.GZIP)]
    part = topic_cls.PartitionData(version=version, partition_index=0, error_code=0,
                                   high_watermark=9, records=stored)
    resp = FetchResponse(version=version, throttle_time_ms=0,
                         responses=[topic_cls(version=version, topic="t", partitions=[part])])
    header = protocol.RequestHeader(1, version, 5)
    corr, decoded = protocol.parse_response(1, version, encode_response(header, resp)[4:])
    records = decoded.responses[0].partitions[0].records
    magic = 0 if version < 2 else 1
    assert records[16] == magic
    mr = MemoryRecords(records)
    got = []
    while (batch := mr.next_batch()) is not None:
        got += [(m.offset, m.value, m.timestamp) for m in batch]
    assert got == [(7, b"a", 50 if magic else None), (8, b"b", 50 if magic else None)]


@pytest.mark.parametrize("api_key,version", ALL_VERSIONS)
def test_mutated_valid_frames_raise_only_protocol_errors(api_key: int, version: int) -> None:
    import random

    rng = random.Random(api_key * 1000 + version)
    frame = client_frame(sample_message(request_class(api_key), version), 8)
    for _ in range(150):
        buf = bytearray(frame)
        op = rng.randrange(4)
        if op == 0:  # bit flips after the api key/version
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(4, len(buf))] ^= 1 << rng.randrange(8)
        elif op == 1:  # a length/count field made huge or negative
            pos = rng.randrange(8, max(9, len(buf) - 3))
            buf[pos:pos + 4] = rng.choice([b"\x7f\xff\xff\xff", b"\xff\xff\xff\xfe",
                                           b"\x80\x00\x00\x00", b"\xff\xff\xff\x7f"])
        elif op == 2:  # inserted garbage
            pos = rng.randrange(8, len(buf))
            buf[pos:pos] = rng.randbytes(rng.randint(1, 16))
        else:  # deleted bytes
            pos = rng.randrange(8, len(buf))
            del buf[pos:pos + rng.randint(1, 8)]
        try:
            parse_request(bytes(buf))
        except protocol.ProtocolError:
            pass


FLEXIBLE_VERSIONS = [(k, v) for k, v in ALL_VERSIONS if request_class(k).flexible_version_q(v)]


@pytest.mark.parametrize("api_key,version", FLEXIBLE_VERSIONS)
def test_unknown_tagged_fields_are_ignored(api_key: int, version: int) -> None:
    """Newer clients may add tagged fields we do not know, in the header and in the body."""
    req = sample_message(request_class(api_key), version, fill=False)
    frame = bytearray(client_frame(req, 44, "c"))
    body = bytes(req.encode(version=version))
    assert frame.endswith(body) and body.endswith(b"\x00")
    header_len = len(frame) - len(body)
    assert frame[header_len - 1] == 0  # header v2: empty tagged fields
    unknown = b"\x01" + b"\xe8\x07" + b"\x03abc"  # one field, tag 1000, 3 bytes
    new = frame[:header_len - 1] + unknown + body[:-1] + unknown
    header, decoded = parse_request(bytes(new))
    assert header.correlation_id == 44 and header.tagged_fields == {1000: b"abc"}
    assert decoded.version == version
