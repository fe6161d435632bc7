"""The listener over real sockets: framing, pipelining order, bad input, ApiVersions, SIGTERM."""
from __future__ import annotations

import struct

import pytest

from broker.handlers import HANDLERS
from protocol import SUPPORTED_APIS, ErrorCode
from protocol.frames import parse_response

from broker_wire import Wire, encode_request, md_topic, request

API_VERSIONS, METADATA = 18, 3


@pytest.fixture
def wire(module_broker):
    w = Wire(module_broker.host, module_broker.port)
    yield w
    w.close()


def _api_versions_frame(corr: int, version: int = 0) -> bytes:
    return encode_request(API_VERSIONS, version, corr, request(API_VERSIONS, version))


def _metadata_frame(corr: int, topics: list[str] | None, version: int = 12,
                    auto: bool = True) -> bytes:
    req = request(METADATA, version,
                  topics=None if topics is None else [md_topic(t) for t in topics],
                  allow_auto_topic_creation=auto, include_topic_authorized_operations=False)
    return encode_request(METADATA, version, corr, req)


def test_api_versions_lists_every_handled_api(wire):
    for version in (0, 3, 4):
        resp = wire.call(API_VERSIONS, version, correlation_id=7 + version,
                         **({"client_software_name": "broker-tests",
                             "client_software_version": "1.0"} if version >= 3 else {}))
        assert resp.error_code == 0
        got = {k.api_key: (k.min_version, k.max_version) for k in resp.api_keys}
        assert got, "nothing advertised"
        for key, rng in got.items():
            assert key in HANDLERS, f"api {key} advertised without a handler"
            assert SUPPORTED_APIS[key] == rng
        # every API of issue #2 that has a registered handler is advertised
        assert set(got) == {k for k in SUPPORTED_APIS if k in HANDLERS}


def test_pipelined_requests_are_answered_in_request_order(wire):
    # Metadata with auto-creation does a durable metadata write; ApiVersions is instant.
    # Both run concurrently, yet the answers must come back in request order.
    frames = []
    expected = []
    for i in range(60):
        if i % 3 == 0:
            frames.append(_metadata_frame(i, [f"pipelined-{i}"]))
            expected.append((METADATA, i))
        else:
            frames.append(_api_versions_frame(i, version=i % 4))
            expected.append((API_VERSIONS, i))
    wire.send(b"".join(frames))  # one write: the broker sees many frames per read
    for api_key, corr in expected:
        version = 12 if api_key == METADATA else corr % 4
        got_corr, resp = parse_response(api_key, version, wire.recv_frame())
        assert got_corr == corr
        if api_key == METADATA:
            assert [t.name for t in resp.topics] == [f"pipelined-{corr}"]
            assert resp.topics[0].error_code == 0


def test_slow_long_poll_fetch_does_not_reorder_later_answers(wire):
    from protocol import request_class
    wire.call(METADATA, 12, correlation_id=500, topics=[md_topic("long-poll")],
              allow_auto_topic_creation=True, include_topic_authorized_operations=False)
    fc = request_class(1)
    fetch = fc(version=12, replica_id=-1, max_wait_ms=500, min_bytes=1, max_bytes=1 << 20,
               isolation_level=0, session_id=0, session_epoch=-1, rack_id="",
               forgotten_topics_data=[],
               topics=[fc.FetchTopic(topic="long-poll", partitions=[fc.FetchTopic.FetchPartition(
                   partition=0, current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1,
                   log_start_offset=-1, partition_max_bytes=1 << 20)])])
    # the Fetch parks until max_wait_ms (nothing to read); the ApiVersions behind it is instant
    wire.send(encode_request(1, 12, 501, fetch) + _api_versions_frame(502))
    corr, resp = parse_response(1, 12, wire.recv_frame())
    assert corr == 501 and resp.responses[0].partitions[0].error_code == 0
    assert parse_response(API_VERSIONS, 0, wire.recv_frame())[0] == 502


