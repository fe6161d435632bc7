"""bench.catchup's run-queue figures per window: a window's wait is the difference of two
samples, so the samples must only grow even when threads of the sampled process exit (a
client's librdkafka threads before the last window ends: make bench printed
"producer -44.2 (-2651954)" ms/s of run-queue wait)."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest

from bench.catchup import RunQueue


def _spin_threads(ready, stop_threads, threads_gone, stop) -> None:
    """A child process with 4 busy threads that exit on ``stop_threads``."""
    quit_ = threading.Event()

    def spin() -> None:
        while not quit_.is_set():
            sum(range(1000))
            time.sleep(0)
    ts = [threading.Thread(target=spin) for _ in range(4)]
    for t in ts:
        t.start()
    ready.set()
    stop_threads.wait(60)
    quit_.set()
    for t in ts:
        t.join()
    threads_gone.set()
    stop.wait(60)


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"),
                    reason="no per-thread schedstat")
def test_threads_that_exit_keep_their_waits() -> None:
    ctx = mp.get_context("fork")
    ready, stop_threads, gone, stop = (ctx.Event() for _ in range(4))
    child = ctx.Process(target=_spin_threads, args=(ready, stop_threads, gone, stop))
    child.start()
    hogs = [ctx.Process(target=_busy, args=(1.0,)) for _ in range(os.cpu_count() or 1)]
    try:
        assert ready.wait(30)
        rq = RunQueue(child.pid)
        for h in hogs:                       # more runnable threads than cores: they wait
            h.start()
        for h in hogs:
            h.join(30)
        first = rq.sample()
        threads_wait = first[1] - first[0]
        assert first[3] > first[2]           # the spinning threads were scheduled in
        stop_threads.set()
        assert gone.wait(30)
        # Thread.join returns when Python is done with a thread; the kernel task ends a
        # moment later, so wait for /proc to show the main thread alone
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{child.pid}/task")) > 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(os.listdir(f"/proc/{child.pid}/task")) == 1
        second = rq.sample()
        assert second[1] >= first[1] and second[3] >= first[3]
        # (seconds summed from nanoseconds as floats: equal sums may differ in the last bit;
        # without the fix the threads' whole wait, ~1 s here, went missing)
        assert second[1] - second[0] >= threads_wait - 1e-6
        stop.set()
        child.join(30)                       # reaped: nothing left under /proc/<pid>
        third = rq.sample()
        assert third[1] >= second[1] and third[3] >= second[3]
    finally:
        stop_threads.set()
        stop.set()
        child.join(30)
        for h in hogs:
            if h.is_alive():
                h.terminate()
