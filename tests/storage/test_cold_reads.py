"""ColdReadPacer: the adaptive cold-read rate (AIMD on event-loop lag), with a fake clock."""
from __future__ import annotations

import asyncio
import time

import pytest

from storage.cold_reads import ColdReadPacer

MiB = 1 << 20


def count_lag_samples(p: ColdReadPacer) -> list[int]:
    """Count the probe's lag samples: the returned one-item list counts its note_lag calls."""
    samples = [0]
    real = p.note_lag

    def count(lag: float) -> None:
        samples[0] += 1
        real(lag)
    p.note_lag = count  # type: ignore[method-assign]
    return samples


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def feed(p: ColdReadPacer, clock: Clock, lag: float, seconds: float, step: float = 0.005,
         hot: bool = True) -> None:
    """Lag samples every ``step`` for ``seconds`` (what the probe task does on a real loop),
    with a producer appending meanwhile (``hot``: lag is a signal only then)."""
    for _ in range(round(seconds / step)):
        clock.t += step
        if hot:
            p.note_hot(0.0002, 1000)
        p.note_lag(lag)


def test_late_loop_cuts_rate_to_floor_and_on_time_loop_ramps_back() -> None:
    clock = Clock()
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, clock=clock)
    assert p.rate == 64 * MiB
    feed(p, clock, 0.004, 0.11)                      # one late window: halved
    assert p.rate == 32 * MiB and p.cuts == 1
    feed(p, clock, 0.004, 1.0)                       # stays late: down to the floor, not below
    assert p.rate == 16 * MiB
    feed(p, clock, 0.0002, 0.5)                      # on time again: grows additively ...
    assert 16 * MiB < p.rate < 64 * MiB
    feed(p, clock, 0.0002, 3.0)                      # ... up to the cap, not beyond
    assert p.rate == 64 * MiB


def test_single_late_sample_is_noise_not_a_signal() -> None:
    clock = Clock()
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, clock=clock)
    for _ in range(20):                              # one 3 ms hiccup in each 100 ms window
        p.note_lag(0.003)
        feed(p, clock, 0.0001, 0.1)
    assert p.cuts == 0 and p.rate == 64 * MiB


def test_fixed_rate_and_unlimited_modes() -> None:
    clock = Clock()
    fixed = ColdReadPacer(10 * MiB, 1 * MiB, lag_target_s=0.0, clock=clock)
    feed(fixed, clock, 0.5, 1.0)
    assert not fixed.adaptive and fixed.rate == 10 * MiB
    off = ColdReadPacer(0, 0, lag_target_s=0.001, clock=clock)
    assert not off.adaptive and off.delay_for(1 << 30) == 0


def test_delay_keeps_bytes_under_the_rate() -> None:
    clock = Clock()
    p = ColdReadPacer(10 * MiB, 10 * MiB, lag_target_s=0.0, clock=clock)
    burst = int(10 * MiB * ColdReadPacer.BURST_S)
    assert p.delay_for(burst) == 0                   # a short burst passes
    wait = p.delay_for(5 * MiB)
    assert abs(wait - 0.5) < 1e-6                    # 5 MiB more at 10 MiB/s
    clock.t += wait                                  # the reader slept it off
    assert p.delay_for(0) <= 1e-6
    clock.t += 10.0                                  # idle time does not bank credit
    assert p.delay_for(burst) == 0 and p.delay_for(MiB) > 0


async def test_probe_runs_on_the_loop_and_stops() -> None:
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, probe_interval_s=0.001)
    p.start()
    loop_blocked = asyncio.Event()

    async def hog() -> None:                         # a loop that is late on every wake-up
        for _ in range(300):
            p.note_hot(0.0002, 1000)                 # ... while a producer appends
            await asyncio.sleep(0)
            t = time.perf_counter()
            while time.perf_counter() - t < 0.003:
                sum(range(1000))
        loop_blocked.set()
    await hog()
    await p.stop()
    assert loop_blocked.is_set()
    assert p.cuts >= 1 and p.rate < 64 * MiB


def run_spans(p: ColdReadPacer, clock: Clock, hot: float, seconds: float, cold: int = 0,
              step: float = 0.005) -> float:
    """Every ``step``: one hot request of latency ``hot``, ``cold`` bytes served by a catch-up
    reader (unless the pacer asks it to wait), an on-time lag sample. Returns the smallest
    rate seen."""
    lowest = p.rate
    for _ in range(round(seconds / step)):
        clock.t += step
        p.note_hot(hot)
        if cold and p.delay_for(0) == 0:
            p.delay_for(cold)
        p.note_lag(0.0)
        lowest = min(lowest, p.rate)
    return lowest


