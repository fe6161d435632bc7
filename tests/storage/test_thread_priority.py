"""Cold-read threads run below the event loop in CPU and I/O priority, and only they do."""
from __future__ import annotations

import asyncio
import os
import platform
import threading

import pytest

from storage.engine import open_engine
from storage.thread_priority import IO_CLASSES, background_executor, io_class_of

from storage_helpers import fill, read_all, small_config

linux_ioprio = pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64", "i686")
                                  or not hasattr(os, "sched_getscheduler"),
                                  reason="ioprio syscall numbers known for Linux x86/arm only")


def _priorities() -> tuple[int, int, str]:
    tid = threading.get_native_id()
    return os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(0), io_class_of(tid)


@linux_ioprio
def test_background_executor_threads_are_lowered_and_only_they() -> None:
    before = _priorities()
    pool = background_executor(2, "t-low", 19, "idle")
    try:
        nice, policy, io = pool.submit(_priorities).result(10)
    finally:
        pool.shutdown(wait=True)
    assert nice == 19
    assert policy == os.SCHED_BATCH
    assert io == "idle"
    assert _priorities() == before, "the calling thread keeps its priorities"
    # a thread started later by the same process is not affected either
    out: list = []
    t = threading.Thread(target=lambda: out.append(_priorities()))
    t.start()
    t.join()
    assert out == [before]


def test_unknown_io_class_is_refused() -> None:
    with pytest.raises(ValueError, match="I/O class"):
        background_executor(1, "t", 19, "realtime")
    assert set(IO_CLASSES) == {"be", "idle"}


@linux_ioprio
async def test_engine_cold_reads_run_on_low_priority_threads(tmp_path) -> None:
    """Object reads of the cold path run on the cold threads (SCHED_BATCH; the idle I/O class
    while producers append, the normal one otherwise); uploads keep the normal IO threads, and
    the WAL (written by the loop) stays untouched."""
    before = {t.ident for t in threading.enumerate()}   # other tests' WALs may leave threads
    eng = open_engine(small_config(tmp_path))
    await eng.start()
    seen: dict[str, set] = {"get": set(), "put": set()}
    store = eng.store
    real_get, real_ranges, real_put = store.get, store.get_ranges, store.put
    real_ranges_crc = store.get_ranges_crc

    def get(*a, **kw):
        seen["get"].add((threading.current_thread().name,) + _priorities())
        return real_get(*a, **kw)

    def get_ranges(*a, **kw):
        seen["get"].add((threading.current_thread().name,) + _priorities())
        return real_ranges(*a, **kw)

    def get_ranges_crc(*a, **kw):
        seen["get"].add((threading.current_thread().name,) + _priorities())
        return real_ranges_crc(*a, **kw)

    def put(*a, **kw):
        seen["put"].add((threading.current_thread().name,) + _priorities())
        return real_put(*a, **kw)

    store.get, store.get_ranges, store.put = get, get_ranges, put
    store.get_ranges_crc = get_ranges_crc
    try:
        s = await eng.create_stream()
        await fill(s, 200)
        await eng.flush()
        eng.drop_caches()
        eng.cold_pacer._hot_at = eng.cold_pacer._clock()      # producers appending now
        assert len(await read_all(s)) == 200
        assert seen["get"] and seen["put"]
        for name, nice, policy, io in seen["get"]:
            assert name.startswith("s3kafka-cold")
            assert (nice, policy, io) == (0, os.SCHED_BATCH, "idle")
        # nothing hot to protect: the same threads read in the normal I/O class
        seen["get"].clear()
        eng.cold_pacer._hot_at = float("-inf")
        eng.drop_caches()
        assert len(await read_all(s)) == 200
        assert seen["get"] and {io for *_, io in seen["get"]} == {"be"}
        assert {(n, p) for _, n, p, _ in seen["get"]} == {(0, os.SCHED_BATCH)}
        for name, nice, policy, io in seen["put"]:
            assert name.startswith("s3kafka-io") and policy != os.SCHED_BATCH and io != "idle"
        # the WAL is written by the event loop itself (native AIO): no WAL threads, and the
        # loop's thread, whose priority the AIO requests carry, is untouched
        assert eng.wal._driver is not None
        assert not [t for t in threading.enumerate()
                    if t.name.startswith("wal-io") and t.ident not in before]
        loop_tid = threading.get_native_id()
        assert os.getpriority(os.PRIO_PROCESS, loop_tid) == 0
        assert io_class_of(loop_tid) != "idle"
    finally:
        store.get, store.get_ranges, store.put = real_get, real_ranges, real_put
        await eng.close()


async def test_cold_read_io_class_can_be_left_alone(tmp_path) -> None:
    eng = open_engine(small_config(tmp_path, cold_read_io_class="", cold_read_nice=5))
    await eng.start()
    try:
        s = await eng.create_stream()
        await fill(s, 50)
        await eng.flush()
        eng.drop_caches()
        got = await asyncio.get_running_loop().run_in_executor(eng._cold_executor, _priorities)
        assert got[0] == 5
        if platform.machine() in ("x86_64", "aarch64"):
            assert got[2] != "idle"
        assert len(await read_all(s)) == 50
    finally:
        await eng.close()


@linux_ioprio
def test_the_frame_prefill_thread_never_preempts_on_wake_up() -> None:
    """The thread that faults produce frames in ahead of need runs at SCHED_BATCH with the
    process's nice value: woken per large request, it waits for a CPU instead of preempting
    the event loop (bench/HISTORY.md, session 19); the thread that woke it is untouched."""
    from broker.frames import PREFILL_FROM, FramePool
    before = _priorities()
    pool = FramePool()
    try:
        pool.take(PREFILL_FROM)             # the first large take starts the thread
        pre = pool._prefill
        assert pre is not None and pre._thread is not None
        t = pre._thread
        for _ in range(1000):               # until it prefilled (it lowers itself first)
            if pre._ready_bytes or not pre._ok:
                break
            threading.Event().wait(0.01)
        assert pre._ok, "madvise(MADV_POPULATE_WRITE) unavailable: nothing to check"
        assert os.sched_getscheduler(t.native_id) == os.SCHED_BATCH
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) == before[0]
    finally:
        pool.close()
    assert _priorities() == before
