"""Frame pre-touch (broker/frames.py FramePool.pretouch, ``--frame-pretouch``): the arena slabs
that will hold the LogCache's produce frames are faulted in at start-up by the filler thread,
before any request, instead of while the first GiB is produced. Polls with generous deadlines:
no timing is asserted."""
from __future__ import annotations

import pytest

from broker.frames import REGISTERED_SLAB, FramePool

from cluster.kit import wait_for

DEADLINE_S = 120


def _arena_pool() -> FramePool:
    pool = FramePool(arena=True)
    if pool.arena is None:
        pytest.skip("storage._copycrc not built (no frame_arena)")
    return pool


def test_pretouch_maps_the_cache_s_slabs_before_any_frame_is_taken():
    pool = _arena_pool()
    try:
        pool.fit_cache(REGISTERED_SLAB)             # the arena's bound: 2 slabs and a bit
        assert pool.arena.mapped == 0               # nothing faulted in without a request...
        assert pool.pretouch(REGISTERED_SLAB)
        wait_for(lambda: pool._filler.pretouched, DEADLINE_S, "pre-touched")
        # ...and with pretouch, the cache's slab without any request: all of it free
        assert pool.arena.mapped == REGISTERED_SLAB
        assert pool.arena.free == REGISTERED_SLAB
        assert pool.arena_frames == 0 and pool.prefilled == 0
        frame = pool.take(1 << 20)                  # the first request's frame: from the slab
        assert type(frame) is not bytearray and pool.arena.mapped == REGISTERED_SLAB
        del frame
    finally:
        pool.close()


def test_pretouch_is_bounded_by_the_arena():
    pool = _arena_pool()
    try:
        pool.fit_cache(REGISTERED_SLAB)
        bound = pool.arena.max_bytes
        assert pool.pretouch(8 * bound)             # asks for more than the arena may map
        wait_for(lambda: pool._filler.pretouched, DEADLINE_S, "pre-touched")
        assert REGISTERED_SLAB <= pool.arena.mapped <= bound
    finally:
        pool.close()


def test_no_pretouch_without_an_arena():
    pool = FramePool()                              # bytearray frames (wal_io_engine aio)
    assert pool.arena is None
    assert not pool.pretouch(1 << 30)
    assert pool._filler is None
    pool.close()


def test_a_broker_pretouches_its_log_cache_at_start_without_any_request(broker_factory):
    """--frame-pretouch: the broker faults in its LogCache's slabs (64 MiB here) after start-up
    and says so once, with no client connected."""
    if FramePool(arena=True).arena is None:
        pytest.skip("storage._copycrc not built (no frame_arena)")
    b = broker_factory(["--frame-pretouch", "--log-cache-bytes", str(REGISTERED_SLAB),
                        "--wal-io-engine", "uring"])
    wait_for(lambda: "large frames pre-touched" in b.log_text(), DEADLINE_S, "pre-touched (log)")
    line = next(ln for ln in b.log_text().splitlines() if "large frames pre-touched" in ln)
    assert f"pre-touched: {REGISTERED_SLAB >> 20} MiB of arena slabs" in line, line


def test_a_broker_without_pretouch_says_nothing_of_it(broker_factory):
    b = broker_factory(["--frame-pretouch", "false", "--log-cache-bytes", str(REGISTERED_SLAB)])
    b.stop()                                        # its whole life, then the log
    assert "pre-touched" not in b.log_text()
