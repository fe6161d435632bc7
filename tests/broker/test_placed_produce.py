"""Large Produce frames of one partition are received in place (storage/wal/placed.py): the
records land where the WAL writes them, the WAL writes them from the frame (no copy into its
block), and after a kill -9 the broker serves them byte for byte. Other shapes keep the copy."""
from __future__ import annotations

import struct

from broker.frames import NEED_MORE, produce_records_at
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
    got = b""
    offset = 0
    want = [big1, big2, small, big1]
    want_records = sum(_I32.unpack_from(r, 57)[0] for r in want)
    while offset < want_records:
        chunk = _fetch(w, 20 + offset, topic, 0, offset)
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
    pos = 0
    for rec in want:                       # byte for byte past the broker's stamps
        assert got[pos + 8:pos + 12] == rec[8:12]
        assert got[pos + 16:pos + len(rec)] == rec[16:]
        pos += len(rec)
    assert pos == len(got)
    assert _I32.unpack_from(got, 0)[0] == 0
    w.close()
