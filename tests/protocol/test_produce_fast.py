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


def _frame_ok_impls() -> list:
    """protocol._produce.frame_ok when built, and the pure-Python packing it replaces."""
    import protocol.produce_fast as pf

    return [pytest.param(pf._frame_ok, id="c", marks=pytest.mark.skipif(
        pf._frame_ok is None, reason="protocol._produce not built")),
        pytest.param(pf._frame_ok_py, id="python")]


@pytest.mark.parametrize("impl", _frame_ok_impls())
@pytest.mark.parametrize("version", range(0, 14))
def test_a_framed_ok_answer_is_the_encoded_one_behind_its_header(version: int, impl,
                                                                 monkeypatch) -> None:
    """``frame_produce_ok`` (the task-less path's one-piece answer, from a cached template,
    packed by ``_produce.frame_ok`` or its Python fallback) is byte for byte the response
    header plus ``encode_produce_response`` of the same one-partition success, for every
    version, topic and partition, also when the template is reused with other offsets, and
    at the ends of every field's range."""
    import protocol.produce_fast as pf
    from protocol.frames import RequestHeader, encode_response_parts
    from protocol.produce_fast import frame_produce_ok

    monkeypatch.setattr(pf, "_frame_ok", impl)
    big, small = (1 << 63) - 1, -(1 << 63)
    for key in (uuid.uuid4() if version >= 13 else "t\u00e9", "other", None):
        for index, base, append_time, start, corr in ((0, 42, -1, 0, 7), (3, 1 << 40, 1700, 5,
                                                                          -2), (3, 0, -1, 0, 1),
                                                      ((1 << 31) - 1, big, big, big, -(1 << 31)),
                                                      (-(1 << 31), small, small, small,
                                                       (1 << 31) - 1)):
            header = RequestHeader(0, version, corr)
            want = b"".join(encode_response_parts(header, [encode_produce_response(
                version, [(key, [(index, 0, base, append_time, start, None)])])]))
            assert frame_produce_ok(version, corr, key, index, base, append_time,
                                    start) == want


def test_frame_ok_refuses_what_it_cannot_pack_and_leaves_nothing_half_built() -> None:
    """``_produce.frame_ok``: an unknown field layout, or values outside their wire types,
    raise (no truncated answer); bytes-like template pieces (bytearray, memoryview) pack as
    bytes do."""
    import protocol.produce_fast as pf

    if pf._frame_ok is None:
        pytest.skip("protocol._produce not built")
    pre, suf, tag, fields = pf._ok_template(9, "t", 0)
    want = pf._frame_ok_py(pre, suf, tag, fields, 5, 0, 10, -1, 0)
    assert pf._frame_ok(bytearray(pre), memoryview(suf), tag, fields, 5, 0, 10, -1, 0) == want
    with pytest.raises(ValueError):
        pf._frame_ok(pre, suf, tag, 3, 5, 0, 10, -1, 0)
    with pytest.raises(OverflowError):
        pf._frame_ok(pre, suf, tag, fields, 1 << 31, 0, 10, -1, 0)
    with pytest.raises(OverflowError):
        pf._frame_ok(pre, suf, tag, fields, 5, 0, 1 << 63, -1, 0)
    with pytest.raises(TypeError):
        pf._frame_ok("pre", suf, tag, fields, 5, 0, 10, -1, 0)


def _produce_frame(version: int, records: bytes | None, *, acks: int = -1, client="c-1",
                   name: str = "t\u00e9", txn: str | None = None, parts: int = 1) -> bytearray:
    part = ProduceRequest.TopicProduceData.PartitionProduceData
    req = ProduceRequest(version=version, acks=acks, timeout_ms=1500, topic_data=[
        ProduceRequest.TopicProduceData(version=version, name=name, partition_data=[
            part(version=version, index=7 + i, records=records) for i in range(parts)])],
        transactional_id=txn)
    req.with_header(correlation_id=4242, client_id=client)
    return bytearray(req.encode(version=version, header=True, framed=False))


def _decoded(frame: bytearray, scanner) -> object:
    """parse_request's outcome with the given scanner: the fields of what it returned, or the
    type and message of what it raised."""
    from protocol import frames
    saved = frames._scan_produce
    frames._scan_produce = scanner
    try:
        header, req = parse_request(frame)
    except Exception as exc:  # noqa: BLE001 - the outcome compared
        return type(exc), str(exc)
    finally:
        frames._scan_produce = saved
    head = (header.api_key, header.api_version, header.correlation_id, header.client_id,
            header.flexible, header.tagged_fields, type(req))
    if not isinstance(req, FastProduceRequest):      # a flipped bit made it another API
        return head
    return (*head, req.version,
            req.transactional_id, req.acks, req.timeout_ms,
            [(t.name, t.topic_id, [(p.index, None if p.records is None else
                                    (bytes(p.records), p.records.readonly,
                                     p.records.obj is frame)) for p in t.partition_data])
             for t in req.topic_data])


