"""Append / recover / trim through the public API on a real preallocated file."""
from __future__ import annotations

import asyncio
import os

import pytest

from storage.wal import (RECORD_HEADER_SIZE, CapacityMismatchError, DeltaWAL, OverCapacityError,
                         RecordTooLargeError, WALClosedError, WALConfig)


def body(stream: int, seq: int, size: int = 100) -> bytes:
    head = f"{stream}:{seq}:".encode()
    return (head + bytes((seq + i) % 251 for i in range(size)))[:max(size, len(head))]


def test_append_then_recover_after_clean_close(make_wal):
    w, recs = make_wal()
    assert recs == []
    results = [w.append(body(i % 3, i), stream_id=i % 3) for i in range(300)]
    for r in results:
        assert r.future.result(10) == r.offset
        assert r.next_offset == r.offset + RECORD_HEADER_SIZE + len(body(0, 0))
    offsets = [r.offset for r in results]
    assert offsets == sorted(offsets)
    w.close()
    w2, recs = make_wal()
    assert [o for o, _ in recs] == offsets
    assert [b for _, b in recs] == [body(i % 3, i) for i in range(300)]


def test_recover_without_close(make_wal, wal_path):
    w, _ = make_wal()
    rs = [w.append(body(1, i, 5000), stream_id=1) for i in range(50)]
    for r in rs:
        r.future.result(10)
    # no close(): simulate a crash by reading the file with a second instance
    w2 = DeltaWAL(WALConfig(path=wal_path, capacity=4 << 20))
    recs = list(w2.open())
    assert [b for _, b in recs] == [body(1, i, 5000) for i in range(50)]
    w2.close()


def test_trim_discards_older_records(make_wal):
    w, _ = make_wal()
    rs = [w.append(body(0, i)) for i in range(20)]
    for r in rs:
        r.future.result(10)
    w.trim(rs[10].offset)
    assert w.trim_offset == rs[10].offset
    w.trim(rs[5].offset)                      # trims never move back
    assert w.trim_offset == rs[10].offset
    w.close()
    _, recs = make_wal()
    assert [o for o, _ in recs] == [r.offset for r in rs[10:]]


def test_trim_after_last_record_recovers_nothing(make_wal):
    w, _ = make_wal()
    rs = [w.append(body(0, i)) for i in range(5)]
    rs[-1].future.result(10)
    w.trim(rs[-1].next_offset)
    w.close()
    w, recs = make_wal()
    assert recs == []
    r = w.append(b"after")
    r.future.result(10)
    assert r.offset >= rs[-1].next_offset


async def test_append_async_and_many_streams(make_wal):
    w, _ = make_wal()
    offs = await asyncio.gather(*[w.append_async(body(i % 7, i), stream_id=i % 7)
                                  for i in range(500)])
    assert offs == sorted(offs)
    w.close()
    _, recs = make_wal()
    assert [o for o, _ in recs] == offs


def test_over_capacity_raises_and_trim_makes_room(make_wal):
    w, _ = make_wal(capacity=1 << 20)
    big = b"z" * 60_000
    appended = []
    with pytest.raises(OverCapacityError):
        for _ in range(100):
            appended.append(w.append(big))
    for r in appended:
        r.future.result(10)
    assert len(appended) > 5
    w.trim(appended[-1].next_offset)
    r = w.append(big)
    assert r.future.result(10) == r.offset
    w.close()
    _, recs = make_wal(capacity=1 << 20)
    assert [o for o, _ in recs] == [r.offset]


def test_wraps_around_many_laps(make_wal):
    w, _ = make_wal(capacity=256 << 10)   # ring of 248 KiB
    kept = []
    for i in range(400):
        r = w.append(body(0, i, 3000 + (i * 37) % 9000))
        r.future.result(10)
        kept.append((r.offset, body(0, i, 3000 + (i * 37) % 9000)))
        if len(kept) > 6:
            w.trim(kept[-6][0])
            kept = kept[-6:]
    assert kept[-1][0] > 5 * w.ring_size
    w.close()
    _, recs = make_wal(capacity=256 << 10)
    assert recs == kept


def test_large_records_span_blocks(make_wal):
    w, _ = make_wal(capacity=16 << 20)
    sizes = [1, 300_000, 4096 - RECORD_HEADER_SIZE, 2_000_000, 70_000]
    rs = [w.append(os.urandom(s)) for s in sizes]
    payloads = [None] * len(sizes)
    for r in rs:
        r.future.result(10)
    w.close()
    _, recs = make_wal(capacity=16 << 20)
    assert [len(b) for _, b in recs] == sizes
    del payloads


def test_record_too_large(make_wal):
    w, _ = make_wal(capacity=1 << 20, max_record_size=1000)
    with pytest.raises(RecordTooLargeError):
        w.append(b"x" * 1001)
    w2_ok = w.append(b"x" * 1000)
    w2_ok.future.result(10)


def test_capacity_mismatch_is_refused(make_wal, wal_path):
    w, _ = make_wal(capacity=1 << 20)
    w.close()
    with pytest.raises(CapacityMismatchError):
        DeltaWAL(WALConfig(path=wal_path, capacity=2 << 20)).open()


def test_append_after_close_is_refused(make_wal):
    w, _ = make_wal()
    w.close()
    with pytest.raises(WALClosedError):
        w.append(b"late")


@pytest.mark.parametrize("mode", ["dsync", "fdatasync", "none"])
def test_sync_modes_round_trip(make_wal, mode):
    w, _ = make_wal(sync_mode=mode)
    rs = [w.append(body(0, i)) for i in range(50)]
    for r in rs:
        r.future.result(10)
    w.close()
    _, recs = make_wal(sync_mode=mode)
    assert len(recs) == 50


def test_bandwidth_limit_still_delivers(make_wal):
    w, _ = make_wal(bandwidth_limit=50 << 20)
    rs = [w.append(b"b" * 10_000) for _ in range(100)]
    for r in rs:
        r.future.result(10)