def _fetch_frame(corr: int, topic: str, max_wait_ms: int) -> bytes:
    from protocol import request_class
    fc = request_class(1)
    fetch = fc(version=12, replica_id=-1, max_wait_ms=max_wait_ms, min_bytes=1,
               max_bytes=1 << 20, isolation_level=0, session_id=0, session_epoch=-1, rack_id="",
               forgotten_topics_data=[],
               topics=[fc.FetchTopic(topic=topic, partitions=[fc.FetchTopic.FetchPartition(
                   partition=0, current_leader_epoch=-1, fetch_offset=0, last_fetched_epoch=-1,
                   log_start_offset=-1, partition_max_bytes=1 << 20)])])
    return encode_request(1, 12, corr, fetch)


def test_sigterm_releases_a_parked_fetch_and_answers_it(broker_factory):
    import time
    b = broker_factory(["--log-level", "DEBUG"])
    w = Wire(b.host, b.port, timeout=60)
    try:
        w.call(METADATA, 12, correlation_id=1, topics=[md_topic("parked")],
               allow_auto_topic_creation=True, include_topic_authorized_operations=False)
        w.send(_fetch_frame(2, "parked", max_wait_ms=600_000))  # would park for 10 minutes
        deadline = time.monotonic() + 30  # wait until the broker has read the Fetch
        while "api=Fetch" not in b.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        b.stop()  # SIGTERM: closing the partitions wakes the Fetch; exit code 0 asserted
        corr, resp = parse_response(1, 12, w.recv_frame())
        assert corr == 2 and resp.responses[0].partitions[0].records in (None, b"")
    finally:
        w.close()


def test_sigusr2_dumps_every_thread_and_the_broker_keeps_serving(broker_factory):
    """A hung broker's evidence: SIGUSR2 writes every thread's stack to its log (the tests'
    SIGTERM that does not end a broker sends it before SIGKILL); nothing else changes."""
    import signal
    import time
    b = broker_factory()
    b.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while "most recent call first" not in b.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    text = b.log_text()
    assert "Current thread" in text or "Thread 0x" in text, text[-2000:]
    w = Wire(b.host, b.port, timeout=30)
    try:
        resp = w.call(METADATA, 12, correlation_id=1, topics=None,
                      allow_auto_topic_creation=False, include_topic_authorized_operations=False)
        assert resp.brokers, resp
    finally:
        w.close()
    b.stop()


def test_frames_split_across_writes_byte_by_byte(wire):
    frame = _metadata_frame(42, None)
    for b in frame:
        wire.send(bytes([b]))
    corr, resp = parse_response(METADATA, 12, wire.recv_frame())
    assert corr == 42 and resp.brokers[0].node_id == 0


def test_large_frames_arriving_in_pieces(wire):
    names = [f"large-frame-topic-{i:06d}" for i in range(8000)]  # ~250 KiB request
    frame = _metadata_frame(77, names, auto=False) + _api_versions_frame(78)
    assert len(frame) > 4 * (64 << 10)  # several times the initial read buffer
    for i in range(0, len(frame), 5000):
        wire.send(frame[i:i + 5000])
    corr, resp = parse_response(METADATA, 12, wire.recv_frame())
    assert corr == 77 and [t.name for t in resp.topics] == names
    assert {t.error_code for t in resp.topics} == {ErrorCode.UNKNOWN_TOPIC_OR_PARTITION}
    assert parse_response(API_VERSIONS, 0, wire.recv_frame())[0] == 78


def test_half_closed_client_still_gets_its_answers(module_broker):
    import socket
    w = Wire(module_broker.host, module_broker.port)
    try:
        w.send(b"".join(_metadata_frame(i, [f"half-closed-{i}"]) for i in range(5)))
        w.sock.shutdown(socket.SHUT_WR)
        got = [parse_response(METADATA, 12, w.recv_frame())[0] for _ in range(5)]
        assert got == list(range(5))
        assert w.is_closed_by_peer()
    finally:
        w.close()


