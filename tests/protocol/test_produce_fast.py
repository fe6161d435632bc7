"""The direct ProduceResponse encoder and the light Produce request objects against
kafka-python's generic codec (the reference for the wire format)."""
from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafka.protocol.producer import ProduceRequest, ProduceResponse

from protocol import parse_request
from protocol.produce_fast import FastProduceRequest, encode_produce_response

TR = ProduceResponse.TopicProduceResponse
PR = TR.PartitionProduceResponse


def codec_response(version: int, topics, throttle: int = 0) -> bytes:
    out = []
    for key, parts in topics:
        ps = [PR(version=version, index=i, error_code=e, base_offset=b, log_append_time_ms=a,
                 log_start_offset=s, record_errors=[], error_message=m)
              for i, e, b, a, s, m in parts]
        kw = {"topic_id": key} if version >= 13 else {"name": key}
        out.append(TR(version=version, partition_responses=ps, **kw))
    return bytes(ProduceResponse(version=version, responses=out,
                                 throttle_time_ms=throttle).encode(version=version))


@pytest.mark.parametrize("version", range(0, 14))
def test_response_encoder_matches_codec(version: int) -> None:
    tid = uuid.uuid4()
    topics = [(tid if version >= 13 else "t\u00e9", [(0, 0, 42, -1, 0, None),
                                                   (3, 2, -1, -1, 5, "record batch CRC")]),
              (uuid.uuid4() if version >= 13 else "other", [])]
    assert encode_produce_response(version, topics, 9) == codec_response(version, topics, 9)
    # and the codec reads it back field for field
    resp = ProduceResponse.decode(encode_produce_response(version, topics), version=version)
    p = resp.responses[0].partition_responses[1]
    assert (p.index, p.error_code, p.base_offset) == (3, 2, -1)


@settings(max_examples=60, deadline=None)
@given(version=st.integers(0, 13),
       parts=st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(-1, 120),
                                st.integers(-1, 2**63 - 1), st.integers(-1, 2**62),
                                st.integers(-1, 2**62),
                                st.one_of(st.none(), st.text(max_size=300))), max_size=5),
       name=st.text(min_size=1, max_size=200))
def test_response_encoder_matches_codec_for_any_values(version, parts, name) -> None:
    key = uuid.uuid5(uuid.NAMESPACE_DNS, name) if version >= 13 else name
    topics = [(key, parts)]
    assert encode_produce_response(version, topics) == codec_response(version, topics)


def test_response_encoder_rejects_unknown_version() -> None:
    with pytest.raises(ValueError):
        encode_produce_response(14, [])


@pytest.mark.parametrize("version", [0, 3, 8, 9, 12, 13])
def test_light_request_converts_to_codec_object(version: int) -> None:
    part = ProduceRequest.TopicProduceData.PartitionProduceData
    key = {"topic_id": uuid.uuid4()} if version >= 13 else {"name": "tp"}
    req = ProduceRequest(version=version, acks=1, timeout_ms=10, topic_data=[
        ProduceRequest.TopicProduceData(version=version, partition_data=[
            part(version=version, index=1, records=b"abc")], **key)],
        **({"transactional_id": None} if version >= 3 else {}))
    req.with_header(correlation_id=5, client_id="c")
    frame = bytearray(req.encode(version=version, header=True, framed=False))
    _, body = parse_request(frame)
    assert isinstance(body, FastProduceRequest)
    rec = body.topic_data[0].partition_data[0].records
    assert not rec.readonly  # a view into the (owned) frame: writable, no copy
    codec = body.to_codec()
    assert isinstance(codec, ProduceRequest)
    assert bytes(codec.encode(version=version)) == bytes(req.encode(version=version))


@pytest.mark.parametrize("version", range(0, 14))
def test_a_framed_ok_answer_is_the_encoded_one_behind_its_header(version: int) -> None:
    """``frame_produce_ok`` (the task-less path's one-piece answer, from a cached template)
    is byte for byte the response header plus ``encode_produce_response`` of the same
    one-partition success, for every version, topic and partition, also when the template
    is reused with other offsets."""
    from protocol.frames import RequestHeader, encode_response_parts
    from protocol.produce_fast import frame_produce_ok

    for key in (uuid.uuid4() if version >= 13 else "t\u00e9", "other", None):
        for index, base, append_time, start, corr in ((0, 42, -1, 0, 7), (3, 1 << 40, 1700, 5,
                                                                          -2), (3, 0, -1, 0, 1)):
            header = RequestHeader(0, version, corr)
            want = b"".join(encode_response_parts(header, [encode_produce_response(
                version, [(key, [(index, 0, base, append_time, start, None)])])]))
            assert frame_produce_ok(version, corr, key, index, base, append_time,
                                    start) == want