def _plain_batch(n: int = 3, pid: int = -1) -> bytes:
    from protocol import build_batch
    raw = bytearray(build_batch([(None, b"v" * 90)] * n, timestamp=1_700_000_000_000))
    raw[43:51] = pid.to_bytes(8, "big", signed=True)
    return bytes(raw)


def _scanner():
    from protocol import frames
    return frames._scan_produce


@pytest.mark.skipif(_scanner() is None, reason="protocol._produce not built")
@pytest.mark.parametrize("version", range(3, 14))
def test_the_c_envelope_scan_reads_what_the_python_decoder_reads(version: int) -> None:
    """protocol._produce.scan_produce (parse_request's C path for plain one-partition
    Produce requests) gives the same header and request as the Python decoder, and frames it
    does not take (other shapes, every truncation, single-bit corruptions of the envelope)
    get exactly the Python decoder's outcome, errors included."""
    scan = _scanner()
    plain = _plain_batch()
    frames_ = [_produce_frame(version, plain), _produce_frame(version, plain, client=None),
               _produce_frame(version, plain, acks=1, client="", name="x" * 300),
               _produce_frame(version, _plain_batch(40)),
               # shapes it leaves to Python: acks 0, a producer id, a transactional id, two
               # partitions, null or short records
               _produce_frame(version, plain, acks=0), _produce_frame(version, _plain_batch(pid=5)),
               _produce_frame(version, plain, txn="tx"), _produce_frame(version, plain, parts=2),
               _produce_frame(version, None), _produce_frame(version, b"x" * 30)]
    taken = 0
    for frame in frames_:
        assert _decoded(frame, scan) == _decoded(bytearray(frame), None)
        taken += scan(frame) is not None
    assert taken == (4 if version <= 12 else 0)
    frame = frames_[0]
    for cut in range(len(frame) - 1):
        short = bytearray(frame[:cut])
        assert _decoded(short, scan) == _decoded(bytearray(short), None), cut
    for i in range(min(len(frame), 120)):
        for bit in (0x01, 0x80):
            bad = bytearray(frame)
            bad[i] ^= bit
            assert _decoded(bad, scan) == _decoded(bytearray(bad), None), (i, bit)


@pytest.mark.skipif(_scanner() is None, reason="protocol._produce not built")
@pytest.mark.parametrize("version", range(3, 14))
def test_the_run_key_of_a_scanned_request_is_the_python_decoded_ones(version: int) -> None:
    """``run_key`` reads only the records' size of a request the C scan read (``plain``: the
    scan checked the rest) and gives the key it gives the same request decoded in Python,
    for every shape, size class (run, lone, too large) and truncation/corruption."""
    from protocol import frames
    from broker.handlers import produce as produce_mod
    scan = _scanner()
    plain = _plain_batch()
    big = _plain_batch(200)      # over the run limit below: a run of its own
    cases = [_produce_frame(version, plain), _produce_frame(version, plain, acks=1),
             _produce_frame(version, big), _produce_frame(version, plain, acks=0),
             _produce_frame(version, _plain_batch(pid=5)),
             _produce_frame(version, plain, txn="tx"), _produce_frame(version, plain, parts=2),
             _produce_frame(version, None), _produce_frame(version, b"x" * 30)]
    frame = cases[0]
    for i in range(min(len(frame), 120)):
        bad = bytearray(frame)
        bad[i] ^= 0x80
        cases.append(bad)

    def shape(key):
        if type(key) is tuple and len(key) == 2 and type(key[1]) is object:
            return ("alone", key[0])     # (key, object()): equal to no other key
        return key

    saved = (produce_mod.RUN_MAX_RECORDS_BYTES, produce_mod.LONE_MAX_RECORDS_BYTES)
    produce_mod.RUN_MAX_RECORDS_BYTES = len(plain) + 1
    seen = set()
    try:
        for lone_max in (1 << 20, len(plain) + 50):
            produce_mod.LONE_MAX_RECORDS_BYTES = lone_max
            for frame in cases:
                frames._scan_produce = scan
                try:
                    try:
                        _h, fast = parse_request(bytearray(frame))
                    except Exception:  # noqa: BLE001 - not decodable either way
                        continue
                finally:
                    frames._scan_produce = None
                try:
                    _h, slow = parse_request(bytearray(frame))
                finally:
                    frames._scan_produce = scan
                assert not getattr(slow, "plain", False)
                if getattr(fast, "plain", False):
                    seen.add(shape(produce_mod.run_key(fast)) is not None)
                assert shape(produce_mod.run_key(fast)) == shape(produce_mod.run_key(slow)), frame
    finally:
        produce_mod.RUN_MAX_RECORDS_BYTES, produce_mod.LONE_MAX_RECORDS_BYTES = saved
    assert seen == ({True, False} if version <= 12 else set())


