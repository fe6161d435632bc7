"""The WAL written by its event loop (attach_loop, io_engine "uring", the default, or "aio").

The same blocks, order and recovery as with IO threads; what differs is who submits and who
completes. These tests check that the loop path keeps every promise of the thread path: order
per stream, durability before acknowledgement, the queue depth, the IOPS budget, the bandwidth
limit, retries then failure on IO errors, and a clean close from the loop or from a thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import threading
import time

import pytest

from storage.wal import DeltaWAL, WALConfig, WALError
from storage.wal.aio import AioUnavailable
from storage.wal.errors import WALClosedError

from .test_fallback import ramfs_dir  # noqa: F401 - fixture


def body(stream: int, i: int, size: int = 0) -> bytes:
    size = size or 100 + (i * 7919) % 20_000
    head = f"{stream}:{i}:".encode()
    return head + bytes((i + k) % 251 for k in range(size - len(head)))


def reopen(path: str, capacity: int = 4 << 20) -> list[tuple[int, bytes]]:
    w = DeltaWAL(WALConfig(path=path, capacity=capacity))
    try:
        return list(w.open())
    finally:
        w.close()


def wal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("wal-io")]


async def test_loop_writes_without_io_threads_in_order_and_durably(make_wal, wal_path):
    others = set(wal_threads())                   # other tests' WALs (e.g. a zombie left open)
    w, _ = make_wal()
    assert set(wal_threads()) - others            # threads write until the loop takes over
    assert w.attach_loop() is True
    assert w.attach_loop() is True                # idempotent on the same loop
    assert not set(wal_threads()) - others
    recs = [(i % 3, body(i % 3, i)) for i in range(300)]
    results = [w.append_loop(b, stream_id=s) for s, b in recs]
    order: list[int] = []
    for k, r in enumerate(results):
        r.future.add_done_callback(lambda f, k=k: order.append(k))
    offs = await asyncio.gather(*[r.future for r in results])
    assert offs == [r.offset for r in results]
    for s in range(3):                            # acknowledged in order per stream
        mine = [k for k in order if recs[k][0] == s]
        assert mine == sorted(mine)
    assert w.stats["writes"] > 0
    assert w.confirmed_offset == w.end_offset
    w.close()
    got = reopen(wal_path)
    assert [b for _, b in got] == [b for _, b in recs]
    assert [o for o, _ in got] == offs


async def test_blocking_appends_from_threads_complete_through_the_loop(make_wal, wal_path):
    w, _ = make_wal()
    assert w.attach_loop()
    loop = asyncio.get_running_loop()

    def append_many(stream: int) -> list[int]:
        futs = [w.append(body(stream, i), stream_id=stream).future for i in range(100)]
        return [f.result(10) for f in futs]       # a plain thread waits; the loop writes

    offs = await asyncio.gather(*[loop.run_in_executor(None, append_many, s) for s in range(3)])
    assert all(o == sorted(o) for o in offs)
    w.close()
    got = reopen(wal_path)
    assert len(got) == 300
    assert sorted(o for per in offs for o in per) == [o for o, _ in got]


async def test_queue_depth_eager_then_full_under_backlog(make_wal):
    """At light load at most eager_writes writes are in flight; a backlog of sealed blocks
    (appended within one loop turn) brings in the rest of the depth, never more."""
    w, _ = make_wal(capacity=64 << 20, io_threads=4, eager_writes=2)
    assert w.attach_loop()
    driver = w._driver
    depths: list[int] = []
    real = driver.aio.submit_write

    def spy(*a, **kw):
        depths.append(len(driver._inflight) + 1)
        return real(*a, **kw)

    driver.aio.submit_write = spy
    for i in range(20):                            # one record per turn: light load
        await w.append_loop(body(0, i, 30_000)).future
    assert depths and max(depths) <= 2
    depths.clear()
    rs = [w.append_loop(body(1, i, 64 << 10), stream_id=1) for i in range(160)]   # 10 MiB
    await asyncio.gather(*[r.future for r in rs])
    assert max(depths) == 4


async def test_merged_writes_grow_to_backlog_write_bytes_only_under_a_deep_backlog(make_wal,
                                                                                 wal_path):
    """Sealed blocks backed up by more than 2 x backlog_write_bytes merge into writes of up to
    backlog_write_bytes; otherwise writes stay within max_write_bytes."""
    w, _ = make_wal(capacity=64 << 20, block_soft_limit=64 << 10, max_write_bytes=256 << 10,
                    backlog_write_bytes=512 << 10)
    assert w.attach_loop()
    driver = w._driver
    sizes: list[int] = []
    real = driver.aio.submit_write

    def spy(fd, pieces, *a, **kw):
        sizes.append(sum(n for _, n in pieces))
        return real(fd, pieces, *a, **kw)

    driver.aio.submit_write = spy
    for i in range(40):                            # one record per turn: no backlog
        await w.append_loop(body(0, i, 60_000)).future
    assert sizes and max(sizes) <= 256 << 10
    sizes.clear()
    rs = [w.append_loop(body(1, i, 60_000), stream_id=1) for i in range(200)]   # ~12 MiB
    await asyncio.gather(*[r.future for r in rs])
    assert 256 << 10 < max(sizes) <= 512 << 10
    assert min(sizes) <= 256 << 10                 # the tail of the backlog: shallow again
    w.close()
    assert [b for _, b in reopen(wal_path, 64 << 20)] == \
        [body(0, i, 60_000) for i in range(40)] + [body(1, i, 60_000) for i in range(200)]


def test_backlog_write_bytes_below_max_write_bytes_is_refused(wal_path):
    with pytest.raises(ValueError, match="backlog_write_bytes"):
        WALConfig(path=wal_path, max_write_bytes=2 << 20, backlog_write_bytes=1 << 20).validate()


async def test_next_writes_start_before_finished_ones_are_completed(make_wal):
    """Under a backlog, a reap that frees queue slots submits the next writes before it
    resolves the finished writes' futures (a device that finishes several writes at once
    would otherwise idle through that bookkeeping)."""
    w, _ = make_wal(capacity=64 << 20, io_threads=4, eager_writes=2)
    assert w.attach_loop()
    driver = w._driver
    log: list[str] = []

    def logged(name, real):
        """`real`, noting `name` in the log each time it returns something (an empty reap
        is not a reap)."""
        def call(*a, **kw):
            out = real(*a, **kw)
            if out or name != "reap":
                log.append(name)
            return out
        return call

    driver.aio.submit_write = logged("submit", driver.aio.submit_write)
    driver.aio.reap = logged("reap", driver.aio.reap)
    w._complete_groups = logged("complete", w._complete_groups)
    rs = [w.append_loop(body(1, i, 64 << 10), stream_id=1) for i in range(160)]   # 10 MiB
    await asyncio.gather(*[r.future for r in rs])
    after_reap = []                       # per reap: what came first, a submit or a complete
    for k, what in enumerate(log):
        if what == "reap":
            rest = log[k + 1:]
            nxt = rest.index("reap") if "reap" in rest else len(rest)
            turn = rest[:nxt]
            if "submit" in turn:
                after_reap.append(turn.index("submit") < turn.index("complete"))
    assert len(after_reap) >= 3
    assert all(after_reap)


async def test_a_large_submit_gives_the_cpu_to_kernel_work_before_the_loop_goes_on(
        make_wal, monkeypatch):
    """On a loop device, after an io_submit of at least YIELD_FROM_BYTES the loop yields its
    CPU (keeping the GIL): a kernel worker that io_submit woke on this CPU (a loop device's)
    starts the write at once instead of after the loop's next appends. Small writes do not
    yield: under CPU contention each yield cost a small acks=all request a scheduler slice."""
    from storage.wal import loop_driver

    w, _ = make_wal(capacity=64 << 20)
    assert w.attach_loop()
    driver = w._driver
    driver.yield_after_large = True         # as on a loop device (test below: detection)
    log: list[tuple[str, int]] = []
    real_submit, real_yield = driver.aio.submit_write, loop_driver.yield_cpu

    def submit(fd, pieces, *a, **kw):
        out = real_submit(fd, pieces, *a, **kw)
        log.append(("submit", sum(n for _, n in pieces)))
        return out

    def yield_cpu():
        log.append(("yield", 0))
        real_yield()

    driver.aio.submit_write = submit
    monkeypatch.setattr(loop_driver, "yield_cpu", yield_cpu)
    rs = [w.append_loop(body(1, i, 1 << 20), stream_id=1) for i in range(16)]
    await asyncio.gather(*[r.future for r in rs])
    large = [k for k, (what, n) in enumerate(log) if what == "submit"]
    assert len(large) >= 4
    assert all(log[k + 1][0] == "yield" for k in large if log[k][1] >= loop_driver.YIELD_FROM_BYTES)
    log.clear()
    # records of produce runs (small requests merged, up to 512 KiB): no yields
    rs = [w.append_loop(body(1, 20 + i, 512 << 10), stream_id=1) for i in range(8)]
    await asyncio.gather(*[r.future for r in rs])
    assert max(n for what, n in log if what == "submit") >= loop_driver.YIELD_FROM_BYTES
    assert ("yield", 0) not in log
    log.clear()
    for i in range(20):                         # one small record at a time: no yields
        await w.append_loop(body(1, 100 + i, 100), stream_id=1).future
    assert [what for what, _ in log].count("submit") >= 20
    assert ("yield", 0) not in log
    log.clear()
    # a backlog of small records (the loop fell behind): large writes, no yields either
    rs = [w.append_loop(body(1, 200 + i, 1000), stream_id=1) for i in range(3000)]
    await asyncio.gather(*[r.future for r in rs])
    assert max(n for what, n in log if what == "submit") >= loop_driver.YIELD_FROM_BYTES
    assert ("yield", 0) not in log


async def test_large_writes_do_not_yield_unless_a_loop_device_serves_them(make_wal,
                                                                          monkeypatch):
    """The yield is for a loop device's kernel worker. On a file of a disk's file system
    (the bench's WAL) or a disk, io_submit starts the write itself and a yield only handed the
    loop's CPU to other runnable work, e.g. a co-located producer (bench/HISTORY.md, session
    19). Loop devices are told by their major number, as the device or under the file system."""
    import stat as stat_mod

    from storage.wal import loop_driver
    from storage.wal.device import on_loop_device

    def st(mode: int, dev: int, rdev: int) -> os.stat_result:
        return os.stat_result((mode | 0o600, 1, dev, 1, 0, 0, 0, 0, 0, 0), {"st_rdev": rdev})

    assert on_loop_device(st(stat_mod.S_IFBLK, os.makedev(0, 5), os.makedev(7, 3)))
    assert on_loop_device(st(stat_mod.S_IFREG, os.makedev(7, 1), 0))
    assert not on_loop_device(st(stat_mod.S_IFBLK, os.makedev(0, 5), os.makedev(259, 0)))
    assert not on_loop_device(st(stat_mod.S_IFREG, os.makedev(254, 0), 0))

    w, _ = make_wal(capacity=64 << 20)
    assert w.attach_loop()
    driver = w._driver
    assert driver.yield_after_large == on_loop_device(os.stat(w.config.path))
    if driver.yield_after_large:
        pytest.skip("the test WAL sits on a loop device")
    yields: list[int] = []
    monkeypatch.setattr(loop_driver, "yield_cpu", lambda: yields.append(1))
    rs = [w.append_loop(body(1, i, 1 << 20), stream_id=1) for i in range(8)]
    await asyncio.gather(*[r.future for r in rs])
    assert not yields


async def test_durable_writes_are_acknowledged_when_starting_the_next_fails(make_wal):
    """The next writes start before the finished ones are completed; an error there (say
    a header write for a larger window) must not leave durable records unacknowledged."""
    w, _ = make_wal()
    assert w.attach_loop()
    driver = w._driver
    real_release, real_kick = w._release_writes, driver.kick
    armed: list[int] = []

    def release(n):
        armed.append(n)
        return real_release(n)

    def kick():
        if armed:
            armed.clear()
            raise OSError(5, "injected")
        return real_kick()

    w._release_writes, driver.kick = release, kick
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    r = w.append_loop(b"y" * 3000)
    assert await asyncio.wait_for(r.future, 10) == r.offset
    assert [str(e.get("exception")) for e in errors] == ["[Errno 5] injected"]


class _LockWatch:
    """The WAL's lock, noting each time kick() takes it."""

    def __init__(self, lock, log: list[str], in_kick: list[bool]) -> None:
        self.lock, self.log, self.in_kick = lock, log, in_kick

    def __enter__(self):
        if self.in_kick[0]:
            self.log.append("kick takes the lock")
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


async def test_a_completion_with_nothing_left_to_write_takes_no_lock_to_kick(make_wal):
    """A reaped write whose blocks were the last ones leaves nothing to seal or start: the
    kick after it returns before the lock and the clock (both, twice per completion before)."""
    w, _ = make_wal()
    assert w.attach_loop()
    driver = w._driver
    log: list[str] = []
    in_kick = [False]
    real_kick, real_submit = driver.kick, driver.aio.submit_write
    real_complete = w._complete_groups

    def kick():
        log.append("kick")
        in_kick[0] = True
        try:
            return real_kick()
        finally:
            in_kick[0] = False

    def submit(*a, **kw):
        log.append("submit")
        return real_submit(*a, **kw)

    def complete(*a, **kw):
        log.append("complete")
        return real_complete(*a, **kw)

    driver.kick, driver.aio.submit_write, w._complete_groups = kick, submit, complete
    w._lock = _LockWatch(w._lock, log, in_kick)
    r = w.append_loop(b"y" * 3000)
    assert await asyncio.wait_for(r.future, 10) == r.offset
    for _ in range(5):
        await asyncio.sleep(0)
    after = log[log.index("submit"):]
    assert "complete" in after and "kick" in after
    assert "kick takes the lock" not in after, after
    # ... while a kick with a record to seal does take it
    log.clear()
    w.append_loop(b"z" * 100)
    driver.kick()
    assert "kick takes the lock" in log


async def test_time_based_seal_keeps_the_iops_budget(make_wal):
    """A block that is not full waits for flush_interval_s after the previous time-based
    seal (the timerfd wakes the loop); lower bounds only, so a slow machine cannot fail it."""
    w, _ = make_wal(flush_interval_s=0.2)
    assert w.attach_loop()
    t0 = time.monotonic()
    await w.append_loop(b"first").future          # the first seal is due at once
    t1 = time.monotonic()
    await w.append_loop(b"second").future         # sealed no earlier than 0.2 s after it
    t2 = time.monotonic()
    assert t2 - t0 >= 0.19
    assert w.stats["writes"] == 2
    assert t1 - t0 < t2 - t0


async def test_bandwidth_limit_paces_the_loop_writes(make_wal, wal_path):
    w, _ = make_wal(capacity=16 << 20, bandwidth_limit=4_000_000)
    assert w.attach_loop()
    t0 = time.monotonic()
    rs = [w.append_loop(body(0, i, 64 << 10)) for i in range(32)]                 # 2 MiB
    await asyncio.gather(*[r.future for r in rs])
    assert time.monotonic() - t0 >= 0.4           # 2 MiB at 4 MB/s, the first write free
    w.close()
    assert len(reopen(wal_path, 16 << 20)) == 32


async def test_close_from_another_thread_while_the_loop_runs(make_wal, wal_path):
    """The engine closes the WAL from an executor thread: everything appended is written and
    acknowledged first, then a clean header."""
    w, _ = make_wal()
    assert w.attach_loop()
    rs = [w.append_loop(body(2, i), stream_id=2) for i in range(200)]
    await asyncio.get_running_loop().run_in_executor(None, w.close)
    assert all(r.future.done() and r.future.exception() is None for r in rs)
    with pytest.raises(WALClosedError):
        w.append_loop(b"late")
    got = reopen(wal_path)
    assert [o for o, _ in got] == [r.offset for r in rs]


async def test_close_on_the_loop_drains_synchronously(make_wal, wal_path):
    w, _ = make_wal()
    assert w.attach_loop()
    rs = [w.append_loop(body(1, i), stream_id=1) for i in range(50)]
    w.close()                                     # blocks the loop until all is written
    await asyncio.sleep(0)
    assert all(r.future.done() and r.future.exception() is None for r in rs)
    assert len(reopen(wal_path)) == 50


async def test_submit_errors_are_retried_then_fail_the_wal(make_wal, wal_path):
    w, _ = make_wal()
    assert w.attach_loop()
    driver = w._driver
    real = driver.aio.submit_write
    failures = [2]

    def flaky(*a, **kw):
        if failures[0]:
            failures[0] -= 1
            raise OSError(5, "injected EIO")
        return real(*a, **kw)

    driver.aio.submit_write = flaky
    assert await w.append_loop(b"retried").future >= 0      # two failures, third try works

    def broken(*a, **kw):
        raise OSError(5, "injected EIO")

    driver.aio.submit_write = broken
    r = w.append_loop(b"lost")
    with pytest.raises(WALError):
        await asyncio.wait_for(r.future, 10)
    with pytest.raises(WALClosedError):
        w.append_loop(b"refused")
    w.close()
    assert [b for _, b in reopen(wal_path)] == [b"retried"]


async def test_failed_completions_are_rewritten(make_wal, wal_path):
    """A completion with an error (or a short count) rewrites the same bytes in place."""
    w, _ = make_wal()
    assert w.attach_loop()
    driver = w._driver
    real = driver.aio.reap
    bad = [1]

    def reap(*a, **kw):
        events = real(*a, **kw)
        if events and bad[0]:
            bad[0] = 0
            token, _res = events[0]
            events[0] = (token, -5)
        return events

    driver.aio.reap = reap
    assert await asyncio.wait_for(w.append_loop(b"x" * 5000).future, 10) >= 0
    assert bad == [0]
    w.close()
    assert [b for _, b in reopen(wal_path)] == [b"x" * 5000]


async def test_threads_stay_when_aio_is_off_or_unavailable(make_wal, monkeypatch, tmp_path):
    w, _ = make_wal(io_engine="threads")
    assert w.attach_loop() is False
    assert wal_threads()
    assert await w.append_loop(b"by a thread").future >= 0

    import storage.wal.wal as walmod

    def unavailable(*a, **kw):
        raise AioUnavailable("no native AIO here")

    monkeypatch.setattr(walmod, "LoopDriver", unavailable)
    w2, _ = make_wal(path=str(tmp_path / "wal2"))
    assert w2.attach_loop() is False
    assert await w2.append_loop(b"still written").future >= 0


def test_attach_needs_a_running_loop_and_an_open_wal(wal_path):
    w = DeltaWAL(WALConfig(path=wal_path, capacity=4 << 20))
    with pytest.raises(RuntimeError):
        w.attach_loop()                           # no running loop

    async def attach_unopened() -> None:
        with pytest.raises(WALClosedError):
            w.attach_loop()
    asyncio.run(attach_unopened())


def test_io_engine_is_validated(wal_path):
    with pytest.raises(ValueError, match="io_engine"):
        DeltaWAL(WALConfig(path=wal_path, io_engine="bogus"))


async def test_buffered_fallback_keeps_threads(ramfs_dir):
    """Where O_DIRECT is refused (ramfs) AIO would run synchronously inside io_submit and
    block the loop: the threads keep writing."""
    path = str(ramfs_dir / "wal")
    w = DeltaWAL(WALConfig(path=path, capacity=1 << 20))
    list(w.open())
    try:
        assert not w.direct_io
        assert w.attach_loop() is False
        assert wal_threads()
        assert await w.append_loop(b"buffered").future >= 0
    finally:
        w.close()
    assert [b for _, b in reopen(path, 1 << 20)] == [b"buffered"]


def test_append_waits_in_a_thread_pool_future(make_wal):
    """append() from a thread returns a concurrent future even when a loop drives the WAL."""
    w, _ = make_wal()
    box: dict = {}
    ready = threading.Event()
    stop = None

    async def drive() -> None:
        nonlocal stop
        stop = asyncio.Event()
        box["attached"] = w.attach_loop()
        ready.set()
        await stop.wait()

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_until_complete, args=(drive(),))
    t.start()
    try:
        assert ready.wait(10) and box["attached"]
        r = w.append(b"from a thread", stream_id=5)
        assert isinstance(r.future, cf.Future)
        assert r.future.result(10) == r.offset
    finally:
        loop.call_soon_threadsafe(lambda: stop.set())
        t.join(10)
        w.close()                                 # the loop has stopped: drained here
        loop.close()


