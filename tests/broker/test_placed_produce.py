"""Large Produce frames of one partition are received in place (storage/wal/placed.py): the
records land where the WAL writes them, the WAL writes them from the frame (no copy into its
block), and after a kill -9 the broker serves them byte for byte. Other shapes keep the copy."""
from __future__ import annotations

import struct
import time

from broker.frames import NEED_MORE, produce_records_at
from protocol import BatchView, compute_crc, request_class
from protocol.frames import parse_response

from broker_wire import Wire, md_topic
from conftest import free_port
from datapath.wire import metric_at

_I16, _I32 = struct.Struct(">h"), struct.Struct(">i")


def batch(n_records: int, value_bytes: int) -> bytes:
    """A plain v2 record batch (no producer id, CreateTime), CRC set."""
    from bench.rawload import make_batch
    return make_batch(n_records * value_bytes, value_bytes)


def _str(s: str) -> bytes:
    return _I16.pack(len(s)) + s.encode()


def produce_v3(corr: int, topic: str, partitions: list[tuple[int, bytes]]) -> bytes:
    body = (_str("placed-test") + _I16.pack(-1) + _I16.pack(-1) + _I32.pack(30000)
            + _I32.pack(1) + _str(topic) + _I32.pack(len(partitions))
            + b"".join(_I32.pack(p) + _I32.pack(len(r)) + r for p, r in partitions))
    frame = _I16.pack(0) + _I16.pack(3) + _I32.pack(corr) + body
    return _I32.pack(len(frame)) + frame