def _reference_stamp(buf: bytearray, base: int, epoch: int, max_bytes: int, zstd_ok: bool,
                     earliest: int, latest: int, defer_from: int):
    """broker.partition's Python checks and stamping of plain batches (what stamp_plain
    must match): (records, batches, max timestamp, deferred CRC) after stamping ``buf``, or
    None. A lone batch of ``defer_from`` bytes or more is checked without its CRC, which is
    returned (the WAL's copy checks it)."""
    import protocol
    try:
        views = list(protocol.iter_batches(buf))
        deferred = len(views) == 1 and views[0].size >= defer_from
        for v in views:
            protocol.validate_batch(v, crc=not deferred)
    except protocol.CorruptRecordError:
        return None
    if not views:
        return None
    for v in views:
        if v.producer_id != -1 or v.attributes & 0x30 or v.size > max_bytes \
                or v.compression > 4 or (v.compression == 4 and not zstd_ok) \
                or v.max_timestamp < 0 or v.max_timestamp > latest \
                or 0 <= v.base_timestamp < earliest:
            return None
    nxt, top = base, -1
    for v in views:
        protocol.set_base_offset(buf, v.pos, nxt)
        protocol.set_partition_leader_epoch(buf, v.pos, epoch)
        nxt += v.last_offset_delta + 1
        top = max(top, v.max_timestamp)
    return nxt - base, len(views), top, views[0].crc if deferred else None


@pytest.mark.skipif(_scanner() is None, reason="protocol._produce not built")
def test_stamp_plain_checks_and_stamps_as_the_python_path():
    """protocol._produce.stamp_plain (Partition.append_now's C path) stamps exactly the
    payloads the Python checks pass, as they would be stamped, and leaves every other payload
    untouched (None): the Python path then answers it. A lone batch from ``defer_from`` bytes
    is stamped without its CRC checked - also a corrupt one - and its CRC returned."""
    from protocol import build_batch, rewrite_crc
    from protocol._produce import stamp_plain

    def batch(n=3, ts=1_700_000_000_000, fields=None):
        fields = fields or {}
        raw = bytearray(build_batch([(None, b"w" * 50)] * n, timestamp=ts))
        for (at, size), value in fields.items():
            raw[at:at + size] = value.to_bytes(size, "big", signed=True)
        if fields:
            rewrite_crc(raw, 0)
        return bytes(raw)

    ok = batch()
    bad_crc = bytearray(ok)
    bad_crc[-1] ^= 1
    cases = [ok, ok + batch(1) + batch(7), batch(40),
             bytes(bad_crc), ok + bytes(bad_crc), ok[:-1], ok + b"\x00" * 70, ok + b"\x00" * 10,
             batch(fields={(43, 8): 9}),                 # a producer id
             # transactional, control
             batch(fields={(21, 2): 0x10}), batch(fields={(21, 2): 0x20}),
             batch(fields={(21, 2): 4}), batch(fields={(21, 2): 5}),   # zstd, unknown codec
             batch(fields={(35, 8): -1}),                # max timestamp unset
             batch(ts=10), batch(ts=1 << 50),       # before / after the bounds
             batch(fields={(23, 4): 5}), batch(fields={(57, 4): 0}),          # counts
             batch(fields={(16, 1): 1}), b""]
    now = 1_700_000_000_500
    for zstd_ok in (False, True):
        for max_bytes in (1 << 20, 300):
            for defer_from in (1 << 16, 200):
                for payload in cases:
                    args = (7, 3, max_bytes, zstd_ok, now - 10**9, now + 10**9, defer_from)
                    want_buf = bytearray(payload)
                    want = _reference_stamp(want_buf, *args)
                    got_buf = bytearray(payload)
                    got = stamp_plain(memoryview(got_buf), *args)
                    assert got == want, (payload[:70], args)
                    assert got_buf == (want_buf if want is not None else payload)
    # extreme bounds (the partition clamps LONG_MAX sums to 64 bits) and a read-only buffer
    assert stamp_plain(memoryview(bytearray(ok)), 0, 0, 1 << 20, True, -(1 << 63),
                       (1 << 63) - 1, 1 << 16) == (3, 1, 1_700_000_000_000, None)
    # a lone batch from defer_from: stamped, its CRC returned unchecked (bad_crc's is wrong)
    for payload in (ok, bytes(bad_crc)):
        buf = bytearray(payload)
        got = stamp_plain(memoryview(buf), 9, 4, 1 << 20, True, 0, 1 << 62, len(payload))
        assert got == (3, 1, 1_700_000_000_000, int.from_bytes(payload[17:21], "big"))
        assert buf[:8] == (9).to_bytes(8, "big") and buf[12:16] == (4).to_bytes(4, "big")
        assert buf[8:12] == payload[8:12] and buf[16:] == payload[16:]
    assert stamp_plain(memoryview(ok), 0, 0, 1 << 20, True, 0, 1 << 62, 1 << 16) is None
