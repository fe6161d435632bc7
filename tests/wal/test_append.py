"""Append / recover / trim through the public API on a real preallocated file."""
from __future__ import annotations

import asyncio
import logging
import os

import pytest

import crc32c

from storage.wal import (RECORD_HEADER_SIZE, CapacityMismatchError, ChecksumMismatchError,
                         DeltaWAL, OverCapacityError, RecordTooLargeError, WALClosedError,
                         WALConfig)
from storage.wal.config import LOOP_ENGINES


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


def test_open_says_formatted_for_a_new_wal_and_unclean_only_after_a_crash(make_wal, wal_path,
                                                                          caplog):
    caplog.set_level(logging.INFO, logger="storage.wal.wal")

    def said() -> list[str]:
        out = [r.getMessage() for r in caplog.records]
        caplog.clear()
        return out

    w, _ = make_wal()
    first = said()
    assert any("formatted" in m for m in first) and not any("unclean" in m for m in first)
    w.append(b"x").future.result(10)
    crashed = DeltaWAL(WALConfig(path=wal_path, capacity=4 << 20))    # w never closed
    list(crashed.open())
    assert any("recovered 1 records after unclean shutdown" in m for m in said())
    crashed.close()
    again = DeltaWAL(WALConfig(path=wal_path, capacity=4 << 20))       # after a clean close
    list(again.open())
    again.close()
    assert not any("unclean" in m or "formatted" in m for m in said())


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


async def test_sync_append_on_the_event_loop_never_blocks(make_wal):
    # far more than max_buffered_bytes appended from the loop thread without awaiting
    w, _ = make_wal(capacity=16 << 20, max_buffered_bytes=64 << 10)
    rs = [w.append(b"q" * 20_000, stream_id=i % 2) for i in range(200)]
    await asyncio.gather(*[asyncio.wrap_future(r.future) for r in rs])
    assert [r.future.result() for r in rs] == [r.offset for r in rs]


def test_blocking_append_waits_for_room_in_a_thread(make_wal):
    w, _ = make_wal(capacity=16 << 20, max_buffered_bytes=64 << 10)
    rs = [w.append(b"q" * 20_000) for _ in range(200)]
    for r in rs:
        r.future.result(10)
    w.close()
    _, recs = make_wal(capacity=16 << 20)
    assert len(recs) == 200


async def test_append_async_waits_for_room(make_wal):
    w, _ = make_wal(capacity=16 << 20, max_buffered_bytes=64 << 10)
    offs = await asyncio.gather(*[w.append_async(b"a" * 30_000, i % 3) for i in range(100)])
    assert len(set(offs)) == 100


def test_acknowledgements_arrive_in_order_per_stream(make_wal):
    w, _ = make_wal(capacity=16 << 20, block_soft_limit=4096, io_threads=4)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    import threading
    lock = threading.Lock()

    def cb(sid, f):
        with lock:
            seen[sid].append(f.result())

    rs = []
    for i in range(600):
        r = w.append(os.urandom(100 + (i * 7919) % 9000), stream_id=i % 3)
        r.future.add_done_callback(lambda f, s=i % 3: cb(s, f))
        rs.append(r)
    for r in rs:
        r.future.result(10)
    for sid, offs in seen.items():
        assert offs == sorted(offs) and len(offs) == 200


def test_padding_never_overwrites_a_live_record_at_an_unaligned_trim(make_wal):
    # fill the ring right up to an unaligned trim one lap back: the last block's zero padding
    # would land on the live record at the trim offset if the capacity check ignored it
    w, _ = make_wal(capacity=64 << 10)                  # ring = 56 KiB
    ring = w.ring_size
    for _ in range(50):                                 # two records in one block
        first = w.append(b"L" * 1000)
        live = w.append(b"K" * 500)                     # unaligned offset, stays live
        live.future.result(10)
        w.trim(live.offset)
        if live.offset % 4096 == 1024:
            break
    assert live.offset % 4096 == 1024
    appended = [live]
    try:
        while True:
            r = w.append(b"f" * 700)
            r.future.result(10)
            appended.append(r)
    except Exception as e:
        assert type(e).__name__ == "OverCapacityError"
    assert appended[-1].offset >= ring - 4096              # the ring is full
    w.close()
    _, recs = make_wal(capacity=64 << 10)
    assert [o for o, _ in recs] == [r.offset for r in appended]
    assert recs[0][1] == b"K" * 500


