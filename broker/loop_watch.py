"""How late the event loop runs a timer: the broker's own view of loop stalls.

A request that waits behind a long loop step (a young collection, an upload's encode slice, a
big socket write, the interpreter lock held by another thread) is late by that much. A timer
every ``INTERVAL_S`` that notes how late it fired measures exactly that wait, whatever caused
it, at one callback per interval (~200/s: negligible beside thousands of requests). The
maxima are read *and reset* by each /metrics scrape (``take_max``): the benchmark's latency
trace scrapes every 0.25 s and lines the loop's worst lateness up with its latency windows
(bench/clients.py ``--trace``).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

INTERVAL_S = 0.005
STALL_S = 0.005        # a timer at least this late counts as a stall
# while no request is answered no request can wait behind a stall: the timer fires this often
# (its 200 wake-ups a second were ~12 of an idle broker's ~20 ms of CPU a second, session 21)
IDLE_INTERVAL_S = 0.25


class LoopWatch:
    """A repeating timer on ``loop``: lateness maximum (since the last ``take_max``), stalls
    and total lateness."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 active: Callable[[], bool] | None = None) -> None:
        """``active()``: whether a request could be waiting (the broker: one was answered since
        the last tick); while it is False the timer fires every IDLE_INTERVAL_S instead of
        INTERVAL_S (a client's first requests after a quiet spell may then miss up to that
        long of stall measurement)."""
        self._loop = loop
        self._active = active
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self.max_lag = 0.0
        self.stalls = 0
        self.lag_total = 0.0

    def start(self) -> None:
        self._due = time.perf_counter() + INTERVAL_S
        self._handle = self._loop.call_later(INTERVAL_S, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        now = time.perf_counter()
        lag = now - self._due
        if lag > 0:
            self.lag_total += lag
            if lag > self.max_lag:
                self.max_lag = lag
            if lag >= STALL_S:
                self.stalls += 1
        interval = INTERVAL_S if self._active is None or self._active() else IDLE_INTERVAL_S
        self._due = now + interval
        self._handle = self._loop.call_later(interval, self._tick)

    def take_max(self) -> float:
        """The worst lateness since the previous call (seconds), and start again."""
        m, self.max_lag = self.max_lag, 0.0
        return m
