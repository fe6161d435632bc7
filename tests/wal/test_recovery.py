"""Recovery from every state a crash can leave (hand-made images, then the real reader)."""
from __future__ import annotations

import os

import pytest

from storage.wal import DeltaWAL, FencedError, WALConfig, WALPathError

from .craft import Image

CAP = 1 << 20               # ring of 1 MiB - 8 KiB
K4 = 4096


def recover(path: str, capacity: int = CAP, **kw) -> tuple[list[tuple[int, bytes]], DeltaWAL]:
    w = DeltaWAL(WALConfig(path=path, capacity=capacity, **kw))
    return list(w.open()), w


def b(i: int, n: int = 200) -> bytes:
    return bytes([i % 256]) * n


@pytest.fixture
def img(tmp_path) -> Image:
    return Image(str(tmp_path / "wal"), CAP)


def test_hole_from_out_of_order_completion_is_crossed(img):
    img.header(trim=0, window=64 * K4)
    img.record(0, b(1))                  # block 0 done
    # block at 4 KiB never completed (hole); blocks at 8 KiB and 40 KiB completed
    img.record(2 * K4, b(2))
    img.record(10 * K4, b(3))
    recs, w = recover(img.path)
    assert recs == [(0, b(1)), (2 * K4, b(2)), (10 * K4, b(3))]
    # the next session appends after everything recovered
    r = w.append(b"new")
    r.future.result(10)
    assert r.offset >= 11 * K4
    w.close()
    recs, w = recover(img.path)
    assert [o for o, _ in recs] == [0, 2 * K4, 10 * K4, r.offset]
    w.close()


def test_records_beyond_the_window_are_not_recovered(img):
    img.header(trim=0, window=4 * K4)
    img.record(0, b(1))
    img.record(3 * K4, b(2))             # within 4 KiB*4 of the hole at 4 KiB? hole at ~224 B
    img.record(20 * K4, b(3))            # far past first invalid + window
    recs, w = recover(img.path)
    assert [o for o, _ in recs] == [0, 3 * K4]
    w.close()


def test_zero_length_window_stops_at_first_invalid(img):
    img.header(trim=0, window=0)
    n = img.record(0, b(1))
    img.record(n, b(2))                  # packed right after: still recovered
    img.record(2 * K4, b(3))             # after a hole: window 0 never crosses it
    recs, w = recover(img.path)
    assert [o for o, _ in recs] == [0, n]
    w.close()


def test_wrap_around_continues_on_the_next_lap(img):
    ring = img.ring
    start = ring - 3 * K4
    img.header(trim=start, window=64 * K4)
    n = img.record(start, b(1, 5000))
    img.record(ring, b(2))               # second lap, physically at the ring's start
    img.record(ring + K4, b(3))
    recs, w = recover(img.path)
    assert [o for o, _ in recs] == [start, ring, ring + K4]
    assert n < ring
    w.close()


def test_record_that_does_not_fit_at_the_end_jumps_to_next_lap(img):
    ring = img.ring
    start = 2 * ring - 2 * K4                   # near the end of lap 1
    img.header(trim=start, window=64 * K4)
    img.record(start, b(1, 100))
    # the next record (10 KiB) did not fit in the last 8 KiB: the writer moved it to the next
    # lap, the tail keeps whatever lap 0 left there (here: a stale but intact record)
    img.record(start + K4, b(9), stored_offset=start + K4 - ring)
    img.record(2 * ring, b(2, 10_000))
    recs, w = recover(img.path)
    assert recs == [(start, b(1, 100)), (2 * ring, b(2, 10_000))]
    w.close()


def test_stale_records_from_an_earlier_lap_are_rejected(img):
    ring = img.ring
    img.header(trim=ring, window=64 * K4)
    img.record(ring, b(1))
    # lap-0 records still sit behind the live data: valid CRCs, but their stored offset is one
    # lap older than the position they are read at
    for i in range(1, 6):
        img.record(ring + i * K4, b(50 + i), stored_offset=i * K4)
    recs, w = recover(img.path)
    assert recs == [(ring, b(1))]
    w.close()