def test_record_of_128_mib_round_trips(make_wal):
    import hashlib
    big = os.urandom(1 << 20) * 128                      # 128 MiB, the default maximum
    w, _ = make_wal(capacity=160 << 20)
    rs = [w.append(b"small-before"), w.append(big, stream_id=1), w.append(b"small-after")]
    for r in rs:
        r.future.result(60)
    w.close()
    _, recs = make_wal(capacity=160 << 20)
    assert [o for o, _ in recs] == [r.offset for r in rs]
    assert recs[0][1] == b"small-before" and recs[2][1] == b"small-after"
    assert hashlib.sha256(recs[1][1]).digest() == hashlib.sha256(big).digest()


def test_any_buffer_is_stored_as_its_bytes(make_wal):
    import array
    w, _ = make_wal()
    arr = array.array("i", range(1000))                  # len() 1000 items, 4000 bytes
    rs = [w.append(arr), w.append(bytearray(b"ba")), w.append(memoryview(b"xyz")[1:])]
    for r in rs:
        r.future.result(10)
    assert rs[0].next_offset - rs[0].offset == 24 + 4000
    w.close()
    _, recs = make_wal()
    assert [b for _, b in recs] == [arr.tobytes(), b"ba", b"yz"]


async def test_append_loop_completes_loop_futures_in_order_per_stream(make_wal):
    # the engine's path: asyncio futures of the calling loop, completed in batches, in order
    w, _ = make_wal(capacity=16 << 20, block_soft_limit=4096, io_threads=4)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    rs = []
    for i in range(600):
        r = w.append_loop(os.urandom(100 + (i * 7919) % 9000), stream_id=i % 3)
        assert isinstance(r.future, asyncio.Future)
        r.future.add_done_callback(lambda f, s=i % 3: seen[s].append(f.result()))
        rs.append(r)
    assert await asyncio.gather(*[r.future for r in rs]) == [r.offset for r in rs]
    await asyncio.sleep(0)                      # done callbacks run one loop turn later
    for sid, offs in seen.items():
        assert offs == sorted(offs) and len(offs) == 200
    w.close()
    _, recs = make_wal(capacity=16 << 20)
    assert [o for o, _ in recs] == [r.offset for r in rs]


async def test_append_loop_raises_over_capacity_and_when_closed(make_wal):
    w, _ = make_wal(capacity=64 << 10)
    with pytest.raises(OverCapacityError):
        for _ in range(100):
            await w.append_loop(b"x" * 4000).future
            w.append_loop(b"y" * 4000)          # never trimmed: the ring fills up
    w.close()
    with pytest.raises(WALClosedError):
        w.append_loop(b"z")


def test_large_records_recover_byte_for_byte_and_a_flipped_byte_is_rejected(make_wal):
    # records from a few bytes to 1 MiB verify on recovery; a flipped byte in a large body
    # must make recovery reject that record
    w, _ = make_wal(capacity=32 << 20)
    sizes = [100, 40_000, 5, 300_000, 32 << 10, (32 << 10) - 1, 1 << 20, 7]
    bodies = [os.urandom(n) for n in sizes]
    rs = [w.append(b, stream_id=i % 2) for i, b in enumerate(bodies)]
    for r in rs:
        r.future.result(10)
    w.close()
    w2, recs = make_wal(capacity=32 << 20)
    assert [b for _, b in recs] == bodies
    assert [o for o, _ in recs] == [r.offset for r in rs]
    w2.close()
    # corrupt one byte in the middle of the 300 KB body: it and everything after is dropped
    # (records after an invalid one are kept only within the scan window; here all are in it,
    # so the survivors are exactly the other records)
    from storage.wal.format import HEADER_AREA
    with open(w.config.path, "r+b") as f:
        f.seek(HEADER_AREA + rs[3].offset + RECORD_HEADER_SIZE + 150_000)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    _, recs = make_wal(capacity=32 << 20)
    assert bodies[3] not in [b for _, b in recs]
    assert [b for _, b in recs][:3] == bodies[:3]


async def test_body_given_as_parts_is_stored_as_their_concatenation(make_wal):
    # the engine appends (framing header, payload view) without joining them first
    w, _ = make_wal(capacity=16 << 20)
    payload = bytearray(os.urandom(100_000))
    cases = [(b"head", memoryview(payload)[:10]),
             [b"h" * 24, memoryview(payload)],
             (b"", b"only"),
             (memoryview(payload)[5:40_000], b"tail")]
    rs = [w.append_loop(c, stream_id=1) for c in cases[:2]]
    rs.append(w.append(cases[2], stream_id=2))
    offs = [await r.future for r in rs[:2]] + [rs[2].future.result(10)]
    offs.append(await w.append_async(cases[3], stream_id=1))
    expect = [b"".join(bytes(p) for p in c) for c in cases]
    assert rs[0].next_offset - rs[0].offset == RECORD_HEADER_SIZE + len(expect[0])
    w.close()
    _, recs = make_wal(capacity=16 << 20)
    assert [b for _, b in recs] == expect
    assert [o for o, _ in recs] == offs


