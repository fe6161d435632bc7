"""Frame pre-touch (broker/frames.py FramePool.pretouch, ``--frame-pretouch``): the arena slabs
that will hold the LogCache's produce frames are faulted in by the filler thread right after
start-up, before any request, instead of while the first GiB is produced; and the filler says
so once, when the floor is mapped or the arena cannot grow to it. Polls with
generous deadlines: no timing is asserted."""
from __future__ import annotations

import logging
import threading
import time

import pytest

import broker.frames as frames
from broker.frames import (ARENA_AHEAD, PRETOUCH_YIELD_RATE, REGISTERED_SLAB, FramePool,
                           RateWatch, _Filler)
from broker.server import Broker
from storage.wal.aio import AioUnavailable, UringContext

from cluster.kit import wait_for
from conftest import free_port
from datapath.wire import metric_at
from test_placed_produce import _produce, batch, broker_with_topic, produce_v3

DEADLINE_S = 120
LINE = "large frames pre-touched"


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


def test_the_pool_s_on_grown_runs_on_the_filler_thread_after_it_grew():
    """FramePool.on_grown (the broker sets the WAL's refresh_fixed_buffers): called on the
    filler thread once a pass grew the arena, so the WAL's io_uring registers the new slabs
    there and not in the event loop's next submit; a hook that raises is only logged."""
    pool = _arena_pool()
    calls: list[tuple[str, int]] = []

    def hook() -> None:
        calls.append((threading.current_thread().name, pool.arena.mapped))
        raise RuntimeError("a failing hook leaves it to the next submit")

    try:
        pool.on_grown = hook
        pool.fit_cache(REGISTERED_SLAB)
        assert pool.pretouch(REGISTERED_SLAB)
        wait_for(lambda: pool._filler.pretouched, DEADLINE_S, "pre-touched")
        wait_for(lambda: calls, DEADLINE_S, "on_grown called")
        assert calls[0] == ("s3kafka-frames", REGISTERED_SLAB)
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


# ---- _Filler's "pre-touched" condition, pass by pass (no thread: _run on the test's) -------
class _Arena:
    """A frame arena's counters without memory: grow "maps" a slab (free: nothing taken)."""

    slab = REGISTERED_SLAB

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.mapped = 0
        self.free = ARENA_AHEAD                     # enough ahead: only a floor grows it

    def grow(self, populate: bool) -> bool:
        if self.mapped + self.slab > self.max_bytes:
            return False
        self.mapped += self.slab
        self.free += self.slab
        return True


class _Passes:
    """The filler's wake event: each wait returns at once and records (pretouched, mapped)
    after the pass before it; after ``passes`` passes the filler stops."""

    def __init__(self, filler: _Filler, passes: int) -> None:
        self.filler, self.passes = filler, passes
        self.after: list[tuple[bool, int]] = []
        self._waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        if self._waits:
            self.after.append((self.filler.pretouched, self.filler.arena.mapped))
        if self._waits == self.passes:
            self.filler._stopped = True
        self._waits += 1
        return True

    def clear(self) -> None:
        pass

    def set(self) -> None:
        pass


class _FloorSetMidPass(_Filler):
    """A filler whose floor the event loop sets (pretouch) just after the thread's first look
    at it in its first pass: that pass saw no floor, its grow loop ended, and the floor it
    then reads is one it did not grow to (the race left from session 35's review)."""

    _floor = 0
    _looks = 0

    @property
    def floor(self) -> int:
        self._looks += 1
        return self._floor if self._looks > 1 else 0

    @floor.setter
    def floor(self, n: int) -> None:
        self._floor = n


def _run(filler: _Filler, passes: int, monkeypatch) -> list[tuple[bool, int]]:
    monkeypatch.setattr(frames, "lower_current_thread", lambda nice: None)  # not this thread
    ev = filler._wake = _Passes(filler, passes)
    filler._run()
    return ev.after


def test_a_floor_set_after_a_pass_looked_is_not_reported_reached(monkeypatch, caplog):
    arena = _Arena(max_bytes=8 * REGISTERED_SLAB)
    filler = _FloorSetMidPass(arena)
    filler.floor = 3 * REGISTERED_SLAB              # set: seen from the thread's second look
    with caplog.at_level(logging.INFO, logger="broker.frames"):
        after = _run(filler, 3, monkeypatch)        # woken before the floor, then by pretouch
    # the first pass grew nothing and says nothing; the next grows to the floor and says so
    assert after[0] == (False, 0)
    assert after[1] == (True, 3 * REGISTERED_SLAB)
    assert after[2] == (True, 3 * REGISTERED_SLAB)
    lines = [r.getMessage() for r in caplog.records if LINE in r.getMessage()]
    assert len(lines) == 1 and f": {3 * REGISTERED_SLAB >> 20} MiB" in lines[0], lines


