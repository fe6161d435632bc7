"""Random and mutated frames against a running broker while a real client keeps working.

Several raw connections send garbage, truncated frames, wrong and huge length prefixes,
unknown API keys, bad versions, bit-flipped valid requests and Produce requests with bad
CRCs, for a bounded count, while a confluent-kafka (librdkafka) producer and consumer keep
producing and consuming on the same broker.  The broker must never die, the well-behaved
client must see every message exactly once and in order, and corrupt batches must be refused
with CORRUPT_MESSAGE.  Seeded randomness: a failure is reproducible with the same seed.
"""
from __future__ import annotations

import os
import pathlib
import random
import socket
import struct
import threading
import time

import pytest

import protocol
from datapath.wire import api_versions_roundtrip, framed, roundtrip
from protocol.examples import sample_message

SEED = 20261121
FRAMES = 15000
CONNECTIONS = 6
GOOD_TOPIC = "fuzz-good"
MIN_GOOD_ROUNDS = 5
MAX_SECONDS = 90.0
# creating 2**31 partitions is a resource question, not a parsing one: keep those out of the
# mutation set so the test measures robustness of decoding, not capacity
NOT_MUTATED = {19, 37}

pytestmark = pytest.mark.slow


class GoodClient(threading.Thread):
    """Produces rounds of messages and consumes them back, recording anything unexpected."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap = bootstrap
        self.stop_event = threading.Event()
        self.rounds = 0
        self.errors: list[str] = []
        self.sent: list[bytes] = []
        self.received: list[bytes] = []

    def run(self) -> None:
        from confluent_kafka import Consumer, Producer, TopicPartition

        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 2,
                             "message.timeout.ms": 30000, "acks": "all"})
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "fuzz-good",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        try:
            # first round creates the topic (auto-create); then read it from offset 0
            consumer.assign([TopicPartition(GOOD_TOPIC, 0, 0)])
            while not self.stop_event.is_set() and not self.errors:
                self._round(producer, consumer)
        except Exception as exc:  # reported by the test, never swallowed
            self.errors.append(f"good client crashed: {exc!r}")
        finally:
            consumer.close()

    def _round(self, producer, consumer) -> None:
        values = [f"r{self.rounds}-m{i}".encode() for i in range(20)]

        def delivered(err, _msg) -> None:
            if err is not None:
                self.errors.append(f"delivery failed: {err}")

        for v in values:
            producer.produce(GOOD_TOPIC, value=v, partition=0, on_delivery=delivered)
        if producer.flush(60) != 0:
            self.errors.append("producer flush timed out")
            return
        self.sent.extend(values)
        deadline = time.monotonic() + 60
        while len(self.received) < len(self.sent) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().retriable() or "PARTITION_EOF" in str(msg.error()):
                    continue
                self.errors.append(f"consume error: {msg.error()}")
                return
            self.received.append(msg.value())
        if self.received != self.sent:
            self.errors.append(f"round {self.rounds}: consumed {len(self.received)} of "
                               f"{len(self.sent)} or out of order")
            return
        self.rounds += 1


def _valid_request(rng: random.Random, exclude: set[int] = frozenset()) -> tuple[int, bytes]:
    key = rng.choice([k for k in protocol.SUPPORTED_APIS if k not in exclude])
    lo, hi = protocol.SUPPORTED_APIS[key]
    version = rng.randint(lo, hi)
    req = sample_message(protocol.request_class(key), version, fill=rng.random() < 0.7)
    req.with_header(correlation_id=rng.randint(0, 2 ** 31 - 1), client_id="fuzz")
    return key, bytes(req.encode(header=True))


def _corrupt_produce(rng: random.Random, legacy: bool) -> bytes:
    """A well-formed Produce request whose only batch has a broken CRC."""
    if legacy:
        payload = bytearray(protocol.build_message_set(1, [(b"k", b"bad")], timestamp=1))
        version = 2
    else:
        payload = bytearray(protocol.build_batch([(b"k", b"bad")], timestamp=1))
        version = rng.choice([3, 7, 9, 11])
    payload[-1] ^= 0x5A
    P = protocol.request_class(0)
    part = P.TopicProduceData.PartitionProduceData(version=version, index=0, records=payload)
    kw = {"transactional_id": None} if version >= 3 else {}
    req = P(version=version, acks=1, timeout_ms=5000, topic_data=[P.TopicProduceData(
        version=version, name=GOOD_TOPIC, partition_data=[part])], **kw)
    req.with_header(correlation_id=777, client_id="fuzz-crc")
    return bytes(req.encode(header=True))


def _fuzz_frame(rng: random.Random) -> tuple[bytes, bool]:
    """(bytes to send, close the connection afterwards)."""
    kind = rng.randrange(9)
    if kind == 0:  # pure garbage with a right length prefix
        return framed(rng.randbytes(rng.randint(0, 300))), False
    if kind == 1:  # truncated: the prefix promises more than is sent, then hang up
        _, body = _valid_request(rng)
        return struct.pack(">i", len(body) + rng.randint(1, 5000)) + body, True
    if kind == 2:  # huge or negative length prefix
        size = rng.choice([2 ** 31 - 1, 2 ** 30, 200 << 20, -1, -(2 ** 31)])
        return struct.pack(">i", size) + rng.randbytes(rng.randint(0, 64)), True
    if kind == 3:  # unknown api key
        key = rng.choice([4, 5, 6, 7, 17, 24, 27, 50, 68, 76, 999, 32767, -1])
        return framed(struct.pack(">hhih", key, 0, 1, 1) + b"f" + rng.randbytes(20)), False
    if kind == 4:  # known api, version out of range
        key = rng.choice(list(protocol.SUPPORTED_APIS))
        version = rng.choice([-1, -32768, 32767, protocol.SUPPORTED_APIS[key][1] + 1])
        return framed(struct.pack(">hhih", key, version, 2, 1) + b"f" + rng.randbytes(30)), False
    if kind == 5:  # bit flips in a valid request
        _, body = _valid_request(rng, NOT_MUTATED)
        buf = bytearray(body)
        for _ in range(rng.randint(1, 6)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        return framed(bytes(buf)), False
    if kind == 6:  # valid request cut short (consistent prefix)
        _, body = _valid_request(rng, NOT_MUTATED)
        return framed(body[:rng.randrange(len(body))]), False
    if kind == 7:  # valid request with trailing junk
        _, body = _valid_request(rng, NOT_MUTATED)
        return framed(body + rng.randbytes(rng.randint(1, 50))), False
    # frames shorter than a request header
    return framed(rng.randbytes(rng.randint(0, 8))), False


class FuzzConnection:
    def __init__(self, host: str, port: int) -> None:
        self.addr = (host, port)
        self.sock: socket.socket | None = None
        self.reconnects = 0

    def send(self, data: bytes, close: bool) -> None:
        for _ in range(3):
            try:
                if self.sock is None:
                    self.sock = socket.create_connection(self.addr, timeout=10)
                    self.reconnects += 1
                self.sock.sendall(data)
                self._drain()
                break
            except OSError:
                self.close()
        if close:
            self.close()

    def _drain(self) -> None:
        assert self.sock is not None
        self.sock.settimeout(0)  # with a timeout, CPython would wait for readability first
        try:
            while self.sock.recv(1 << 16):
                pass
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(10)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None


def _check_corrupt_produce_refused(host: str, port: int, rng: random.Random, legacy: bool) -> None:
    body = _corrupt_produce(rng, legacy)
    version = struct.unpack_from(">h", body, 2)[0]
    corr, resp = protocol.parse_response(0, version, roundtrip(host, port, body, timeout=30))
    assert corr == 777
    (topic,) = resp.responses
    (part,) = topic.partition_responses
    assert part.error_code == protocol.ErrorCode.CORRUPT_MESSAGE, part


def test_fuzzed_frames_never_kill_the_broker(broker_factory) -> None:
    broker = broker_factory(["--wal-capacity", str(64 << 20)])  # default 2 GiB is preallocated
    rng = random.Random(SEED)
    good = GoodClient(broker.bootstrap)
    good.start()
    conns = [FuzzConnection(broker.host, broker.port) for _ in range(CONNECTIONS)]
    started = time.monotonic()
    sent = 0
    try:
        # let the good client create its topic before CRC checks address it
        while good.rounds < 1 and not good.errors and time.monotonic() - started < MAX_SECONDS:
            time.sleep(0.05)
        assert not good.errors, good.errors
        while time.monotonic() - started < MAX_SECONDS:
            if sent < FRAMES:
                data, close = _fuzz_frame(rng)
                conn = conns[sent % CONNECTIONS]
                if rng.random() < 0.1 and len(data) > 2:  # split a frame across sends
                    cut = rng.randrange(1, len(data))
                    conn.send(data[:cut], False)
                    conn.send(data[cut:], close)
                else:
                    conn.send(data, close)
                sent += 1
                if sent % 1000 == 0:
                    _check_corrupt_produce_refused(broker.host, broker.port, rng,
                                                   legacy=(sent // 1000) % 2 == 0)
                    assert broker.running, broker.log_tail()
                    assert api_versions_roundtrip(broker.host, broker.port, timeout=10)
            elif good.rounds >= MIN_GOOD_ROUNDS or good.errors:
                break
            else:
                time.sleep(0.05)
    finally:
        good.stop_event.set()
        good.join(120)
        for c in conns:
            c.close()
    assert broker.running, broker.log_tail()
    assert api_versions_roundtrip(broker.host, broker.port, timeout=10)
    assert sent == FRAMES
    assert not good.errors, good.errors
    assert good.rounds >= MIN_GOOD_ROUNDS
    assert good.received == good.sent
    if os.environ.get("FUZZ_DUMP_LOG"):  # for triage: every handler error is in the log
        pathlib.Path(os.environ["FUZZ_DUMP_LOG"]).write_text(broker.log_text())
