"""Every advertised API has a handler over its whole range.

Asks a RUNNING broker for its ApiVersions, then sends, over a real socket, one minimal valid
request (schema defaults, empty arrays) and one filled request (one element per array) of
every advertised (api_key, version), and requires a well-formed response of exactly that
version (decoded strictly: every byte consumed) carrying our correlation id.
"""
from __future__ import annotations

import struct

import pytest

import protocol
from datapath.wire import WireClient, framed
from protocol.examples import sample_message

TIMEOUT_S = 30.0
SMALL_WAL = ["--wal-capacity", str(64 << 20)]  # the default 2 GiB is preallocated on disk


@pytest.fixture(scope="module")
def module_broker(module_broker_factory):
    """One broker for this module, with a small WAL."""
    return module_broker_factory(SMALL_WAL)


def connect(broker) -> WireClient:
    return WireClient(broker.host, broker.port, timeout=TIMEOUT_S, client_id="api-coverage")


def call(client: WireClient, request, version: int) -> tuple[int, object]:
    """Send ``request`` at ``version``; return (correlation id, response decoded strictly by our
    own protocol package: every byte consumed)."""
    client.send(request, version)
    return protocol.parse_response(request.API_KEY, version, client.recv_frame(64 << 20))


def advertised(client: WireClient) -> dict[int, tuple[int, int]]:
    _, resp = call(client, sample_message(protocol.request_class(18), 0, fill=False), 0)
    assert resp.error_code == 0
    return {k.api_key: (k.min_version, k.max_version) for k in resp.api_keys}


def make_request(api_key: int, version: int, fill: bool):
    req = sample_message(protocol.request_class(api_key), version, fill=fill)
    if api_key == 0:
        req.acks = 1  # acks=0 has no response by design
        req.timeout_ms = 5000
    if api_key == 1:
        req.max_wait_ms = 0
    if api_key in (11,):  # JoinGroup: never park in a rebalance wait
        req.session_timeout_ms = 1
        if hasattr(req, "rebalance_timeout_ms"):
            req.rebalance_timeout_ms = 1
    return req


@pytest.mark.parametrize("fill", [False, True], ids=["minimal", "filled"])
def test_every_advertised_version_is_answered(module_broker, fill: bool) -> None:
    client = connect(module_broker)
    try:
        ranges = advertised(client)
        assert ranges == protocol.SUPPORTED_APIS
        failures = []
        for api_key, (lo, hi) in sorted(ranges.items()):
            for version in range(lo, hi + 1):
                req = make_request(api_key, version, fill)
                try:
                    corr, resp = call(client, req, version)
                except Exception as exc:  # collected: one report lists every gap
                    failures.append(f"{protocol.api_name(api_key)} v{version}: {exc!r}")
                    client.reconnect()
                    continue
                if corr != client.correlation_id or resp.version != version:
                    failures.append(f"{protocol.api_name(api_key)} v{version}: corr {corr} "
                                    f"version {resp.version}")
        assert not failures, "\n".join(failures)
        assert module_broker.running
    finally:
        client.close()


def test_unsupported_versions_get_answers_not_crashes(module_broker) -> None:
    client = connect(module_broker)
    try:
        # ApiVersions of a future version: v0 body with UNSUPPORTED_VERSION and our ranges
        frame = struct.pack(">hhih", 18, 99, 4242, 3) + b"new" + b"\x00" + b"\x00"
        client.sock.sendall(framed(frame))
        corr, resp = protocol.parse_response(18, 99, client.recv_frame())
        assert corr == 4242 and resp.error_code == protocol.ErrorCode.UNSUPPORTED_VERSION
        assert {k.api_key for k in resp.api_keys} >= {18}
        # the connection stays usable afterwards
        assert advertised(client) == protocol.SUPPORTED_APIS
    finally:
        client.close()
    assert module_broker.running


def test_random_well_formed_requests_are_all_answered(module_broker) -> None:
    """3000 requests of random (api, version) with random field values (protocol.random_messages):
    each must get a strictly decodable answer of its version with its correlation id."""
    import random

    from protocol.random_messages import random_struct

    rng = random.Random(4711)
    records = [protocol.build_batch([(b"k", b"v")] * 3, timestamp=1000),
               protocol.build_batch([(b"k", b"v")], compression=protocol.GZIP)]
    client = connect(module_broker)
    failures: list[str] = []
    try:
        for _ in range(3000):
            key = rng.choice(sorted(protocol.SUPPORTED_APIS))
            lo, hi = protocol.SUPPORTED_APIS[key]
            version = rng.randint(lo, hi)
            req = random_struct(protocol.request_class(key), version, rng, records)
            if key == 0 and req.acks == 0:
                req.acks = 1  # acks=0 has no response by design
            try:
                corr, resp = call(client, req, version)
                assert corr == client.correlation_id and resp.version == version
            except Exception as exc:
                failures.append(f"{protocol.api_name(key)} v{version}: {exc!r} for {req!r:.400}")
                client.reconnect()
    finally:
        client.close()
    assert not failures, "\n".join(failures[:20])
    assert module_broker.running


def test_advertised_set_is_one_kafka_release() -> None:
    """Every advertised maximum is Kafka 4.1's (kafka-python's record of that release): a client
    that infers the release from one API's maximum then finds every other API at its version."""
    from kafka.protocol.broker_version_data import (BROKER_API_VERSIONS,
                                                    infer_broker_version_from_api_versions)

    kafka = BROKER_API_VERSIONS[(4, 1)]
    assert {k: hi for k, (_, hi) in protocol.SUPPORTED_APIS.items()} == \
        {k: kafka[k][1] for k in protocol.SUPPORTED_APIS}
    assert infer_broker_version_from_api_versions(protocol.SUPPORTED_APIS) == (4, 1)
    for key, (lo, _) in protocol.SUPPORTED_APIS.items():
        assert lo <= kafka[key][0], f"{protocol.api_name(key)}: Kafka 4.1 serves v{kafka[key][0]}"


def test_unsupported_version_is_answered_with_error_35(module_broker) -> None:
    """A version past our range whose response has a top-level error code is answered with
    UNSUPPORTED_VERSION (the connection stays open); otherwise the connection is closed."""
    from kafka.protocol.producer import InitProducerIdRequest, InitProducerIdResponse

    client = connect(module_broker)
    try:
        hi = protocol.SUPPORTED_APIS[22][1]
        req = InitProducerIdRequest(transactional_id=None, transaction_timeout_ms=1000,
                                    producer_id=-1, producer_epoch=-1)
        client.send(req, hi + 1)
        frame = client.recv_frame()
        corr = struct.unpack_from(">i", frame)[0]
        resp = InitProducerIdResponse.decode(bytes(frame[5:]), version=hi + 1)
        assert corr == client.correlation_id
        assert resp.error_code == protocol.ErrorCode.UNSUPPORTED_VERSION
        assert advertised(client) == protocol.SUPPORTED_APIS   # still usable
    finally:
        client.close()
    assert module_broker.running