def test_a_floor_beyond_the_arena_s_bound_is_reported_once_at_the_bound(monkeypatch, caplog):
    arena = _Arena(max_bytes=2 * REGISTERED_SLAB + REGISTERED_SLAB // 2)
    filler = _Filler(arena)
    filler.floor = 3 * REGISTERED_SLAB              # more than grow will map
    with caplog.at_level(logging.INFO, logger="broker.frames"):
        after = _run(filler, 3, monkeypatch)
    assert after == [(True, 2 * REGISTERED_SLAB)] * 3
    lines = [r.getMessage() for r in caplog.records if LINE in r.getMessage()]
    assert len(lines) == 1 and f": {2 * REGISTERED_SLAB >> 20} MiB" in lines[0], lines


# ---- the floor waits while catch-up reads run (defer) -------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_rate_watch_says_whether_the_counter_rose_at_the_rate_over_the_window():
    clock, served = _Clock(), [0]
    watch = RateWatch(lambda: served[0], rate=100, window_s=1.0, clock=clock)
    clock.t += 0.5
    assert not watch()                              # nothing served since it was made
    served[0] += 60
    clock.t += 0.5                                  # 60 over the 1 s since it was made
    assert not watch()
    served[0] += 200
    clock.t += 0.25                                 # 260 over the last 1.25 s
    assert watch()
    clock.t += 0.5                                  # the 200 are still within the window
    assert watch()
    clock.t += 1.0                                  # the window has moved past them
    assert not watch()
    clock.t += 1.0
    assert not watch()


def test_rate_watch_says_true_from_its_first_call_when_reads_ran_since_it_was_made():
    clock, served = _Clock(), [7 << 30]             # a counter that was already high
    watch = RateWatch(lambda: served[0], rate=100, clock=clock)
    served[0] += 50
    clock.t += 0.1                                  # 500/s since it was made
    assert watch()
    watch2 = RateWatch(lambda: served[0], rate=100, clock=clock)
    served[0] += 50
    assert not watch2()                             # no time has passed: no rate yet


def _deferring_run(filler: _Filler, defer, passes: int, monkeypatch) -> list[tuple[bool, int]]:
    filler._defer = defer
    return _run(filler, passes, monkeypatch)


def test_the_floor_waits_while_defer_says_so_then_is_reached(monkeypatch, caplog):
    """While ``defer`` is true the filler grows nothing for the floor (each look waits on the
    wake event, PRETOUCH_POLL_S at most); once it turns false the floor is mapped and the
    pre-touched line says how long it waited."""
    arena = _Arena(max_bytes=8 * REGISTERED_SLAB)
    filler = _Filler(arena)
    filler.floor = 3 * REGISTERED_SLAB
    seen: list[int] = []

    def defer() -> bool:
        seen.append(arena.mapped)
        return len(seen) <= 4                       # catch-up reads for four looks

    with caplog.at_level(logging.INFO, logger="broker.frames"):
        after = _deferring_run(filler, defer, 8, monkeypatch)
    assert seen[:4] == [0, 0, 0, 0]                 # nothing grown while it said so
    assert arena.mapped == 3 * REGISTERED_SLAB and filler.pretouched
    assert after[:4] == [(False, 0)] * 4            # the waits were on the wake event
    lines = [r.getMessage() for r in caplog.records if LINE in r.getMessage()]
    assert len(lines) == 1 and "waiting for catch-up reads" in lines[0], lines


def test_a_frame_needed_while_the_floor_waits_is_still_grown(monkeypatch):
    """Defer holds back only the slabs the floor alone asks for: when a take leaves less than
    ARENA_AHEAD free, the filler grows a slab without asking."""
    arena = _Arena(max_bytes=8 * REGISTERED_SLAB)
    filler = _Filler(arena)
    filler.floor = 4 * REGISTERED_SLAB
    looks: list[int] = []

    def defer() -> bool:
        looks.append(arena.mapped)
        if len(looks) == 2:
            arena.free = 0                          # a take used what was free
        return True                                 # catch-up reads all along

    _deferring_run(filler, defer, 6, monkeypatch)
    assert arena.mapped == REGISTERED_SLAB          # the need's slab, not the floor's
    assert looks[:2] == [0, 0] and set(looks[2:]) == {REGISTERED_SLAB}
    assert not filler.pretouched


def test_without_defer_the_floor_does_not_wait(monkeypatch):
    arena = _Arena(max_bytes=8 * REGISTERED_SLAB)
    filler = _Filler(arena)
    filler.floor = 2 * REGISTERED_SLAB
    after = _run(filler, 1, monkeypatch)
    assert after == [(True, 2 * REGISTERED_SLAB)] and filler.deferred_s == 0


def test_the_broker_s_defer_watches_its_engine_s_catch_up_bytes():
    """Broker._catchup_reads_running: a RateWatch over the engine's ColdReadPacer.bytes at
    PRETOUCH_YIELD_RATE (none without an engine)."""
    class Pacer:
        bytes = 0

    class Store:
        cold_pacer = Pacer()

    b = Broker.__new__(Broker)                      # only what the method uses
    b.store = Store()
    watch = b._catchup_reads_running()
    assert isinstance(watch, RateWatch) and watch.rate == PRETOUCH_YIELD_RATE
    Store.cold_pacer.bytes = 5 << 40                # far above the rate, whatever time passed
    time.sleep(2 * RateWatch.MIN_SPAN_S)            # ...once there is a span to measure
    assert watch()
    b.store = object()                              # --storage memory: no pacer
    assert b._catchup_reads_running() is None


# ---- a broker -------------------------------------------------------------------------------
def test_a_broker_pretouches_its_log_cache_at_start_without_any_request(broker_factory):
    """--frame-pretouch: the broker faults in its LogCache's slabs (64 MiB here) after start-up
    and says so once, with no client connected; a large produce afterwards adds no second
    line."""
    _arena_pool().close()                          # skips without frame_arena
    topic = "touch"
    b, w, _ = broker_with_topic(broker_factory, topic, (
        "--frame-pretouch", "--log-cache-bytes", str(REGISTERED_SLAB), "--wal-io-engine", "uring"))
    wait_for(lambda: LINE in b.log_text(), DEADLINE_S, "pre-touched (log)")
    _produce(w, produce_v3(1, topic, [(0, batch(1024, 1024))]), 1)
    w.close()
    b.stop()
    lines = [ln for ln in b.log_text().splitlines() if LINE in ln]
    assert len(lines) == 1 and f"pre-touched: {REGISTERED_SLAB >> 20} MiB of arena slabs" \
        in lines[0], lines


def test_a_broker_registers_its_pretouched_slabs_with_the_wal_before_any_request(
        broker_factory):
    """The pre-touched slabs are registered with the WAL's io_uring by the frames' thread
    (s3kafka_wal_registered_frame_bytes) with no client connected: the first produce does
    not pin them on the event loop (~35 ms per GiB, bench/HISTORY.md session 46)."""
    _arena_pool().close()                          # skips without frame_arena
    try:
        UringContext(8).close()
    except AioUnavailable as e:
        pytest.skip(f"io_uring unavailable: {e}")
    mport = free_port()
    b = broker_factory(["--metrics-listen", f"127.0.0.1:{mport}", "--frame-pretouch",
                        "--log-cache-bytes", str(REGISTERED_SLAB), "--wal-io-engine", "uring"])
    wait_for(lambda: LINE in b.log_text(), DEADLINE_S, "pre-touched (log)")
    wait_for(lambda: (metric_at(mport, "s3kafka_wal_registered_frame_bytes") or 0)
             >= REGISTERED_SLAB, DEADLINE_S, "slabs registered with the WAL's ring")
    assert metric_at(mport, "s3kafka_wal_fixed_writes_total") == 0    # no request yet


def test_a_broker_without_pretouch_says_nothing_of_it(broker_factory):
    """--frame-pretouch false: a large produce maps what the frames need, no pre-touch."""
    _arena_pool().close()                          # skips without frame_arena
    topic = "untouched"
    b, w, _ = broker_with_topic(broker_factory, topic, (
        "--frame-pretouch", "false", "--log-cache-bytes", str(REGISTERED_SLAB),
        "--wal-io-engine", "uring"))
    _produce(w, produce_v3(1, topic, [(0, batch(1024, 1024))]), 1)
    w.close()
    b.stop()                                        # its whole life, then the log
    assert "pre-touched" not in b.log_text()