@pytest.mark.parametrize("native", [True, False])
async def test_append_loop_check_appends_nothing_on_a_crc_mismatch(make_wal, monkeypatch, native):
    """append_loop(check=(start, crc)): the CRC of the body from `start` is computed while the
    body is copied into its block (or in a pass of its own without the extension); a mismatch
    raises before the record is part of a block, so the next record takes its place and
    recovery finds only the good ones."""
    from storage.wal import wal as walmod
    if not native:
        monkeypatch.setattr(walmod, "COPY_CRC_NATIVE", False)
    w, _ = make_wal(capacity=16 << 20)
    head, big = b"h" * 20, os.urandom(300_000)
    good = w.append_loop((head, big), stream_id=1, check=(41, crc32c.crc32c(big[21:])))
    for start in (41, 5, 20, 300_019):               # in the second part, the first, at the edge
        whole = head + big
        with pytest.raises(ChecksumMismatchError):
            w.append_loop((head, big), stream_id=1,
                          check=(start, crc32c.crc32c(whole[start:]) ^ 1))
    ok2 = w.append_loop((head, big), stream_id=1, check=(5, crc32c.crc32c((head + big)[5:])))
    # the refused records took no room (the first block may have been sealed: next page)
    assert ok2.offset <= (good.next_offset + 4095) // 4096 * 4096
    assert await asyncio.gather(good.future, ok2.future) == [good.offset, ok2.offset]
    w.close()
    _, recs = make_wal(capacity=16 << 20)
    assert [(o, bytes(b)) for o, b in recs] == [(good.offset, head + big), (ok2.offset, head + big)]


@pytest.mark.parametrize("engine", ["uring", "aio", "threads"])
async def test_record_right_at_the_lap_start_after_a_block_ending_at_the_ring_end(make_wal,
                                                                                  wal_path,
                                                                                  engine):
    """Records end exactly at the ring's end, in the current block; the next record's offset is
    then the start of the next lap (in_lap 0, so it "fits before the ring's end") but it must
    not join that block: the block would be written as one piece from its start, past the
    ring's end (the file grew by a page; on a device it writes beyond the capacity), and the
    record would be nowhere near the ring position recovery reads for its offset (phys 8 KiB).
    It was lost after a crash: tests/wal/test_crash.py::test_crash_loop_long_file, docs/wal.md
    "On-disk format". After the first block's time seal the next one is a minute away, so
    tail, nxt and more share one block with either engine until flush(): deterministic."""
    cap = 256 << 10
    w, _ = make_wal(capacity=cap, io_engine=engine, flush_interval_s=60.0)
    if engine in LOOP_ENGINES:
        assert w.attach_loop()
    ring = w.ring_size
    head = w.append_loop(b"h" * (4096 - RECORD_HEADER_SIZE))      # [0, 4096)
    await head.future                     # sealed by time: the next time seal is 60 s away
    fill = w.append_loop(b"f" * (ring - 12288 - RECORD_HEADER_SIZE))  # [4096, ring - 8192)
    w.flush()
    await fill.future
    w.trim(head.next_offset)              # room for one page of the next lap
    tail = w.append_loop(b"t" * (8192 - RECORD_HEADER_SIZE))      # [ring - 8192, ring)
    nxt = w.append_loop(b"n" * 100)                                # the next lap's first
    more = w.append_loop(b"m" * 200)
    assert (tail.offset, tail.next_offset, nxt.offset) == (ring - 8192, ring, ring)
    w.flush()
    assert [await r.future for r in (tail, nxt, more)] == [tail.offset, ring, nxt.next_offset]
    w.close()
    assert os.path.getsize(wal_path) == cap                 # nothing written past the ring
    _, recs = make_wal(capacity=cap)
    assert recs == [(fill.offset, b"f" * (ring - 12288 - RECORD_HEADER_SIZE)),
                    (tail.offset, b"t" * (8192 - RECORD_HEADER_SIZE)),
                    (ring, b"n" * 100), (nxt.next_offset, b"m" * 200)]
