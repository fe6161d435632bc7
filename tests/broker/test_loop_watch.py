"""The broker's own stall gauges (broker/loop_watch.py, broker/gc_tuning.py): a loop step that
blocks shows up as the loop watch's lateness, a collection as a collector pause; both maxima
start again after each read (one /metrics scrape per latency window in bench.clients)."""
from __future__ import annotations

import asyncio
import functools
import gc
import time
from types import SimpleNamespace

from broker.gc_tuning import SurvivorFreezer
from broker.loop_watch import IDLE_INTERVAL_S, INTERVAL_S, STALL_S, LoopWatch
from broker.metrics import RequestStats
from broker.server import Broker


async def test_a_blocked_loop_step_is_seen_as_lateness_and_a_stall() -> None:
    watch = LoopWatch(asyncio.get_running_loop())
    watch.start()
    try:
        await asyncio.sleep(0.02)
        watch.take_max()
        stalls = watch.stalls
        time.sleep(0.03)                  # one loop step blocked for 30 ms
        await asyncio.sleep(0.02)
        assert watch.take_max() >= 0.02
        assert watch.stalls >= stalls + 1 and STALL_S <= 0.02
        assert watch.lag_total >= 0.02
    finally:
        watch.stop()


async def test_the_timer_fires_seldom_while_no_client_is_connected() -> None:
    """With no client connected no request can wait behind a stall: the timer fires every
    IDLE_INTERVAL_S (its 200 wake-ups a second were most of an idle broker's CPU, session
    21); a connection brings the 5 ms timer back at the next tick."""
    loop = asyncio.get_running_loop()
    connected = [False]
    watch = LoopWatch(loop, lambda: connected[0])
    watch.start()
    try:
        watch._tick()                     # a tick: the next one is scheduled from it
        assert watch._handle.when() - loop.time() > IDLE_INTERVAL_S - 0.01
        connected[0] = True
        watch._tick()
        assert watch._handle.when() - loop.time() <= INTERVAL_S + 0.001
    finally:
        watch.stop()


async def test_connected_clients_that_send_nothing_let_the_timer_fire_seldom() -> None:
    """The broker's watch is active only while requests are answered: every client keeps its
    connections open, and an idle consumer or producer kept 200 wake-ups a second going while
    no request could wait behind a stall. The 5 ms timer comes back at the tick after an
    answer, and goes once a whole interval passes without one."""
    loop = asyncio.get_running_loop()
    broker = SimpleNamespace(request_stats=RequestStats(), _watch_seen=0)
    watch = LoopWatch(loop, functools.partial(Broker._requests_flowing, broker))
    watch.start()
    try:
        watch._tick()                                  # connected, nothing answered
        assert watch._handle.when() - loop.time() > IDLE_INTERVAL_S - 0.01
        broker.request_stats.observe(18, 3, 0.0, 0.0)  # one ApiVersions answered
        watch._tick()
        assert watch._handle.when() - loop.time() <= INTERVAL_S + 0.001
        broker.request_stats.observe(0, 9, 0.0, 0.0)
        watch._tick()                                  # still flowing
        assert watch._handle.when() - loop.time() <= INTERVAL_S + 0.001
        watch._tick()                                  # a whole interval without an answer
        assert watch._handle.when() - loop.time() > IDLE_INTERVAL_S - 0.01
    finally:
        watch.stop()


def test_collections_are_timed_and_the_maximum_restarts_on_read() -> None:
    freezer = SurvivorFreezer()
    freezer.install()
    try:
        before = freezer.collections
        gc.collect()
        assert freezer.collections == before + 1
        assert freezer.pause_total > 0
        assert freezer.take_max() > 0
        assert freezer.take_max() == 0.0
    finally:
        freezer.uninstall()
