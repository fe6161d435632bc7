"""The cyclic garbage collector, tuned for a broker whose long-lived objects die by refcount.

A produce request's payload stays in the LogCache until it is uploaded and evicted: a 1 GiB
cache of small batches holds about a million entries. A small payload is kept as an untracked
``bytes`` copy in an entry the collector does not track (storage/cache/log_cache.py): nothing
of it is ever scanned. A larger one (over ``SMALL_COPY``) stays a view of its request frame,
two tracked objects (the memoryview and its managed buffer). CPython's collector promotes young
survivors to generation 1 and 2 and rescans them there: a generation-1 collection went over
up to ~200,000 objects and a full one over everything, a stall of tens to hundreds of
milliseconds on the event loop every few thousand requests (bench/HISTORY.md, session 13).
Those objects never form reference cycles that only the collector could free: they are freed
by reference counting when the cache evicts them.

So each survivor is scanned once: after every collection the survivors are frozen
(``gc.freeze()``, moved to the permanent generation, never scanned again; an object frozen
there is still freed by its reference count). Young cyclic garbage is still collected by the
young collections. A cycle that lived through a collection and dies later is not collected
until the periodic full pass (``gc.unfreeze()`` and one full collection, every
``FULL_PASS_S``), which bounds what such rare cycles can hold.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

# young-generation threshold: a young collection runs once this many more tracked objects were
# allocated than freed since the last one (untracked cache entries count too) and scans the
# tracked ones still alive with the event loop stopped. At 20,000, with three tracked survivors
# per Produce request, the tenth-of-max latency row had a young collection every ~0.7 s of
# 2.2-7.4 ms; with nothing of small requests tracked, one every ~1.4 s of 1.3-1.7 ms (the
# requests in flight). 5,000 and 2,000 made the pauses shorter still but 5-30 times as many, and
# the row's p99 was no better for it (bench/HISTORY.md session 34 gc). A request allocates a few
# dozen containers: Python's default (700) ran one every few requests.
GEN0_THRESHOLD = 20_000
# everything frozen since is scanned again (and its dead cycles freed) this often
FULL_PASS_S = 600.0


class SurvivorFreezer:
    """Freezes what survives each collection; ``full_pass()`` (the broker calls it every
    ``FULL_PASS_S`` from its event loop) scans everything once."""

    def __init__(self) -> None:
        self._in_full = False
        self.full_passes = 0
        self.last_full_s = 0.0
        # collector pauses (every collection, the full pass included): count, total seconds,
        # longest since the last take_max (a /metrics scrape; bench.clients --trace)
        self.collections = 0
        self.pause_total = 0.0
        self.pause_max = 0.0
        self._started = 0.0

    def install(self) -> None:
        """Collect and freeze the start-up heap, then freeze survivors from now on."""
        gc.collect()
        gc.freeze()
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        """Stop freezing (broker stopped); the last freezer of the process unfreezes."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if not any(isinstance(getattr(cb, "__self__", None), SurvivorFreezer)
                   for cb in gc.callbacks):
            gc.unfreeze()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        # survivors of this collection are live now: never scan them again
        if not self._in_full:
            gc.freeze()
        took = time.perf_counter() - self._started
        self.collections += 1
        self.pause_total += took
        if took > self.pause_max:
            self.pause_max = took

    def take_max(self) -> float:
        """The longest collection since the previous call (seconds), and start again."""
        m, self.pause_max = self.pause_max, 0.0
        return m

    def full_pass(self) -> float:
        """Scan everything once, freeing cycles that died after being frozen; seconds taken
        (not from a collector callback: a collection cannot start inside one)."""
        t0 = time.perf_counter()
        self._in_full = True
        try:
            gc.unfreeze()
            gc.collect()
        finally:
            self._in_full = False
            gc.freeze()
        self.last_full_s = time.perf_counter() - t0
        self.full_passes += 1
        log.debug("gc full pass took %.1f ms", self.last_full_s * 1000)
        return self.last_full_s