def _uv(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def produce_v9(corr: int, topic: str, index: int, records: bytes) -> bytes:
    t = topic.encode()
    frame = (_I16.pack(0) + _I16.pack(9) + _I32.pack(corr) + _str("placed-test") + b"\0"
             + _uv(0) + _I16.pack(-1) + _I32.pack(30000) + _uv(2) + _uv(len(t) + 1) + t
             + _uv(2) + _I32.pack(index) + _uv(len(records) + 1) + records + b"\0\0\0")
    return _I32.pack(len(frame)) + frame


def test_produce_records_at_reads_the_place_from_the_first_bytes():
    rec = batch(300, 1000)
    f3 = produce_v3(5, "tp", [(2, rec)])[4:]
    at = produce_records_at(f3, 0, 200)
    assert at is not None and f3[at[0]:at[0] + at[1]] == rec
    f9 = produce_v9(6, "tp", 1, rec)[4:]
    at = produce_records_at(f9, 0, 200)
    assert at is not None and f9[at[0]:at[0] + at[1]] == rec
    assert produce_records_at(f3, 0, 40) is NEED_MORE              # the prefix ends early
    assert produce_records_at(f9, 0, 8) is NEED_MORE
    two = produce_v3(7, "tp", [(0, rec), (1, rec)])[4:]
    assert produce_records_at(two, 0, 200) is None                 # two partitions
    fetch = _I16.pack(1) + f3[2:]
    assert produce_records_at(fetch, 0, 200) is None               # not a Produce


def _fetch(w: Wire, corr: int, topic: str, index: int, offset: int) -> bytes:
    t = topic.encode()
    body = (_str("placed-test") + _I32.pack(-1) + _I32.pack(100) + _I32.pack(1)
            + _I32.pack(64 << 20) + b"\0" + _I32.pack(1) + _I16.pack(len(t)) + t + _I32.pack(1)
            + _I32.pack(index) + struct.pack(">q", offset) + _I32.pack(64 << 20))
    frame = _I16.pack(1) + _I16.pack(4) + _I32.pack(corr) + body
    w.send(_I32.pack(len(frame)) + frame)
    got, resp = parse_response(1, 4, w.recv_frame())
    assert got == corr
    records = resp.responses[0].partitions[0].records
    return bytes(records or b"")


def _produce(w: Wire, frame: bytes, corr: int, missing: tuple[int, ...] = ()) -> None:
    w.send(frame)
    raw = w.recv_frame()
    assert _I32.unpack_from(raw, 0)[0] == corr
    got, resp = parse_response(0, 3 if frame[7] == 3 else 9, raw)
    for t in resp.responses:
        for p in t.partition_responses:
            assert p.error_code == (3 if p.index in missing else 0), resp


def broker_with_topic(broker_factory, topic: str,
                      args: tuple[str, ...] = ()) -> tuple[object, Wire, int]:
    """A broker (more ``args`` if given) with its metrics listener (the metrics port) and
    ``topic`` created through Metadata's auto-creation, and a Wire to it."""
    mport = free_port()
    b = broker_factory(["--metrics-listen", f"127.0.0.1:{mport}", *args])
    w = Wire(b.host, b.port)
    w.call(3, 12, 1, topics=[md_topic(topic)], allow_auto_topic_creation=True,
           include_topic_authorized_operations=False)
    return b, w, mport


def _produce_codes(w: Wire, frame: bytes, corr: int) -> list[int]:
    """Send a Produce frame; the error code of each partition in its answer."""
    w.send(frame)
    raw = w.recv_frame()
    got, resp = parse_response(0, 3 if frame[7] == 3 else 9, raw)
    assert got == corr
    return [p.error_code for t in resp.responses for p in t.partition_responses]


def _count(rec: bytes) -> int:
    """The records in a batch (its header's record count)."""
    return _I32.unpack_from(rec, 57)[0]


def _records_from(w: Wire, topic: str, count: int) -> bytes:
    """The batches of partition 0 from offset 0 on, until ``count`` records are in."""
    got, offset, corr = b"", 0, 100
    while offset < count:
        corr += 1
        chunk = _fetch(w, corr, topic, 0, offset)
        assert chunk, offset
        pos = 0
        while pos + 12 <= len(chunk):
            length = _I32.unpack_from(chunk, pos + 8)[0]
            if pos + 12 + length > len(chunk):
                break
            base = struct.unpack_from(">q", chunk, pos)[0]
            if base >= offset:
                got += chunk[pos:pos + 12 + length]
                offset = base + _I32.unpack_from(chunk, pos + 23)[0] + 1
            pos += 12 + length
    return got


def _assert_served(got: bytes, want: list[bytes]) -> None:
    """``got`` is the batches ``want`` byte for byte, past the broker's stamps (base offset,
    partition leader epoch)."""
    pos = 0
    for rec in want:
        assert got[pos + 8:pos + 12] == rec[8:12]
        assert got[pos + 16:pos + len(rec)] == rec[16:]
        pos += len(rec)
    assert pos == len(got)


def test_large_produce_is_written_from_its_frame_and_served_after_a_kill(broker_factory):
    topic = "placed"
    b, w, mport = broker_with_topic(broker_factory, topic)
    big1, big2, small = batch(300, 1000), batch(200, 1500), batch(3, 100)
    _produce(w, produce_v3(10, topic, [(0, big1)]), 10)       # placed
    _produce(w, produce_v9(11, topic, 0, big2), 11)           # placed (flexible)
    _produce(w, produce_v3(12, topic, [(0, small)]), 12)      # a small frame: copied
    # two partitions (the second unknown: UNKNOWN_TOPIC_OR_PARTITION): copied
    _produce(w, produce_v3(13, topic, [(0, big1), (1, big2)]), 13, missing=(1,))
    assert metric_at(mport, "s3kafka_wal_placed_records_total") == 2
    w.close()
    b.restart(hard=True)                                      # kill -9: the WAL's recovery
    w = Wire(b.host, b.port)
    want = [big1, big2, small, big1]
    got = _records_from(w, topic, sum(_count(r) for r in want))
    _assert_served(got, want)
    assert _I32.unpack_from(got, 0)[0] == 0
    w.close()


def test_a_frame_received_read_by_read_is_summed_as_it_arrives_and_served_after_a_kill(
        broker_factory):
    """The batch's CRC is summed read by read as a placed frame arrives (broker/server.py
    _crc_to): a frame sent in pieces, with pauses that make each piece a read of its own, and
    one sent whole are both checked from that sum (no second pass), written from their frames
    and served byte for byte after a kill -9."""
    import socket

    topic = "summed"
    b, w, mport = broker_with_topic(broker_factory, topic)
    w.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    big1, big2 = batch(300, 1000), batch(200, 1500)
    frame = produce_v3(10, topic, [(0, big1)])
    cuts = [0, 40, 300, 70_000, 150_000, 299_000, len(frame)]   # one inside the header
    for a, z in zip(cuts, cuts[1:]):
        w.send(frame[a:z])
        time.sleep(0.05)
    raw = w.recv_frame()
    assert parse_response(0, 3, raw)[1].responses[0].partition_responses[0].error_code == 0
    _produce(w, produce_v9(11, topic, 0, big2), 11)
    assert metric_at(mport, "s3kafka_wal_placed_records_total") == 2
    assert metric_at(mport, "s3kafka_wal_placed_summed_records_total") == 2
    w.close()
    b.restart(hard=True)
    w = Wire(b.host, b.port)
    _assert_served(_records_from(w, topic, _count(big1) + _count(big2)), [big1, big2])
    w.close()


def test_a_corrupt_batch_received_in_place_is_refused_though_summed(broker_factory):
    """A large batch whose bytes do not match its CRC field (one flipped in its last record)
    is summed as received like any other: the sum is not its CRC, so the WAL's own pass
    decides and the batch is refused with CORRUPT_MESSAGE; nothing is appended."""
    topic = "summed-bad"
    b, w, mport = broker_with_topic(broker_factory, topic)
    good = batch(300, 1000)
    bad = bytearray(good)
    bad[-5] ^= 0x40
    assert _produce_codes(w, produce_v3(10, topic, [(0, bytes(bad))]), 10) == [2]
    assert metric_at(mport, "s3kafka_wal_placed_summed_records_total") == 0
    _produce(w, produce_v3(11, topic, [(0, good)]), 11)
    got = _records_from(w, topic, _count(good))
    assert struct.unpack_from(">q", got, 0)[0] == 0                 # nothing before it
    _assert_served(got, [good])
    w.close()


def test_a_log_append_time_batch_received_in_place_is_stamped_and_checked_by_its_new_crc(
        broker_factory):
    """On a LogAppendTime topic the broker stamps a batch received in place after its bytes
    were summed: the stamp rewrites bytes the sum covered and the CRC, so the sum is set aside
    and the WAL's pass checks the new CRC; the batch is kept, stamped, and served so after a
    kill -9."""
    topic = "summed-lat"
    b, w, mport = broker_with_topic(broker_factory, "other")
    T = request_class(19).CreatableTopic
    C = T.CreatableTopicConfig
    resp = w.call(19, 5, topics=[T(name=topic, num_partitions=1, replication_factor=1,
                                   assignments=[], configs=[C(name="message.timestamp.type",
                                                              value="LogAppendTime")])],
                  timeout_ms=30000, validate_only=False)
    assert resp.topics[0].error_code == 0
    big = batch(300, 1000)
    t0 = int(time.time() * 1000)
    _produce(w, produce_v3(10, topic, [(0, big)]), 10)
    assert metric_at(mport, "s3kafka_wal_placed_records_total") == 1
    assert metric_at(mport, "s3kafka_wal_placed_summed_records_total") == 0
    w.close()
    b.restart(hard=True)
    w = Wire(b.host, b.port)
    got = _records_from(w, topic, _count(big))
    assert len(got) == len(big)
    view = BatchView(got)
    assert view.attributes & 0x08                                   # LogAppendTime
    assert view.max_timestamp >= t0
    assert view.crc == compute_crc(got, 0, view.length)
    assert got[61:] == big[61:]                                     # the records untouched
    w.close()