def test_unsupported_api_versions_version_gets_v0_fallback(wire):
    # A future ApiVersions version: header v2 like newer clients send; body is opaque to us.
    body = struct.pack(">hhih", API_VERSIONS, 99, 5, 1) + b"x" + b"\x00" + b"\x00"
    wire.send(struct.pack(">i", len(body)) + body)
    frame = wire.recv_frame()
    corr, err = struct.unpack_from(">ih", frame, 0)
    assert corr == 5 and err == ErrorCode.UNSUPPORTED_VERSION
    corr, resp = parse_response(API_VERSIONS, 0, frame)
    assert {k.api_key for k in resp.api_keys} >= {API_VERSIONS, METADATA}
    # the connection stays usable: the client retries with a version we advertise
    assert wire.call(API_VERSIONS, 3, correlation_id=6, client_software_name="x",
                     client_software_version="1").error_code == 0


@pytest.mark.parametrize("frame", [
    pytest.param(struct.pack(">i", 3) + b"\x00\x12\x00", id="shorter-than-header"),
    pytest.param(struct.pack(">ihhih", 10, 3, 99, 1, -1), id="unsupported-metadata-version"),
    pytest.param(struct.pack(">ihhih", 10, 9999, 0, 1, -1), id="unknown-api-key"),
    pytest.param(struct.pack(">ihhih", 14, 3, 12, 1, -1) + b"\x00\x05\xff\xff", id="truncated-body"),
    pytest.param(struct.pack(">i", 200 << 20), id="over-max-request-bytes"),
    pytest.param(struct.pack(">i", -5), id="negative-size"),
])
def test_bad_frames_close_only_that_connection(module_broker, frame):
    bystander = Wire(module_broker.host, module_broker.port)
    bad = Wire(module_broker.host, module_broker.port)
    try:
        # a good request before the bad frame is still answered, then the connection closes
        bad.send(_api_versions_frame(1) + frame)
        corr, resp = parse_response(API_VERSIONS, 0, bad.recv_frame())
        assert corr == 1 and resp.error_code == 0
        assert bad.is_closed_by_peer()
        assert bystander.call(API_VERSIONS, 0, correlation_id=2).error_code == 0
        assert bystander.call(METADATA, 12, correlation_id=3, topics=None,
                              allow_auto_topic_creation=False,
                              include_topic_authorized_operations=False).brokers
    finally:
        bad.close()
        bystander.close()


def test_oversize_request_is_logged(module_broker):
    w = Wire(module_broker.host, module_broker.port)
    try:
        w.send(struct.pack(">i", (100 << 20) + 1))
        assert w.is_closed_by_peer()
    finally:
        w.close()
    assert "request too large" in module_broker.log_text()


def test_max_request_bytes_flag(broker_factory):
    b = broker_factory(["--max-request-bytes", "4096"])
    w = Wire(b.host, b.port)
    try:
        w.send(_metadata_frame(1, [f"t{i:04d}" for i in range(400)], auto=False))
        assert w.is_closed_by_peer()
    finally:
        w.close()
    w = Wire(b.host, b.port)
    try:
        resp = w.call(METADATA, 12, correlation_id=2, topics=[md_topic("small")],
                      allow_auto_topic_creation=False, include_topic_authorized_operations=False)
        assert resp.topics[0].error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    finally:
        w.close()


def test_sigterm_with_open_connections_exits_cleanly(broker_factory):
    b = broker_factory()
    idle = Wire(b.host, b.port)
    busy = Wire(b.host, b.port)
    try:
        busy.send(b"".join(_metadata_frame(i, [f"sigterm-{i}"]) for i in range(20)))
        # the first answers prove the requests are in flight before we signal
        parse_response(METADATA, 12, busy.recv_frame())
        b.stop()  # SIGTERM; asserts exit code 0
        log = b.log_text()
        assert "broker stopping" in log and "broker stopped" in log
        assert idle.is_closed_by_peer()
        # requests read before the signal were answered, in order, before the close
        got = []
        while True:
            try:
                got.append(parse_response(METADATA, 12, busy.recv_frame())[0])
            except ConnectionError:
                break
        assert got == list(range(1, 1 + len(got)))
    finally:
        idle.close()
        busy.close()
    b.start()
    w = Wire(b.host, b.port)
    try:
        resp = w.call(METADATA, 12, correlation_id=1, topics=[md_topic("sigterm-0")],
                      allow_auto_topic_creation=False, include_topic_authorized_operations=False)
        assert resp.topics[0].error_code == 0
    finally:
        w.close()