async def test_the_loops_aio_calls_keep_the_gil_and_wake_no_io_thread(make_wal, monkeypatch):
    """io_submit, the reap that does not wait and the eventfd reset run with the GIL held (a
    release hands it to a waiting thread, which the loop then has to wait for); appends on the
    loop notify no IO thread condition (there are none once the loop writes). The ctypes path
    (no storage._copycrc); the C one: test_aio_native.py."""
    import ctypes

    from storage.wal import aio

    monkeypatch.setattr(aio, "NATIVE", False)

    assert aio._syscall_held._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    assert aio._read_held._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    assert not aio._syscall._flags_ & ctypes._FUNCFLAG_PYTHONAPI   # a waiting reap releases
    held: list[int] = []
    reads: list[int] = []
    real_syscall, real_read = aio._syscall_held, aio._read_held

    def syscall(nr, *a):
        held.append(nr)
        return real_syscall(nr, *a)

    def read(fd, *a):
        reads.append(fd)
        return real_read(fd, *a)

    monkeypatch.setattr(aio, "_syscall_held", syscall)
    monkeypatch.setattr(aio, "_read_held", read)
    w, _ = make_wal(io_engine="aio")                    # libaio, not the io_uring default
    assert w.attach_loop()
    notified: list[str] = []
    monkeypatch.setattr(w._io_cond, "notify", lambda n=1: notified.append("io"))
    rs = [w.append_loop(body(0, i, 40_000)) for i in range(50)]
    await asyncio.gather(*[r.future for r in rs])
    assert aio._nr[3] in held and aio._nr[2] in held          # io_submit, io_getevents
    assert w._driver.aio.eventfd in reads
    assert notified == []
    w.close()
