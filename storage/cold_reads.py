"""Pacing of cold reads (bytes served from objects) so catch-up readers cannot starve the tail.

Producers, tail consumers and catch-up consumers share one event loop (and, on a small machine,
the same cores). A catch-up reader asks for as much as it can get; every byte it is served costs
loop time (BlockCache, response building, the socket copy) that hot requests then wait behind.
``ColdReadPacer`` is a token bucket whose rate adapts to how late the event loop is: a probe task
sleeps a few milliseconds at a time and measures how much later than asked it wakes up. When the
mean lag over a window (100 ms) passes ``lag_target_s`` (hot work is queueing, or the machine is
short of CPU) the rate is cut multiplicatively; while the loop is on time it grows back
additively up to ``max_rate`` (AIMD, as TCP does with congestion). A mean over a window, not
single samples: one late wake-up is scheduler noise (timers fire up to ~1 ms late on an idle
loop), a late window is a busy loop. A floor (``min_rate``) keeps catch-up readers moving.

Loop lag alone misses most of what a catch-up reader costs the tail: no single cold step blocks
the loop for long, the cost is many short slices plus CPU and GIL taken from the threads that
complete hot requests, and uvloop's timers only resolve whole milliseconds. So the pacer also
treats cold reads as scavenger traffic (in the spirit of LEDBAT, RFC 6817): the engine reports
the latency of every hot append (append -> durable, seen on the loop); per span of windows with
enough samples, the 90th percentile is compared with a baseline, the median p90 of recent spans
during which no cold byte was served. A span with cold reads whose p90 passes the baseline by
``hot_tolerance`` is a late window, like a lagging loop. While a reader keeps reading, the pacer
pauses cold reads for one short span now and then (``CLEAN_EVERY_S``) so that the baseline
follows the hot load instead of going stale. With no hot traffic there is no signal and catch-up
runs at the cap.

Bulk answers wait for the WAL (``hold_bulk``). A catch-up consumer's answers are written in
256 KiB slices, one per loop turn (broker/server.py), ~0.4-0.5 ms of consecutive loop turns
per 1 MiB answer. A hot append whose WAL write was in flight meanwhile became durable only
after the last slice (session 28: in the catch-up bench 81 % of the appends that took 0.5-1 ms
overlapped such slices, against 0 % of those under 0.3 ms; the append -> durable p99 rose
0.35 -> 0.80 ms while the catch-up reader ran, and the client produce p99 with it; reads of the
same bytes from the same disk by another process, with no answers to write, moved neither).
So a slice is not written while a hot append waits for its WAL write: the engine counts
appends in flight (``note_append`` / ``note_hot``), and a slice asked for meanwhile runs once
they are durable and HOLD_GAP_S more have passed, or after HOLD_MAX_S at the most. The gap:
released at once (after the acknowledgements were queued), the slices delayed the delivery of
those acknowledgements instead (ack written -> the producer's callback p99 0.24 -> 0.61 ms
with the reader); with a 0.25 ms gap 0.27 -> 0.30 ms.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


class ColdReadPacer:
    """Adaptive token bucket for cold-read bytes; the rate follows the event loop's lag."""

    DECREASE = 0.5            # rate multiplier when the loop is late
    WINDOW_S = 0.1            # lag samples are averaged over this long; one decision each
    RAMP_S = 2.0              # time to grow from 0 to max_rate while the loop is on time
    BURST_S = 0.05            # bytes the bucket may run ahead, in seconds of the current rate
    HOT_MIN_SAMPLES = 10      # hot latencies a span needs before its p90 means anything
    HOT_SLACK_S = 0.00003     # absolute slack on top of the tolerance (microsecond jitter)
    BASE_SPANS = 15           # the baseline is the median p90 of this many recent clean spans
    CLEAN_EVERY_S = 1.0       # while cold reads go on, pause them this often for a clean span
    PAUSE_S = 0.15            # ... for this long at the most
    HOT_ACTIVE_S = 1.0        # appends this recent mean producers are active
    RATE_WINDOW_S = 1.0       # the append rate is measured over windows this long
    IDLE_PROBE_S = 0.05       # probe interval while no paced cold read ran for COLD_RECENT_S
    COLD_RECENT_S = 1.0
    HOLD_MAX_S = 0.002        # longest a bulk write waits for hot appends (hold_bulk)
    HOLD_GAP_S = 0.00025      # ... and waits this long after the last of them was durable

    def __init__(self, max_rate: float, min_rate: float = 0.0, lag_target_s: float = 0.0,
                 probe_interval_s: float = 0.005,
                 clock: Callable[[], float] = time.monotonic,
                 hot_tolerance: float = 0.0) -> None:
        self.max_rate = float(max_rate)            # 0 = unlimited (no pacing at all)
        self.min_rate = float(min(min_rate, max_rate)) if max_rate > 0 else 0.0
        self.lag_target_s = lag_target_s           # 0 = fixed rate (no adaptation)
        self.hot_tolerance = hot_tolerance         # 0 = hot latencies are not a signal
        # samples are kept only while the probe task that consumes them runs (max_rate > 0)
        self._hot_on = self.max_rate > 0 and hot_tolerance > 0
        self._hot: list[float] = []                # hot latencies of the current span
        self._span_cold = False                    # cold bytes were served during the span
        self._clean: collections.deque[float] = collections.deque(maxlen=self.BASE_SPANS)
        self._last_clean = clock()
        self._pause_until = 0.0
        self.hot_p90_s = 0.0                       # the latest span's p90 (for logs, tests)
        self.pauses = 0
        self.probe_interval_s = probe_interval_s
        self.rate = self.max_rate
        self._clock = clock
        self._debt = 0.0
        self._debt_at = clock()
        self._window_start = clock()
        self._window_sum = 0.0
        self._window_n = 0
        self._task: asyncio.Task | None = None
        self._quiet = False                        # the probe waits for _kick (nothing runs)
        self._kick: asyncio.Event | None = None
        self.lag_s = 0.0                           # the latest lag sample
        self.window_lag_s = 0.0                    # the latest window's mean lag
        self.cuts = 0
        self.bytes = 0                             # cold bytes served (paced or not)
        self.paced_bytes = 0                       # ... of which through the bucket
        self._hot_at = float("-inf")               # last hot append (clock)
        self._cold_at = float("-inf")              # last paced cold read (clock)
        self.hot_rate = 0.0                        # append bytes/s over the last window
        self._rate_bytes = 0
        self._rate_start = clock()
        self.appends_in_flight = 0                 # hot appends not yet durable (hold_bulk)
        self._held: list[Callable[[], None]] = []  # bulk writes waiting for them
        self._hold_timer: asyncio.TimerHandle | None = None
        self._durable_at = float("-inf")           # perf_counter of the last hot durability
        self._gap: Any = None                      # TimerFD for the gap (sub-millisecond)
        self.holds = 0                             # bulk writes held (for tests, logs)

    @property
    def adaptive(self) -> bool:
        return self.max_rate > 0 and (self.lag_target_s > 0 or self.hot_tolerance > 0)

    @property
    def baseline_s(self) -> float | None:
        """Median hot p90 of recent spans without cold reads; None before the first."""
        return statistics.median(self._clean) if self._clean else None

    def note_append(self) -> None:
        """A hot append was handed to the WAL (``note_hot`` follows once it is durable):
        bulk writes wait for it (``hold_bulk``)."""
        if self.max_rate > 0:
            self.appends_in_flight += 1

    def note_hot(self, latency_s: float, nbytes: int = 0) -> None:
        """One hot request's latency (the engine: append -> durable, seen on the loop) and its
        size: the append rate is the floor of paced catch-up reads from the LogCache."""
        if self.appends_in_flight > 0:
            self.appends_in_flight -= 1
            self._durable_at = time.perf_counter()
            if not self.appends_in_flight and self._held:
                # the acknowledgements go out first, and their clients get HOLD_GAP_S to take
                # them before the next bulk write
                self._arm_gap()
        if self._hot_on:
            self._hot.append(latency_s)
        if self.max_rate > 0:
            if self._quiet:             # the probe sleeps until there is something to measure
                self._wake_probe()
            now = self._clock()
            self._hot_at = now
            self._rate_bytes += nbytes
            elapsed = now - self._rate_start
            if elapsed >= self.RATE_WINDOW_S:
                self.hot_rate = self._rate_bytes / elapsed
                self._rate_bytes = 0
                self._rate_start = now

    def hold_bulk(self, resume: Callable[[], None]) -> bool:
        """Whether a bulk write (a slice of a large answer, on the loop) should wait now
        because hot appends are in flight or the last of them became durable less than
        HOLD_GAP_S ago; if so ``resume()`` is called on the loop HOLD_GAP_S after they are
        durable, or after HOLD_MAX_S (a slow device must not stall catch-up readers). A
        write resumed so goes out without asking again (the caller's part). Only while
        paced catch-up reads ran within COLD_RECENT_S: a hot consumer's large answers beside
        busy producers (appends always in flight) would otherwise wait HOLD_MAX_S per slice."""
        if not self.hot_active() or not self.catching_up() \
                or (not self.appends_in_flight
                    and time.perf_counter() - self._durable_at >= self.HOLD_GAP_S):
            return False
        if not self.appends_in_flight:
            self._arm_gap()
        self._held.append(resume)
        self.holds += 1
        if self._hold_timer is None:
            self._hold_timer = asyncio.get_running_loop().call_later(self.HOLD_MAX_S,
                                                                     self._release)
        return True

    def _arm_gap(self) -> None:
        """Release the held writes HOLD_GAP_S after the last durability (a timerfd: uvloop's
        timers fire in whole milliseconds); without one, on the next turn."""
        loop = asyncio.get_running_loop()
        if self._gap is None:
            try:
                from .wal.aio import TimerFD
                self._gap = TimerFD()
                loop.add_reader(self._gap.fd, self._gap_fired)
            except Exception:  # noqa: BLE001 - no timerfd here: no gap
                self._gap = False
        if self._gap is False:
            loop.call_soon(self._release)
            return
        self._gap.arm(time.monotonic() + self.HOLD_GAP_S)

    def _gap_fired(self) -> None:
        self._gap.consume()
        if not self.appends_in_flight:
            self._release()

    def _release(self) -> None:
        """Resume every held bulk write (in the order they were held)."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        held, self._held = self._held, []
        for resume in held:
            resume()

    def catching_up(self) -> bool:
        """Paced catch-up reads were served within the last COLD_RECENT_S."""
        return self._clock() - self._cold_at < self.COLD_RECENT_S

    def hot_active(self) -> bool:
        """Hot appends happened within the last HOT_ACTIVE_S (something to protect)."""
        return self.max_rate > 0 and self._clock() - self._hot_at < self.HOT_ACTIVE_S

    def _hot_late(self, now: float) -> bool:
        """Close the hot span when it holds enough samples; True when cold reads ran during
        it and its p90 passed the clean baseline by more than the tolerance."""
        hot = self._hot
        if len(hot) < self.HOT_MIN_SAMPLES:
            return False
        hot.sort()
        p90 = hot[(len(hot) * 9) // 10]
        self.hot_p90_s = p90
        cold = self._span_cold
        self._hot = []
        self._span_cold = False
        if not cold:
            self._clean.append(p90)
            self._last_clean = now
            return False
        base = self.baseline_s
        late = base is not None and p90 > base * (1 + self.hot_tolerance) + self.HOT_SLACK_S
        if now - self._last_clean >= self.CLEAN_EVERY_S and now >= self._pause_until:
            # a clean span now and then keeps the baseline current (the hot load changes)
            self._pause_until = now + self.PAUSE_S
            self._last_clean = now
            self.pauses += 1
        return late

    # -- rate control -----------------------------------------------------------------------
    def note_lag(self, lag_s: float) -> None:
        """Feed one lag sample; once per window, cut the rate if the window's mean lag passed
        the target, else let it grow by the window's share of the ramp."""
        self.lag_s = lag_s
        if not self.adaptive:
            return
        self._window_sum += lag_s
        self._window_n += 1
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < self.WINDOW_S:
            return
        mean = self._window_sum / self._window_n
        self._window_start = now
        self._window_sum = 0.0
        self._window_n = 0
        self.window_lag_s = mean
        hot_late = self._hot_late(now)
        # without appends within HOT_ACTIVE_S nothing is paced (docs/storage.md): a late loop
        # then has nothing to protect, and cutting the rate only left a catch-up reader at
        # the floor once producers came back (a CPU-starved machine's idle broker logged
        # 312 cuts a minute, FINDINGS lead 22:40)
        if ((self.lag_target_s > 0 and mean > self.lag_target_s) or hot_late) \
                and now - self._hot_at < self.HOT_ACTIVE_S:
            self.cuts += 1
            self.rate = max(self.min_rate, self.rate * self.DECREASE)
        else:
            self.rate = min(self.max_rate, self.rate + self.max_rate * elapsed / self.RAMP_S)

    def delay_for(self, nbytes: int, min_rate: float = 0.0) -> float:
        """Account ``nbytes`` served; seconds the reader should wait to stay under the rate
        (or under ``min_rate``, when that is higher)."""
        self.bytes += nbytes
        if self.max_rate <= 0:
            return 0.0
        self.paced_bytes += nbytes
        now = self._clock()
        if nbytes:
            self._span_cold = True
            self._cold_at = now
            if self._quiet:
                self._wake_probe()
        rate = max(self.rate, min_rate, 1.0)
        self._debt = max(0.0, self._debt - (now - self._debt_at) * rate) + nbytes
        self._debt_at = now
        return max(0.0, (self._debt - rate * self.BURST_S) / rate, self._pause_until - now)

    async def pace(self, nbytes: int, min_rate: float = 0.0) -> None:
        """Wait (this reader only) until ``nbytes`` fit under the current rate."""
        wait = self.delay_for(nbytes, min_rate)
        if wait > 0:
            await asyncio.sleep(wait)

    async def admit(self) -> None:
        """Wait out a pause (a clean span for the baseline) before serving cold bytes."""
        if self._pause_until:
            wait = self._pause_until - self._clock()
            if wait > 0:
                await asyncio.sleep(wait)

    # -- lag probe --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the lag probe on the running loop (only when adapting)."""
        if self.adaptive and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._probe(),
                                                                name="s3kafka-cold-pacer")

    async def stop(self) -> None:
        if self._gap:
            asyncio.get_running_loop().remove_reader(self._gap.fd)
            self._gap.close()
            self._gap = None
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def probe_interval(self) -> float | None:
        """The lag probe's next sleep: fast while paced cold reads ran within COLD_RECENT_S;
        IDLE_PROBE_S while producers append (windows close, hot spans feed the baseline);
        None when neither: lag is no signal then (nothing is paced), the probe sleeps until
        an append or a paced read wakes it."""
        if self.catching_up():
            return self.probe_interval_s
        if self._clock() - self._hot_at < self.HOT_ACTIVE_S:
            return max(self.probe_interval_s, self.IDLE_PROBE_S)
        return None

    def _wake_probe(self) -> None:
        self._quiet = False
        if self._kick is not None:
            self._kick.set()

    async def _probe(self) -> None:
        """Lag samples every ``probe_interval_s`` while paced cold reads run (or ran within
        COLD_RECENT_S); every IDLE_PROBE_S while only producers append: 200 wake-ups a
        second of an idle broker were 2-4 % of its loop's samples under a hot Fetch load
        (FINDINGS, thruput 01:20). With neither, no wake-up at all: an append (note_hot) or
        a paced read wakes the probe, which starts a fresh window (an idle broker's probe
        woke 20 times a second for nothing, session 21)."""
        report_at = time.monotonic() + 60
        cuts = 0
        self._kick = asyncio.Event()
        while True:
            interval = self.probe_interval()
            if interval is None:
                self._kick.clear()
                self._quiet = True
                await self._kick.wait()
                self._quiet = False
                self._window_start = self._clock()
                self._window_sum = 0.0
                self._window_n = 0
                continue
            t0 = time.perf_counter()          # loop.time() is whole milliseconds under uvloop
            await asyncio.sleep(interval)
            self.note_lag(max(0.0, time.perf_counter() - t0 - interval))
            if time.monotonic() >= report_at:
                report_at += 60
                if self.cuts != cuts:
                    # totals since start: the paced share is what the rate applied to
                    log.info("cold reads paced: %d rate cuts in the last minute, rate now "
                             "%.1f MiB/s; since start %.0f MiB served, %.0f MiB of it paced",
                             self.cuts - cuts, self.rate / (1 << 20), self.bytes / (1 << 20),
                             self.paced_bytes / (1 << 20))
                    cuts = self.cuts
