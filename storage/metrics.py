"""Storage metrics: plain counters the engine bumps on its hot path, read by a Prometheus
collector only when someone scrapes.

Nothing here registers itself or serves anything: the broker builds the registry and serves it
(storage never imports broker). Counters are plain ints and floats on the event loop thread
(no lock, no label lookup per append); only the object-store wrapper, called from the IO
threads, takes a lock, once per object-store call (milliseconds each). Gauges (cache sizes,
WAL fill, upload backlog) are read from the engine's own state at scrape time.
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from storage.episodes import Episode

# WAL appends: durable in ~0.1-2 ms on a good disk, up to seconds when the device stalls
WAL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
               0.5, 1.0, 2.5)
# object-store calls: local files in ~1 ms, S3 in 10-500 ms, retries beyond
STORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0)
STORE_OPS = ("put", "get", "get_ranges", "size", "delete", "list")


class Histogram:
    """A fixed-bucket histogram without locks or labels: ``observe`` is one C bisect and two
    additions. Exported cumulatively (Prometheus ``le`` buckets) by ``buckets()``."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # the last slot is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, n in zip(self.bounds, self.counts):
            acc += n
            out.append((repr(float(bound)), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


def histogram_family(name: str, doc: str, labels: list[str],
                     series: Iterator[tuple[list[str], Histogram]]) -> HistogramMetricFamily:
    """One Prometheus histogram family from (label values, Histogram) pairs."""
    fam = HistogramMetricFamily(name, doc, labels=labels)
    for values, h in series:
        fam.add_metric(values, h.buckets(), h.sum)
    return fam


class StorageStats:
    """Counters the engine updates as it works (event loop thread unless noted)."""

    def __init__(self) -> None:
        self.wal_append = Histogram(WAL_BUCKETS)   # append call -> durable
        self.wal_append_max = 0.0                  # its maximum since the last scrape
        self.wal_appended_bytes = 0                # record bytes handed to the WAL
        self.backpressure_seconds = {"wal_full": 0.0, "cache_full": 0.0}
        self.backpressure_waits = {"wal_full": 0, "cache_full": 0}
        self.log_cache_hits = 0                    # stream reads served from the LogCache
        self.log_cache_misses = 0                  # ... that had to go to the objects
        self.uploads = 0                           # upload rounds committed
        self.uploaded_bytes = 0                    # object bytes written by uploads
        self.objects_written = {"sso": 0, "so": 0}  # by uploads, per object kind
        self.compacted_objects = 0                 # objects replaced by compaction
        self.trims = 0                             # stream start moved (retention, DeleteRecords)
        self.trimmed_records = 0                   # offsets removed from stream starts
        # streams whose records a takeover (by this node) could not recover: a gap between
        # the committed end and the dead node's WAL, or another owner (issue 17; ERROR logged)
        self.takeover_lost_streams = 0
        # object-store calls, from the IO threads: guarded by _lock
        self._lock = threading.Lock()
        self.store_latency = {op: Histogram(STORE_BUCKETS) for op in STORE_OPS}
        self.store_errors = {op: 0 for op in STORE_OPS}

    def store_call(self, op: str, seconds: float, failed: bool) -> None:
        with self._lock:
            self.store_latency[op].observe(seconds)
            if failed:
                self.store_errors[op] += 1


class MeasuredStore:
    """An ObjectStore that times every call per operation and counts the failures; anything
    else (``url``, test hooks) is the wrapped store's."""

    def __init__(self, inner: Any, stats: StorageStats) -> None:
        self.inner = inner
        self._stats = stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _call(self, op: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        failed = True
        try:
            out = fn(*args)
            failed = False
            return out
        finally:
            self._stats.store_call(op, time.perf_counter() - t0, failed)

    def put(self, key: str, data: Any) -> None:
        return self._call("put", self.inner.put, key, data)

    def get(self, key: str, start: int = 0, end: int | None = None) -> Any:
        return self._call("get", self.inner.get, key, start, end)

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[Any]:
        return self._call("get_ranges", self.inner.get_ranges, key, ranges)

    def get_ranges_crc(self, key: str, ranges: list[tuple[int, int]], skip: int) -> Any:
        return self._call("get_ranges", self.inner.get_ranges_crc, key, ranges, skip)

    def size(self, key: str) -> int:
        return self._call("size", self.inner.size, key)

    def delete(self, keys: list[str]) -> None:
        return self._call("delete", self.inner.delete, keys)

    def list(self, prefix: str = "") -> list[str]:
        return self._call("list", self.inner.list, prefix)

    def close(self) -> None:
        self.inner.close()


def _c(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _g(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class StorageCollector(Collector):
    """Reads an engine's counters and live state at scrape time (on the event loop thread,
    where the broker serves /metrics). Yields nothing for a store without engine stats."""

    def __init__(self, get_engine: Any) -> None:
        self._get_engine = get_engine   # a callable: the engine may be replaced or absent

    def collect(self) -> Iterator[Any]:
        eng = self._get_engine()
        st: StorageStats | None = getattr(eng, "stats", None)
        if not isinstance(st, StorageStats):
            return
        c = eng.config
        p = "s3kafka_"
        # -- WAL
        yield histogram_family(p + "wal_append_seconds", "WAL append latency: append call "
                               "until the record is durable", [], iter([([], st.wal_append)]))
        yield _c(p + "wal_appended_bytes", "Record bytes (header and payload) appended to the "
                 "WAL", st.wal_appended_bytes)
        worst, st.wal_append_max = st.wal_append_max, 0.0
        yield GaugeMetricFamily(p + "wal_append_max_seconds", "Longest WAL append (call until "
                                "durable, as the event loop saw it) since the previous scrape",
                                value=worst)
        wal = eng.wal
        if wal is not None and isinstance(getattr(wal, "stats", None), dict):
            yield _c(p + "wal_device_written_bytes", "Bytes written to the WAL device (aligned "
                     "blocks and headers)", wal.stats.get("bytes_written", 0))
            yield _c(p + "wal_placed_records", "WAL records written from the buffer they were "
                     "received into (no copy into a WAL block)", wal.stats.get("placed_records", 0))
            yield _c(p + "wal_placed_summed_records", "Of those, records whose batch CRC check "
                     "took the sum made as the bytes were received (no second pass over them)",
                     wal.stats.get("placed_summed", 0))
            yield _c(p + "wal_fixed_writes", "WAL writes submitted from frames registered with "
                     "io_uring (WRITE_FIXED: their pages not pinned per write)",
                     getattr(wal, "fixed_writes", 0))
            yield _g(p + "wal_registered_frame_bytes", "Frame arena bytes registered with the "
                     "WAL's io_uring as fixed buffers (registered by the frames' filler thread "
                     "after it grew the arena, not in a produce request)",
                     getattr(wal, "registered_frame_bytes", 0))
        used = max(0, eng._wal_head - eng._wal_trimmed)
        yield _g(p + "wal_used_bytes", "WAL bytes not yet trimmed (appended, not uploaded)",
                 used)
        yield _g(p + "wal_capacity_bytes", "WAL capacity", c.wal_capacity)
        yield _g(p + "wal_fill_ratio", "WAL fill level: used / capacity",
                 used / c.wal_capacity if c.wal_capacity else 0.0)
        wait = CounterMetricFamily(p + "backpressure_wait_seconds", "Time appends spent "
                                   "waiting for room (a full WAL or LogCache)", labels=["reason"])
        waits = CounterMetricFamily(p + "backpressure_waits", "Appends that had to wait for "
                                    "room", labels=["reason"])
        for reason, secs in st.backpressure_seconds.items():
            wait.add_metric([reason], secs)
            waits.add_metric([reason], st.backpressure_waits[reason])
        yield wait
        yield waits
        # -- caches
        cache = eng.cache
        yield _g(p + "log_cache_bytes", "LogCache bytes held", cache.used)
        yield _g(p + "log_cache_capacity_bytes", "LogCache capacity", cache.capacity)
        yield _c(p + "log_cache_hits", "Stream reads served from the LogCache",
                 st.log_cache_hits)
        yield _c(p + "log_cache_misses", "Stream reads that went to objects (not in the "
                 "LogCache)", st.log_cache_misses)
        reader = getattr(eng, "reader", None)
        bc = getattr(reader, "block_cache", None)
        if bc is not None:
            yield _g(p + "block_cache_bytes", "BlockCache bytes held", bc.used)
            yield _g(p + "block_cache_capacity_bytes", "BlockCache capacity", bc.capacity)
            yield _c(p + "block_cache_hits", "Object block reads served from the BlockCache",
                     bc.hits)
            yield _c(p + "block_cache_misses", "Object block reads fetched from the object "
                     "store", bc.misses)
            yield _c(p + "block_cache_fetched_bytes", "Bytes fetched from the object store "
                     "into the BlockCache", bc.bytes_fetched)
        pool = getattr(getattr(eng, "store", None), "buffers", None)   # the file store's
        if pool is not None and hasattr(pool, "fresh_bytes"):
            yield _g(p + "read_buffers_bytes", "Cold read buffers held: free ones kept for "
                     "reuse and ones under BlockCache blocks (storage/objects/buffers.py)",
                     pool.bytes)
            yield _c(p + "read_buffers_mapped_bytes", "Cold read buffer bytes mapped fresh "
                     "(no free buffer fitted; each page then faults in once)", pool.fresh_bytes)
            yield _c(p + "read_buffers_dropped_bytes", "Cold read buffer bytes let go because "
                     "the pool was full", pool.dropped_bytes)
        # -- uploads
        backlog, firsts = eng.upload_backlog()
        yield _g(p + "upload_backlog_bytes", "Appended bytes not yet uploaded to the object "
                 "store (pending and in uploads not committed yet)", backlog)
        age = 0.0
        for e in firsts:
            added = e.added
            age = max(age, time.perf_counter() - added if added
                      else time.monotonic() - eng.started_at)
        yield _g(p + "upload_oldest_age_seconds", "Age of the oldest record not yet uploaded "
                 "(0: nothing pending)", max(0.0, age))
        yield _c(p + "uploads", "Upload rounds committed", st.uploads)
        yield _c(p + "upload_errors", "Upload rounds that failed (retried)",
                 getattr(eng, "upload_errors", 0))
        yield _c(p + "uploaded_bytes", "Object bytes written by uploads", st.uploaded_bytes)
        yield _c(p + "takeover_lost_streams", "Streams whose records a WAL takeover by this "
                 "node could not recover (a gap or another owner: records lost)",
                 getattr(st, "takeover_lost_streams", 0))
        objs = CounterMetricFamily(p + "objects_written", "Objects written by uploads, per kind "
                                   "(sso: several streams, so: one stream)", labels=["kind"])
        for kind, n in st.objects_written.items():
            objs.add_metric([kind], n)
        yield objs
        # -- object store
        with st._lock:
            lat = [([op], _copy(h)) for op, h in st.store_latency.items()]
            errs = dict(st.store_errors)
        yield histogram_family(p + "object_store_request_seconds", "Object-store call latency "
                               "per operation", ["operation"], iter(lat))
        fam = CounterMetricFamily(p + "object_store_errors", "Object-store calls that failed, "
                                  "per operation", labels=["operation"])
        for op, n in errs.items():
            fam.add_metric([op], n)
        yield fam
        # -- episodes (a full WAL, back-pressured producers, a failing object store or
        # maintenance round): the same conditions the log reports once per episode
        m = getattr(eng, "maintenance", None)
        active = GaugeMetricFamily(p + "episode_active", "1 while the condition lasts (logged "
                                   "once when it starts and once when it ends)",
                                   labels=["episode"])
        count = CounterMetricFamily(p + "episodes", "Episodes of the condition so far",
                                    labels=["episode"])
        secs = CounterMetricFamily(p + "episode_seconds", "Time spent in the condition, the "
                                   "current episode included", labels=["episode"])
        now = time.monotonic()
        for ep in (getattr(eng, "wal_full", None), getattr(eng, "backpressure", None),
                   getattr(eng, "store_failing", None), getattr(m, "failing", None)):
            if not isinstance(ep, Episode):
                continue
            active.add_metric([ep.what], 1.0 if ep.active else 0.0)
            count.add_metric([ep.what], ep.episodes)
            secs.add_metric([ep.what], ep.total_s + (now - ep.started if ep.active else 0.0))
        yield active
        yield count
        yield secs
        # -- compaction, retention, cleanup
        yield _c(p + "compactions", "Compaction rounds that replaced objects",
                 getattr(m, "compactions", 0))
        yield _c(p + "compacted_objects", "Objects replaced by compaction", st.compacted_objects)
        yield _c(p + "objects_deleted", "Objects deleted from the object store (compacted "
                 "away or no longer needed after retention)", getattr(m, "deleted_objects", 0))
        yield _c(p + "stream_trims", "Times a partition's log start moved forward (retention, "
                 "DeleteRecords)", st.trims)
        yield _c(p + "stream_trimmed_records", "Offsets removed from the start of partitions "
                 "(retention, DeleteRecords)", st.trimmed_records)


def _copy(h: Histogram) -> Histogram:
    out = Histogram(h.bounds)
    out.counts = list(h.counts)
    out.sum = h.sum
    return out