def test_hot_latency_rise_during_cold_reads_cuts_the_rate_and_recovers() -> None:
    clock = Clock()
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, clock=clock, hot_tolerance=0.1)
    run_spans(p, clock, 0.0002, 1.0)                 # no cold reads: the baseline is learnt
    assert p.baseline_s == 0.0002 and p.rate == 64 * MiB and p.cuts == 0
    lowest = run_spans(p, clock, 0.0003, 0.5, cold=64 << 10)   # +50 % while catch-up reads
    assert p.cuts >= 2 and lowest == 16 * MiB
    run_spans(p, clock, 0.0002, 3.0, cold=64 << 10)  # the hot path is back to its baseline
    assert p.rate == 64 * MiB


def test_hot_latency_within_tolerance_or_without_cold_reads_is_no_signal() -> None:
    clock = Clock()
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, clock=clock, hot_tolerance=0.1)
    run_spans(p, clock, 0.0002, 1.0)
    run_spans(p, clock, 0.000215, 1.0, cold=64 << 10)   # +7.5 %: under the tolerance
    assert p.cuts == 0 and p.rate == 64 * MiB
    run_spans(p, clock, 0.0009, 1.0)                 # slower hot path, no cold reads: the
    assert p.cuts == 0                               # baseline follows, nothing is cut
    assert p.baseline_s == 0.0009


def test_tolerance_off_ignores_hot_latency() -> None:
    clock = Clock()
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, clock=clock)
    run_spans(p, clock, 0.0002, 1.0)
    run_spans(p, clock, 0.005, 1.0, cold=64 << 10)
    assert p.cuts == 0 and p.baseline_s is None


def test_hot_samples_are_not_kept_when_nothing_consumes_them() -> None:
    """Every durable append reports its latency: with pacing off (unlimited cold reads, no
    probe task) or the hot signal off, nothing may pile up on that hot path."""
    for p in (ColdReadPacer(0, 0, lag_target_s=0.001, hot_tolerance=0.05),
              ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001)):
        for _ in range(10_000):
            p.note_hot(0.0002)
        assert len(p._hot) == 0


async def test_continuous_cold_reads_pause_for_a_clean_span_now_and_then() -> None:
    """A reader that never stops would leave the baseline stale: the pacer pauses cold reads
    for a short span about once a second, and that span becomes a baseline sample."""
    clock = Clock()
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, clock=clock, hot_tolerance=0.1)
    run_spans(p, clock, 0.0002, 1.0)
    clean_before = len(p._clean)
    run_spans(p, clock, 0.0002, 3.0, cold=16 << 10)
    assert p.pauses >= 2
    assert len(p._clean) > clean_before              # spans during pauses were clean
    run_spans(p, clock, 0.0002, ColdReadPacer.CLEAN_EVERY_S, cold=16 << 10)
    while p._pause_until <= clock.t:                 # reach the next pause
        run_spans(p, clock, 0.0002, 0.005, cold=16 << 10)
    assert p.delay_for(0) > 0                        # readers wait it out ...
    real = ColdReadPacer(64 * MiB, 16 * MiB, hot_tolerance=0.1)
    real._pause_until = time.monotonic() + 0.05
    t0 = time.monotonic()
    await real.admit()                               # ... also before reading
    assert time.monotonic() - t0 >= 0.04


