"""Large request frames cut from huge-page slabs (broker/frames.py, storage._copycrc's
frame_arena): a frame's pages go back to the arena only when nothing sees them any more (the
LogCache's payload view, a reader's slice of it, the WAL's write), so a frame is never
received into again while a view of it is alive; at the arena's bound frames are bytearrays."""
from __future__ import annotations

import ctypes
import os
import struct

import pytest

from broker.frames import ARENA_SLAB, FramePool
from protocol import build_batch
from storage.wal.aio import AioUnavailable, UringContext

from broker_wire import Wire
from datapath.wire import metric_at
from test_placed_produce import _fetch, _produce, broker_with_topic, produce_v3

_I32 = struct.Struct(">i")


def _pool() -> FramePool:
    pool = FramePool(huge=True)
    if pool.arena is None:
        pytest.skip("storage._copycrc not built (no frame_arena)")
    return pool


def _addr(buf) -> int:
    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c


def test_a_frame_is_not_reused_while_a_view_of_it_lives():
    pool = _pool()
    pool.arena.max_bytes = ARENA_SLAB           # one slab: no filler thread racing the test
    frame = pool.take(1 << 20)
    assert type(frame) is not bytearray and pool.arena_frames == 1
    old = _addr(frame)
    payload = memoryview(frame)[4096:(1 << 20) - 4096]      # what the LogCache keeps
    payload[:] = b"k" * len(payload)
    reader = payload[100:200]                                # a Fetch answer's slice
    box = [payload]
    del payload, frame
    pool.recycle(box)                                        # the cache evicts it
    taken = _take_all(pool)                                  # the arena's every free run
    assert old not in {_addr(f) for f in taken}
    for f in taken:
        memoryview(f)[:] = b"x" * len(f)                     # new requests received
    assert bytes(reader) == b"k" * 100
    reader.release()
    del reader                                               # the last view: run freed
    again = pool.take(1 << 20)
    assert type(again) is not bytearray and _addr(again) == old


def _take_all(pool: FramePool) -> list:
    """Arena frames of 1 MiB until the arena (at its bound) has none left."""
    out = []
    while type(f := pool.take(1 << 20)) is not bytearray:
        out.append(f)
    return out


def test_frames_are_bytearrays_at_the_arena_bound():
    pool = _pool()
    pool.arena.max_bytes = ARENA_SLAB
    frames = [pool.take(3 << 20) for _ in range(ARENA_SLAB // (3 << 20) + 2)]
    assert type(frames[0]) is not bytearray
    assert type(frames[-1]) is bytearray and pool.arena_misses >= 1
    assert pool.arena.mapped == ARENA_SLAB
    pool.give(frames[0])                                     # ignored: back on its own
    frames.clear()
    assert pool.arena.free == ARENA_SLAB


def test_produced_bytes_survive_many_more_produces_through_a_small_log_cache(broker_factory):
    """Produce frames through an 8 MiB LogCache (the arena then holds at most 64 MiB of slabs):
    96 MiB produced, so the frames' runs are received into again and again; every batch read
    back, from the cache or from objects, is the one produced."""
    _produce_and_read_back(broker_factory, ("huge-page slabs", "4 KiB-page slabs", "bytearrays"))


def test_produced_bytes_survive_with_the_wal_on_io_uring_fixed_buffers(broker_factory):
    """The same with --wal-io-engine uring (the default, named here): frames cut from 4 KiB-page
    slabs registered with the WAL's io_uring, written with WRITE(V)_FIXED from pages pinned
    once, while their runs are received into again and again (storage/wal/aio.py
    UringContext)."""
    _produce_and_read_back(broker_factory, ("4 KiB-page slabs",), ("--wal-io-engine", "uring"),
                           fixed=True)


@pytest.mark.parametrize("engine,writer,frames", [
    ("uring", "io_uring", "4 KiB-page slabs"),
    ("aio", "libaio", "bytearrays"),
])
def test_the_wal_io_engine_option_picks_the_writer_and_the_frames(broker_factory, engine,
                                                                  writer, frames):
    """--wal-io-engine is the one switch: "uring" writes the WAL through io_uring from
    registered arena slabs, "aio" through libaio from bytearray frames (the path before
    session 33); the broker says which writes the WAL in one start-up line."""
    if engine == "uring":
        try:
            UringContext(8).close()
        except AioUnavailable as e:
            pytest.skip(f"io_uring unavailable: {e}")
    if FramePool(arena=True).arena is None:
        pytest.skip("storage._copycrc not built (no frame_arena)")
    b = broker_factory(["--wal-io-engine", engine])
    log = b.log_text()
    assert f"large frames: {frames}" in log, log
    lines = [ln for ln in log.splitlines() if "WAL written by" in ln]
    assert len(lines) == 1 and f"WAL written by {writer}" in lines[0], log


def _produce_and_read_back(broker_factory, kinds: tuple[str, ...],
                           args: tuple[str, ...] = (), fixed: bool = False) -> None:
    """``fixed``: most WAL writes must have gone as WRITE_FIXED (the registered frames' path)."""
    topic = "arena"
    b, w, mport = broker_with_topic(broker_factory, topic,
                                    ("--log-cache-bytes", str(8 << 20), *args))
    assert any(f"large frames: {kind}" in b.log_text() for kind in kinds)
    sent: list[bytes] = []
    n_batches = 96
    for i in range(n_batches):
        rec = build_batch([(None, os.urandom(1000)) for _ in range(1000)], timestamp=1)
        _produce(w, produce_v3(100 + i, topic, [(0, rec)]), 100 + i)
        sent.append(rec)
        if i >= 3:                                           # a recent one: in the cache
            _check(w, 1000 + i, topic, 1000 * (i - 3), sent[i - 3])
    assert metric_at(mport, "s3kafka_wal_placed_records_total") > n_batches // 2
    fixed_writes = metric_at(mport, "s3kafka_wal_fixed_writes_total")
    assert fixed_writes > n_batches // 2 if fixed else fixed_writes is not None
    for i, rec in enumerate(sent):                           # every one, cached or uploaded
        _check(w, 2000 + i, topic, 1000 * i, rec)
    w.close()


def _check(w: Wire, corr: int, topic: str, offset: int, rec: bytes) -> None:
    got = _fetch(w, corr, topic, 0, offset)
    pos = 0
    while pos + 12 <= len(got) and struct.unpack_from(">q", got, pos)[0] != offset:
        pos += 12 + _I32.unpack_from(got, pos + 8)[0]         # to the batch at ``offset``
    assert pos + len(rec) <= len(got), (offset, len(got))
    assert got[pos + 8:pos + 12] == rec[8:12]                 # past the broker's stamps
    assert got[pos + 16:pos + len(rec)] == rec[16:]
