"""The broker's own stall gauges (broker/loop_watch.py, broker/gc_tuning.py): a loop step that
blocks shows up as the loop watch's lateness, a collection as a collector pause; both maxima
start again after each read (one /metrics scrape per latency window in bench.clients)."""
from __future__ import annotations

import asyncio
import gc
import time

from broker.gc_tuning import SurvivorFreezer
from broker.loop_watch import STALL_S, LoopWatch


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