def test_append_rate_and_hot_activity_set_a_floor_for_catch_up() -> None:
    """note_hot measures the append rate (per RATE_WINDOW_S) and when producers were last
    active; a caller may ask for at least some rate (the LogCache catch-up floor)."""
    clock = Clock()
    p = ColdReadPacer(1 * MiB, 1 * MiB, lag_target_s=0.0, clock=clock)
    assert not p.hot_active() and p.hot_rate == 0.0
    for _ in range(100):                           # 10 MiB appended over 1 s
        clock.t += 0.01
        p.note_hot(0.0005, MiB // 10)
    assert p.hot_active()
    assert p.hot_rate == pytest.approx(10 * MiB, rel=0.02)
    slow = p.delay_for(4 * MiB)                    # under the 1 MiB/s cap
    fast = p.delay_for(4 * MiB, min_rate=1.5 * p.hot_rate)
    assert slow > 3.0 and fast < slow / 5
    clock.t += p.HOT_ACTIVE_S + 0.01
    assert not p.hot_active()
    off = ColdReadPacer(0, 0, clock=clock)          # pacing off: never "active"
    off.note_hot(0.001, 1000)
    assert not off.hot_active()


async def test_probe_samples_fast_only_while_paced_cold_reads_run() -> None:
    """The lag probe wakes every probe_interval_s only while paced cold reads run (within the
    last second); otherwise every IDLE_PROBE_S (an idle broker's loop woke 200 times a second
    for nothing). The intervals are read from the pacer on a fake clock (counting wake-ups
    over 0.5 s of a loaded machine's loop failed at load > 10); the live probe still has to
    take its samples."""
    clock = Clock()
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, probe_interval_s=0.005,
                      clock=clock)
    assert p.probe_interval() is None               # nothing runs: no sampling at all
    p.note_hot(0.0002, 1000)                        # a producer appends
    assert p.probe_interval() == p.IDLE_PROBE_S
    p.delay_for(256 << 10)                          # a paced cold read
    assert p.probe_interval() == 0.005
    clock.t += p.COLD_RECENT_S - 0.01
    assert p.probe_interval() == 0.005
    clock.t += 0.02
    assert p.probe_interval() is None               # both over (HOT_ACTIVE_S == COLD_RECENT_S)
    p.note_hot(0.0002, 1000)
    assert p.probe_interval() == p.IDLE_PROBE_S
    p.delay_for(256 << 10)
    samples = count_lag_samples(p)
    p.start()
    try:
        for _ in range(200):                        # a few probe rounds, however slow the loop
            await asyncio.sleep(0.005)
            if samples[0] >= 3:
                break
    finally:
        await p.stop()
    assert samples[0] >= 3


def test_a_late_loop_without_appends_cuts_nothing() -> None:
    """With no append within HOT_ACTIVE_S nothing is paced (docs/storage.md), so loop lag is
    no signal: a CPU-starved machine's broker with only a catch-up reader cut the rate 312
    times a minute (FINDINGS lead 22:40), leaving the rate at the floor for when producers
    came back. Once a producer appends, a late loop cuts again."""
    clock = Clock()
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, clock=clock, hot_tolerance=0.05)
    feed(p, clock, 0.010, 5.0, hot=False)            # 10 ms late, every window
    assert p.cuts == 0 and p.rate == 64 * MiB
    p.delay_for(4 * MiB)                             # an unpaced read's bytes are no debt...
    feed(p, clock, 0.010, 0.11, hot=True)            # ... and a producer arrives: cut
    assert p.cuts == 1 and p.rate == 32 * MiB
    clock.t += ColdReadPacer.HOT_ACTIVE_S            # producers gone: it grows back
    feed(p, clock, 0.010, ColdReadPacer.RAMP_S, hot=False)
    assert p.cuts == 1 and p.rate == 64 * MiB


@pytest.mark.parametrize("late_s", [0.0, 0.004, 0.03])
def test_paced_reads_get_at_least_the_floor_on_a_late_loop(late_s: float) -> None:
    """A catch-up reader paced at the floor (the loop is late in every window, producers
    append) still gets the floor: every sleep the pacer asks for ends ``late_s`` late (a
    starved loop) and each 256 KiB read costs 2 ms; what the bucket lets through over 20 s,
    counted on a fake clock, is at least the floor (the token bucket credits the late
    wake-ups up to BURST_S). The 22:40 log's '8 MiB served' over two minutes was the total
    of an unpaced read, not a paced rate."""
    clock = Clock()
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, clock=clock)
    feed(p, clock, 0.004, 1.0)                       # late windows: the rate is at the floor
    assert p.rate == 16 * MiB
    start, served, next_probe = clock.t, 0, clock.t
    while clock.t - start < 20.0:
        clock.t += 0.002                             # the read itself
        served += 256 << 10
        wait = p.delay_for(256 << 10)
        clock.t += (wait + late_s) if wait > 0 else 0.0
        while next_probe <= clock.t:                 # the probe's samples meanwhile: late
            p.note_hot(0.0002, 1000)
            p.note_lag(0.004)
            next_probe += 0.005
    assert p.rate == 16 * MiB
    assert served / (clock.t - start) >= 16 * MiB * 0.99