def test_torn_block_keeps_intact_prefix_and_drops_torn_records(img, tmp_path):
    # a real writer produces one block of several pages, then a page in its middle is torn
    w = DeltaWAL(WALConfig(path=img.path, capacity=CAP))
    list(w.open())
    w.flush()
    rs = [w.append(b(i, 1500)) for i in range(8)]    # ~12 KiB: one block of 3 pages
    for r in rs:
        r.future.result(10)
    w.close()
    first_page_end = rs[0].offset - rs[0].offset % K4 + K4
    torn_at = first_page_end                     # second page lost (left at zero)
    img.fill(torn_at, bytes(K4))
    recs, w = recover(img.path)
    got = [o for o, _ in recs]
    intact = [r.offset for r in rs if r.next_offset <= torn_at]
    assert got[:len(intact)] == intact
    for o, body in recs:                          # whatever is returned is byte-exact
        i = [r.offset for r in rs].index(o)
        assert body == b(i, 1500)
    assert all(r.offset not in got for r in rs if r.offset < torn_at + K4
               and r.next_offset > torn_at)
    w.close()


def test_one_header_slot_corrupt_uses_the_other(img):
    img.header(trim=0, window=64 * K4)                # counter 1 -> slot 1
    img.header(trim=2 * K4, window=64 * K4)           # counter 2 -> slot 0
    img.record(0, b(1))
    img.record(2 * K4, b(2))
    img.corrupt_slot(0)                               # newest copy torn
    recs, w = recover(img.path)
    assert [o for o, _ in recs] == [0, 2 * K4]        # falls back to trim 0
    assert w.trim_offset == 0
    w.close()


def test_newest_header_wins_by_counter_not_slot(img):
    img.record(0, b(1))
    img.record(2 * K4, b(2))
    img.record(4 * K4, b(3))
    img.header(trim=4 * K4, window=64 * K4, counter=7, slot=0)
    img.header(trim=2 * K4, window=64 * K4, counter=6, slot=1)
    recs, w = recover(img.path)
    assert [o for o, _ in recs] == [4 * K4]
    w.close()
    # reopen: the header written by that session keeps the trim
    recs, w = recover(img.path)
    assert [o for o, _ in recs] == [4 * K4]
    w.close()


def test_trim_at_an_invalid_record_skips_to_next_boundary(img):
    img.header(trim=K4 + 100, window=64 * K4)          # points into garbage
    img.record(0, b(1))
    img.fill(K4, os.urandom(3000))
    img.record(2 * K4, b(2))
    img.record(3 * K4, b(3))
    recs, w = recover(img.path)
    assert [o for o, _ in recs] == [2 * K4, 3 * K4]
    w.close()


def test_corrupt_body_is_treated_as_a_hole(img):
    img.header(trim=0, window=64 * K4)
    img.record(0, b(1))
    img.record(K4, b(2), corrupt_body=True)
    img.record(2 * K4, b(3))
    recs, w = recover(img.path)
    assert [o for o, _ in recs] == [0, 2 * K4]
    w.close()


def test_blank_device_is_formatted(img):
    recs, w = recover(img.path)
    assert recs == []
    r = w.append(b"first")
    assert r.future.result(10) == 0
    w.close()


def test_newer_epoch_fences_an_older_owner(img):
    img.header(trim=0, window=K4, epoch=5)
    with pytest.raises(FencedError):
        recover(img.path, node_epoch=4)
    recs, w = recover(img.path, node_epoch=5)
    w.close()


def test_garbage_everywhere_never_crashes(tmp_path):
    """Foreign data is refused unchanged; formatting it takes allow_format (--wal-format)."""
    path = str(tmp_path / "wal")
    garbage = os.urandom(CAP)
    with open(path, "wb") as f:
        f.write(garbage)
    with pytest.raises(WALPathError, match="not an s3kafka WAL"):
        recover(path)
    with open(path, "rb") as f:
        assert f.read() == garbage
    recs, w = recover(path, allow_format=True)
    assert recs == []
    w.close()


def test_many_writer_sessions_keep_offsets_growing(tmp_path):
    path = str(tmp_path / "wal")
    last = -1
    expect = []
    for session in range(5):
        recs, w = recover(path)
        assert recs == expect
        r = w.append(b(session, 777))
        r.future.result(10)
        assert r.offset > last
        last = r.offset
        expect.append((r.offset, b(session, 777)))
        if session % 2:
            w.close()                                  # even sessions "crash" (no close)
        else:
            w._device.close()                          # drop the fd without a clean header
            w._closed = True