async def test_an_idle_probe_sleeps_until_an_append_wakes_it() -> None:
    """With no append and no paced read within the last second there is nothing to measure
    (loop lag is no signal then): the probe takes no sample at all until an append (or a
    paced read) wakes it; it woke 20 times a second on an idle broker before (session 21)."""
    p = ColdReadPacer(64 * MiB, 16 * MiB, lag_target_s=0.001, probe_interval_s=0.005)
    samples = count_lag_samples(p)
    p.start()
    try:
        for _ in range(30):                          # the probe runs and goes to sleep ...
            await asyncio.sleep(0.01)
        assert getattr(p, "_quiet", False) and samples[0] == 0   # ... without a sample
        p.note_hot(0.0002, 1000)                     # a producer appends: sampling again
        for _ in range(400):
            await asyncio.sleep(0.005)
            if samples[0] >= 3:
                break
        assert samples[0] >= 3
    finally:
        await p.stop()


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_bulk_writes_wait_for_hot_appends_in_flight() -> None:
    """A slice of a large answer asked for while a hot append waits for its WAL write goes
    out once that append is durable and HOLD_GAP_S more have passed, after the acknowledgement
    the completion queued (the catch-up bench's slow appends were those whose completion came
    after a whole answer's slices; released at once, the slices delayed the acknowledgements'
    delivery instead; session 28)."""
    p = ColdReadPacer(64 * MiB, 16 * MiB)
    # the hold's 2 ms bound is the next test's subject; here a preempted worker (2 ms between
    # the holds and the checks below) would release them early (test_write_slices' twin)
    p.HOLD_MAX_S = 60.0
    p.note_hot(0.0002, 1000)                  # producers are active
    p.delay_for(256 << 10)                    # ... and a catch-up reader
    resumed: list[str] = []
    done = asyncio.Event()
    assert not p.hold_bulk(lambda: resumed.append("early"))   # nothing in flight: no wait
    p.note_append()
    p.note_append()
    assert p.hold_bulk(lambda: resumed.append("a"))
    assert p.hold_bulk(lambda: (resumed.append("b"), done.set()))
    await _turns(5)
    assert resumed == []                      # still in flight
    p.note_hot(0.0002, 1000)
    await _turns(5)
    assert resumed == []                      # one of the two is still in flight
    loop = asyncio.get_running_loop()
    p.note_hot(0.0002, 1000)
    loop.call_soon(resumed.append, "ack")     # queued by the completion after note_hot
    await asyncio.wait_for(done.wait(), 10)
    assert resumed == ["ack", "a", "b"] and p.holds == 2


async def test_held_bulk_write_goes_out_after_hold_max_without_a_completion() -> None:
    """A WAL write that does not complete (a slow device) holds bulk writes HOLD_MAX_S at
    most; and with no producer active nothing is held."""
    p = ColdReadPacer(64 * MiB, 16 * MiB)
    p.HOLD_MAX_S = 0.001
    p.note_hot(0.0002, 1000)
    p.delay_for(256 << 10)
    p.note_append()
    done = asyncio.Event()
    assert p.hold_bulk(done.set)
    await asyncio.wait_for(done.wait(), 10)
    idle = ColdReadPacer(64 * MiB, 16 * MiB)     # no append ever: nothing to protect
    idle.note_append()
    assert not idle.hold_bulk(done.set)
    off = ColdReadPacer(0)                     # unpaced: no counting, no holds
    off.note_hot(0.0002, 1000)
    off.note_append()
    assert not off.hold_bulk(done.set)


async def test_bulk_writes_wait_a_gap_after_the_last_durability() -> None:
    """Released at once after the last durability, a catch-up answer's slices delayed the
    delivery of the acknowledgements just queued (ack -> callback p99 0.24 -> 0.61 ms with the
    reader, session 28): held writes wait HOLD_GAP_S more, and a write asked for within the
    gap waits too."""
    p = ColdReadPacer(64 * MiB, 16 * MiB)
    p.HOLD_GAP_S = 60.0                       # the gap outlasts the test: HOLD_MAX_S ends it
    p.HOLD_MAX_S = 0.01
    p.note_hot(0.0002, 1000)
    p.delay_for(256 << 10)
    done = asyncio.Event()
    p.note_append()
    assert p.hold_bulk(done.set)
    p.note_hot(0.0002, 1000)                  # durable: the gap starts
    await _turns(10)
    assert not done.is_set()
    await asyncio.wait_for(done.wait(), 10)   # HOLD_MAX_S
    late = asyncio.Event()
    assert p.hold_bulk(late.set)              # still within the gap: held
    await asyncio.wait_for(late.wait(), 10)


async def test_no_hold_without_a_catch_up_reader() -> None:
    """Bulk writes are held only while paced catch-up reads run: a hot consumer's large
    answers beside producers whose appends are always in flight go out at once."""
    p = ColdReadPacer(64 * MiB, 16 * MiB)
    p.note_hot(0.0002, 1000)                  # producers are active, an append in flight
    p.note_append()
    assert not p.hold_bulk(lambda: None)      # no catch-up reader: nothing held
    p.delay_for(256 << 10)                    # a paced catch-up read
    assert p.hold_bulk(lambda: None)
    p._cold_at -= p.COLD_RECENT_S             # ... that was a while ago
    assert not p.hold_bulk(lambda: None)
