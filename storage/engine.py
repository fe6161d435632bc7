"""The storage engine: Delta WAL + LogCache + uploader + object reads + compaction.

Write path: Stream.append -> WAL record (stream id, base offset, count, payload) -> LogCache
entry -> completes once the WAL says the record is durable. Upload path: unuploaded bytes pass
a threshold, an interval passes, or the cache/WAL fill up -> objects are written to the object
store, committed to the metadata store in one transaction, then the WAL is trimmed and the
cache entries become evictable. Read path: LogCache, else objects through the BlockCache.
Start-up: note objects a crash left prepared/destroyed (deleted in the background), replay the
WAL (dropping what is already committed), upload it, trim.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import functools
import itertools
import logging
import mmap
import operator
import os
import struct
import time
from dataclasses import dataclass, fields
from typing import Any, Callable

from .cache.log_cache import CacheEntry, LogCache
from .cold_reads import ColdReadPacer
from . import sqldb
from .crash import crash_point
from .episodes import Episode
from .waits import end_tasks, wait_event
from .metastore import (MetaStore, NewObject, ObjectRange, StreamFenced, StreamMeta,
                        open_metastore)
from .loop_slices import (NATIVE_ENCODE, SLICE_S, encode_object_in_slices, encode_object_into,
                          no_pause, object_size_in_slices)
from .metrics import MeasuredStore, StorageStats
from .objects.format import NOGIL_COPY_FROM, STREAM_ENCODE, StreamEncoder, gather_source
from .objects.store import RECYCLE_BYTES, ObjectStore, open_object_store
from .reader import ObjectReader
from .thread_priority import background_executor, in_io_class
from .stream import (Batch, OffsetOutOfRange, OffsetStream, PayloadChecksumError,
                     RetriableStorageError, StorageError, Stream, StreamStore)

log = logging.getLogger(__name__)
_WAL_OFFSET = operator.attrgetter("wal_offset")
_WAL_NEXT = operator.attrgetter("wal_next")
_STREAM_ID = operator.attrgetter("stream_id")
_SIZE = operator.attrgetter("size")
_PAYLOAD = operator.attrgetter("payload")
_BASE_OFFSET = operator.attrgetter("base_offset")
# the task path's "the write failed" for _note_durable (its error goes to the future's waiter)
_WRITE_FAILED = StorageError("WAL write failed")
# a background upload of small records pauses this long after each 0.5 ms encode slice (see
# _upload_pause): at most about a quarter of the loop while hot requests run (session 14)
UPLOAD_PAUSE_S = 0.001
STOP_WAIT_S = 10.0          # close() waits this long for its cancelled tasks (waits.py)
# cache entries an upload takes per loop step (~0.3 us each), and evicts (~1 us each)
TAKE_SLICE = 2048
EVICT_SLICE = 512
# entries an upload groups by stream per C-level pass (sort, groupby, sums: ~0.1-0.2 us each)
GROUP_CHUNK = 2048

WAL_RECORD = struct.Struct(">qqi")          # stream id, base offset, count; then the payload
WAL_RECORD_HEADER = 24                      # the WAL's own per-record header (offset arithmetic)
# An upload round's records go to objects of at most about OBJECT_SPLIT_BYTES of payload:
# each fits a reused 32 MiB encode buffer, PUTS_IN_FLIGHT of them are written at once while
# the next is encoded. One put writes 1 MiB at a time and waits for each (so a WAL write
# queues behind at most that much per put): ~550 MB/s on this VM's disk alone, which capped
# every producer once the LogCache was full (bench/HISTORY.md, session 14).
OBJECT_SPLIT_BYTES = 28 << 20
PUTS_IN_FLIGHT = 2
# ... and this many while appends wait on the upload (Engine._upload_urgent: a forced upload,
# cache pressure, the WAL past half its capacity). Under raw 1 MiB produce the LogCache is full
# of unuploaded data from the second second on and appends wait for cache room ~70 % of the
# time; the upload, two puts in flight 80 % of it, is then what producers wait on (session 29).
# Outside such pressure PUTS_IN_FLIGHT stays: fewer object pieces in front of each WAL write.
URGENT_PUTS_IN_FLIGHT = 4
ENCODE_BUFFERS = URGENT_PUTS_IN_FLIGHT + 1  # kept: those being written, the next encoded
ENCODE_BUFFER_MAX = 128 << 20              # largest object encode buffer kept for reuse
ENCODE_BUFFER_MIN = OBJECT_SPLIT_BYTES + (1 << 20)   # smallest one made (see _take_encode_buffer)
# longest a stream's delete waits for the uploads in flight that hold its entries (one put
# round: ~0.1-0.3 s under load; see Engine.delete_stream)
DELETE_WAIT_S = 10.0
CATCHUP_GAIN = 1.5                          # a paced catch-up reader gets >= this x the append rate


class _NotFenced(Exception):
    """Placeholder until start() imports storage.wal's FencedError (never raised)."""


@dataclass
class EngineConfig:
    """Every engine option with its default (docs/storage.md explains each)."""

    data_dir: str = "./data"
    wal_path: str = ""                       # "" = <data_dir>/wal (preallocated file)
    wal_capacity: int = 2 << 30
    object_store: str = ""                   # "" = file://<data_dir>/objects
    metadata_url: str = ""                   # "" = sqlite:///<data_dir>/meta.db
    node_id: int = 0
    node_epoch: int = 0                      # this node's epoch (the cluster layer bumps it);
                                             # written into the WAL header and the registry
    log_cache_bytes: int = 1 << 30
    block_cache_bytes: int = 256 << 20
    upload_threshold_bytes: int = 64 << 20
    upload_interval_s: float = 60.0
    upload_max_bytes: int = 256 << 20        # most bytes one upload round writes
    stream_object_threshold_bytes: int = 8 << 20   # a stream's run this big gets its own object
    object_block_bytes: int = 512 << 10      # data block size inside objects
    readahead_max_bytes: int = 32 << 20
    # file:// objects written and their blocks read with O_DIRECT (no page-cache copy either
    # way: less CPU per uploaded and per cold-read MiB); docs/storage.md
    object_direct_writes: bool = True
    # ... and their large payloads written straight from the LogCache's frames instead of
    # copied into an encode buffer (GatherSource: needs object_direct_writes; False: every
    # object encoded as before)
    object_gather_writes: bool = True
    # most bytes of deleted objects' files a file:// store keeps for later puts to overwrite
    # (0: unlink every one); docs/storage.md "Recycled object files"
    object_recycle_bytes: int = RECYCLE_BYTES
    compaction_interval_s: float = 300.0
    compaction_min_objects: int = 4          # compact when this many small objects exist
    compaction_max_bytes: int = 256 << 20    # most bytes one compaction round reads
    small_object_bytes: int = 16 << 20       # stream objects below this get merged
    cleanup_interval_s: float = 10.0         # how often dead objects are looked for
    backpressure_timeout_s: float = 5.0      # append waits this long for cache/WAL room
    wal_sync_mode: str = "dsync"
    wal_format: bool = False                 # erase and format a WAL path holding foreign data
    wal_reformat_taken_over: bool = False    # format afresh a WAL another node took over (its
                                             # records are committed; needs a newer node_epoch)
    wal_flush_interval_s: float = 1 / 3000
    wal_io_engine: str = "uring"             # "uring": the event loop writes the WAL through
                                             # io_uring from registered frame memory (libaio
                                             # where io_uring cannot be set up); "aio": with
                                             # libaio; "threads": IO threads do (docs/wal.md)
    io_threads: int = 8                      # threads for object store / metadata calls
    cold_read_bytes_per_s: int = 64 << 20    # cap on bytes/s served from objects (catch-up
                                             # readers), so they cannot starve the tail; 0 = off
    cold_read_min_bytes_per_s: int = 16 << 20  # floor of the adaptive cold-read rate
    cold_read_lag_target_ms: float = 1.0     # mean event-loop lag (per 100 ms) above which the
                                             # cold-read rate is cut (AIMD, cold_reads.py);
                                             # 0 = fixed rate
    cold_read_hot_tolerance: float = 0.05    # the cold-read rate is also cut while hot appends'
                                             # p90 latency is this much above its baseline
                                             # without cold reads (cold_reads.py); 0 = off
    cold_read_max_bytes: int = 256 << 10     # most bytes one read serves from objects (short
                                             # loop slices: hot requests never wait long)
    catchup_age_s: float = 2.0               # reads from the LogCache of data appended longer
                                             # ago than this, while producers append, are paced
                                             # like cold reads (at least 1.5x the append rate);
                                             # 0 = never
    cold_read_threads: int = 16              # threads for object reads of the cold path: a
                                             # cold pass waited on the device with 2 reads in
                                             # flight (2 -> 16: cold raw Fetch 282-742 -> 821-
                                             # 1022 MB/s, bench/HISTORY.md session 14); while
                                             # producers append the file store reads one small
                                             # piece at a time whatever the count
    cold_read_nice: int = 0                  # their nice value (and SCHED_BATCH: a large read
                                             # never preempts the event loop); 19 starved them
                                             # and, holding the GIL, the loop (thread_priority)
    cold_read_io_class: str = "idle"         # their I/O class ("idle" or "be"): cold reads
                                             # never queue ahead of WAL writes on one disk
                                             # (thread_priority.py)
    cold_read_piece_bytes: int = 64 << 10    # while producers append, a file store reads its
                                             # objects this much per device read, one read at a
                                             # time: a WAL write on the same disk waits behind
                                             # at most one (256 KiB: +0.35-0.45 ms each, 64 KiB
                                             # +0.08-0.13 ms on the test VM; bench.collide)

    def resolved(self) -> "EngineConfig":
        """A copy with the data-dir derived defaults filled in."""
        c = EngineConfig(**{f.name: getattr(self, f.name) for f in fields(self)})
        d = os.path.abspath(c.data_dir)
        c.wal_path = c.wal_path or os.path.join(d, "wal")
        c.object_store = c.object_store or "file://" + os.path.join(d, "objects")
        c.metadata_url = c.metadata_url or "sqlite:///" + os.path.join(d, "meta.db")
        return c


def _split_records(recs: list[Any], limit: int | None = None,
                   cum: list[int] | None = None) -> list[tuple[list[Any], int]]:
    """``recs`` (sorted by stream and offset) cut into consecutive runs of at most ``limit``
    (OBJECT_SPLIT_BYTES) payload bytes (a larger record alone), with their payload bytes:
    each run is one object. C-level passes (accumulate, bisect) over the payload lengths: an
    upload of small requests holds ~46,000 records, and a Python loop over them was a 10 ms
    event-loop stall (``cum``: their running payload sizes, if the caller has them: the
    upload sums them in slices, ``_payload_cumsum``; one pass over 46,000 was ~3-5 ms)."""
    limit = limit or OBJECT_SPLIT_BYTES
    if cum is None:
        cum = list(itertools.accumulate(map(len, map(_PAYLOAD, recs))))
    parts: list[tuple[list[Any], int]] = []
    start, base, n = 0, 0, len(recs)
    while start < n:
        end = max(bisect.bisect_right(cum, base + limit, lo=start), start + 1)
        parts.append((recs[start:end], cum[end - 1] - base))
        base, start = cum[end - 1], end
    return parts


async def _payload_cumsum(recs: list[Any], pause: Callable[[], float] = no_pause
                          ) -> list[int]:
    """The running sum of the records' payload sizes (``_split_records``'s ``cum``), by C-level
    passes over GROUP_CHUNK records with a yield to the loop between slices (``pause()``:
    seconds to wait there, Engine._upload_pause)."""
    cum: list[int] = []
    total = 0
    clock = time.perf_counter
    until = clock() + SLICE_S
    for lo in range(0, len(recs), GROUP_CHUNK):
        sizes = map(len, map(_PAYLOAD, recs[lo:lo + GROUP_CHUNK]))
        cum.extend(itertools.islice(itertools.accumulate(sizes, initial=total), 1, None))
        total = cum[-1]
        if clock() >= until:
            await asyncio.sleep(pause())
            until = clock() + SLICE_S
    return cum


async def _put_ended(writing: set[asyncio.Future]) -> None:
    """Wait until one of the puts in flight ends - any of them, not the oldest: puts of one
    round take 30-70 ms each on a busy disk, and waiting for the oldest left a slot that a
    later put freed idle meanwhile - and drop the ended ones from ``writing`` (raises a failed
    one's error)."""
    done, _ = await asyncio.wait(writing, return_when=asyncio.FIRST_COMPLETED)
    writing.difference_update(done)
    for f in done:
        f.result()


def open_engine(config: EngineConfig) -> "Engine":
    """The StreamStore the broker uses; call ``await store.start()`` next."""
    return Engine(config)


class EngineStream(OffsetStream):
    """One stream over the engine."""

    def __init__(self, engine: "Engine", meta: StreamMeta) -> None:
        self.stream_id = meta.stream_id
        self._engine = engine
        self._start = meta.start_offset
        self._end = meta.end_offset
        self._confirmed = meta.end_offset
        self.committed = meta.end_offset
        self.deleted = meta.deleted
        # False while another node writes the stream (a cluster sharing the object store):
        # appends are refused and compaction leaves its objects alone
        self.owned = True

    @property
    def confirmed_offset(self) -> int:
        return self._confirmed

    def _durable(self, entry: CacheEntry, t0: float, fut: asyncio.Future) -> None:
        ok = not fut.cancelled() and fut.exception() is None
        self._note_durable(entry, t0, None, 0, None if ok else _WRITE_FAILED)

    def _note_durable(self, entry: CacheEntry, t0: float,
                      then: Callable[[BaseException | None], None] | None, _offset: int,
                      error: BaseException | None) -> None:
        """The stream's bookkeeping once an append's WAL write completed (both append paths):
        ``error`` None when it is durable, else the write's error; then ``then(error)`` (the
        task-less path: ``partial(_note_durable, entry, t0, then)`` is append_loop's ``then``,
        one Python call per append's completion). No upload test here: what starts an upload
        (pending bytes, the WAL head) only grows at an append, whose ``_took`` tests it; the
        upload loop waits for the durability of what it takes on its own."""
        ok = error is None
        entry.durable = True        # even on a WAL error: the bytes still go to the object store
        # the hot path's latency as the loop sees it: what cold reads must not stretch
        took = time.perf_counter() - t0
        self._engine.cold_pacer.note_hot(took, len(entry.payload))
        stats = self._engine.stats
        stats.wal_append.observe(took)
        if took > stats.wal_append_max:
            stats.wal_append_max = took
        if ok:
            nxt = entry.base_offset + entry.count      # entry.next_offset
            if nxt > self._confirmed:
                self._confirmed = nxt
        if then is not None:
            then(error)

    checks_payloads = True

    def _check_writable(self) -> None:
        """An append to a deleted stream, or one released to another node, is refused."""
        if self.deleted:
            raise StorageError(f"stream {self.stream_id} is deleted")
        if not self.owned:
            raise StorageError(f"stream {self.stream_id} is released to another node")

    def _taken(self, payload: bytes | memoryview, base_offset: int, count: int, size: int,
               res: Any, t0: float, check: tuple[int, int] | None) -> CacheEntry:
        """The bookkeeping of a record the WAL took (``append``): its LogCache entry (with the
        ``check`` the WAL verified), the stream's end and the engine's WAL position."""
        entry = CacheEntry(self.stream_id, base_offset, count, payload, res.offset,
                           res.next_offset, added=t0, check=check)
        self._took(entry, size)
        return entry

    def _took(self, entry: CacheEntry, size: int) -> None:
        eng = self._engine
        eng.cache.add(entry)
        eng.stats.wal_appended_bytes += size
        self._end = entry.base_offset + entry.count
        if entry.wal_next > eng._wal_head:      # the WAL's use: nearing capacity forces an upload
            eng._wal_head = entry.wal_next
        # wake the upload loop at the append that brought the pending bytes to the upload
        # threshold or to cache pressure (``_upload_at``), or the WAL past half its capacity
        if eng.cache.pending_bytes >= eng._upload_at or \
                eng._wal_head - eng._wal_trimmed > eng.config.wal_capacity // 2:
            eng._upload_wakeup.set()
        eng.cold_pacer.note_append()            # durable later: _note_durable's note_hot

    def append_now(self, payload: bytes | memoryview, base_offset: int, count: int,
                   then: Callable[[BaseException | None], None],
                   check: tuple[int, int] | None = None) -> bool:
        """``append`` without a coroutine, when there is room at once: the payload is in the
        WAL's block and the LogCache on return (True), and ``then(None)`` runs once it is
        durable, ``then(error)`` if its write failed, after the stream's own bookkeeping: in
        the WAL's completion of its write (append_loop's ``then``), with no future, done
        callback or loop iteration per append. False with nothing done when the LogCache or
        the WAL has no room (``append`` waits for it). Raises StorageError like ``append``
        (deleted, released, fenced), and PayloadChecksumError (nothing appended) when
        ``check`` (as ``append``'s: the payload's CRC-32C from an offset, checked in the WAL's
        copy) does not match. The task-less Produce path."""
        eng = self._engine
        if self.deleted or not self.owned:
            self._check_writable()
        if base_offset != self._end or count <= 0:
            raise ValueError(f"append of {count} at {base_offset}, expected {self._end}")
        if type(payload) is not bytes and (type(payload) is not memoryview
                                           or payload.format != "B" or payload.ndim != 1
                                           or not payload.c_contiguous):
            payload = memoryview(payload).cast("B")     # a flat byte view (the partition's is)
        size = WAL_RECORD.size + len(payload)
        cache, wal = eng.cache, eng.wal
        # cache.has_room's own first test inline: it is called only when eviction may be needed
        if (cache.used + size + 64 > cache.capacity and not cache.has_room(size + 64)) \
                or not wal.has_room(size):
            return False
        t0 = time.perf_counter()
        sid = self.stream_id
        entry = CacheEntry(sid, base_offset, count, payload, -1, -1, False, t0, check)
        # the stream's bookkeeping, then the caller's continuation: one call per append
        durable = functools.partial(self._note_durable, entry, t0, then)
        try:
            # checked while the WAL copies the record (from the WAL record's body: after its
            # stream header): no pass of its own
            offset = wal.append_flat(WAL_RECORD.pack(sid, base_offset, count), payload, sid,
                                     check and (WAL_RECORD.size + check[0], check[1]), durable)
        except eng.checksum_error as e:
            raise PayloadChecksumError(str(e)) from None
        except eng.fenced_error as e:   # another node took this WAL over
            raise StorageError(str(e)) from None
        except eng.over_capacity_error:
            return False
        entry.wal_offset, entry.wal_next = offset, offset + WAL_RECORD_HEADER + size
        self._took(entry, size)
        return True

    async def append(self, payload: bytes | memoryview, base_offset: int, count: int,
                     check: tuple[int, int] | None = None) -> None:
        eng = self._engine
        self._check_writable()
        if base_offset != self._end:
            raise ValueError(f"append at {base_offset}, expected {self._end}")
        if count <= 0:
            raise ValueError("count must be positive")
        # The WAL copies (header, payload) straight into its block: the only copy of the
        # payload. The LogCache keeps the caller's buffer itself, which the caller hands over
        # (Partition.append passes a buffer nobody else changes: CONTRACTS, produce path).
        payload = payload if type(payload) is bytes else memoryview(payload).cast("B")
        header = WAL_RECORD.pack(self.stream_id, base_offset, count)
        size = WAL_RECORD.size + len(payload)
        # checked while the WAL copies the record (from the WAL record's body: after its stream
        # header): no pass of its own
        wal_check = check and (WAL_RECORD.size + check[0], check[1])
        deadline = None
        while True:
            room = eng.cache.has_room(size + 64)
            if room and not eng.wal.has_room(size):
                # the WAL already holds max_buffered_bytes not yet durable: wait for its writes,
                # as a blocking append() does. append_loop never waits, and past its buffer
                # pool every further block is a fresh mapping faulted in on the loop (appends
                # outpacing the device: hundreds of MiB, FINDINGS session 18 confluent)
                await eng.wal.wait_for_room(size)
                if base_offset != self._end or self.deleted:
                    raise RetriableStorageError("stream moved on while waiting for the WAL; retry")
                if not self.owned:
                    raise StorageError(f"stream {self.stream_id} is released to another node")
                # append once woken, even if another append took the room meanwhile (one
                # record over at most; a failed WAL wakes its waiters and refuses the append)
                room = eng.cache.has_room(size + 64)
            if room:
                try:
                    # an asyncio future completed in batches by the WAL: no cross-thread
                    # wake-up per record (append() would cost one self-pipe write each)
                    t0 = time.perf_counter()
                    res = eng.wal.append_loop((header, payload), self.stream_id, wal_check,
                                              flat=True)
                    break
                except eng.checksum_error as e:
                    raise PayloadChecksumError(str(e)) from None
                except eng.fenced_error as e:   # another node took this WAL over
                    raise StorageError(str(e)) from None
                except eng.over_capacity_error:
                    eng.request_upload("wal full")
                    reason = "wal_full"
                    eng.wal_full.hit("the WAL ring holds only data not yet uploaded")
            else:
                eng.request_upload("cache full")
                reason = "cache_full"
            # back-pressure: wait for an upload to free room, then give up (retriable)
            eng.backpressure.hit("WAL full" if reason == "wal_full" else
                                 "log cache full of data not yet uploaded")
            now = time.monotonic()
            deadline = deadline or now + eng.config.backpressure_timeout_s
            if now >= deadline or eng.closing:
                raise RetriableStorageError("storage is full of unuploaded data; retry")
            waited = time.perf_counter()
            await eng.wait_for_room(deadline - now)
            eng.stats.backpressure_seconds[reason] += time.perf_counter() - waited
            eng.stats.backpressure_waits[reason] += 1
            if base_offset != self._end or self.deleted:
                raise RetriableStorageError("stream moved on while waiting for room; retry")
            if not self.owned:   # released meanwhile: its end offset is already handed over
                raise StorageError(f"stream {self.stream_id} is released to another node")
        entry = self._taken(payload, base_offset, count, size, res, t0, check)
        afut = res.future
        afut.add_done_callback(functools.partial(self._durable, entry, t0))
        try:
            await asyncio.shield(afut)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise StorageError(f"WAL write failed: {e}") from e

    async def read(self, start_offset: int, max_bytes: int) -> list[Batch]:
        if self.deleted:
            raise StorageError(f"stream {self.stream_id} is deleted")
        if start_offset < self._start or start_offset > self._end:
            raise OffsetOutOfRange(f"{start_offset} not in [{self._start}, {self._end}]")
        eng = self._engine
        out: list[Batch] = []
        size = 0
        offset = start_offset
        for _ in range(4):
            limit = self._confirmed
            if offset >= limit or size >= max_bytes:
                break
            first = eng.cache.first_offset(self.stream_id)
            if first is None or offset < first:
                eng.stats.log_cache_misses += 1
                budget = await self._scavenger_budget(max_bytes - size)
                got = await eng.reader.read(self.stream_id, offset, budget, limit,
                                            first_required=not out)
                if got:
                    out.extend(got)
                    n = sum(len(b.payload) for b in got)
                    size += n
                    if eng.cold_pacer.hot_active():
                        await eng.cold_pacer.pace(n)
                    else:   # no producers: nothing to protect, the store's own speed
                        eng.cold_pacer.bytes += n
                    offset = got[-1].next_offset
                    first = eng.cache.first_offset(self.stream_id)
                    if first is None or offset < first:
                        break           # budget reached (or the cache holds nothing newer)
            budget = max_bytes - size
            lagging = self._lagging(offset)
            if lagging:
                # a catch-up reader whose backlog is still in memory: the same scavenger
                # pacing as cold reads, but never slower than the producers (it must gain)
                budget = await self._scavenger_budget(budget)
            got = eng.cache.read(self.stream_id, offset, budget, self._confirmed,
                                 first_required=not out)
            if got:
                eng.stats.log_cache_hits += 1
                out.extend(got)
                if lagging:
                    pacer = eng.cold_pacer
                    await pacer.pace(sum(len(b.payload) for b in got),
                                     min_rate=pacer.hot_rate * CATCHUP_GAIN)
                break
            if eng.cache.first_offset(self.stream_id) is None or \
                    offset >= eng.cache.first_offset(self.stream_id):
                break
            # the cache moved on while we read objects: look again
        if not out and offset < self._confirmed and offset >= self._start:
            raise StorageError(f"stream {self.stream_id}: offset {offset} is neither cached nor "
                               "in any object")
        return out

    async def _scavenger_budget(self, remaining: int) -> int:
        """Bytes a catch-up read (cold, or lagging in the LogCache) may serve now: hot work
        already queued on the loop goes first, no catch-up bytes during a baseline pause,
        and at most cold_read_max_bytes per read while producers append (the slice is what a
        hot request may wait behind; with nothing hot to protect, reads are not cut)."""
        eng = self._engine
        await asyncio.sleep(0)
        await eng.cold_pacer.admit()
        cap = eng.config.cold_read_max_bytes
        if not cap or not eng.cold_pacer.hot_active():
            return remaining
        return min(remaining, cap)

    def _lagging(self, offset: int) -> bool:
        """A read at ``offset`` is catch-up traffic: its data was appended more than
        catchup_age_s ago while producers are appending now (without hot traffic nothing
        needs protecting and catch-up runs unpaced)."""
        eng = self._engine
        age = eng.config.catchup_age_s
        if age <= 0 or not eng.cold_pacer.hot_active():
            return False
        added = eng.cache.added_at(self.stream_id, offset)
        return added is not None and time.perf_counter() - added > age

    async def trim(self, new_start_offset: int) -> None:
        new_start = min(new_start_offset, self._end)
        if new_start <= self._start:
            return
        self._engine.stats.trims += 1
        self._engine.stats.trimmed_records += new_start - self._start
        self._start = new_start
        self._engine.cache.trim(self.stream_id, new_start)
        await self._engine.io(self._engine.meta.set_stream_start, self.stream_id, new_start)


    # -- rewriting (the broker's log cleaner; storage/maintenance.py) ------------------------
    @property
    def uploaded_offset(self) -> int:
        """Every offset below this is in committed objects (what a rewrite may cover)."""
        return self.committed

    def object_ranges(self) -> list[tuple[int, int, int]]:
        """(start, end, bytes) per committed object range of this stream; the bytes of a
        range in a stream set object are that object's size shared by its ranges."""
        objs = self._engine.reader.objects
        return [(r.start_offset, r.end_offset, r.size // max(1, len(objs.get(r.object_id, ()))))
                for r in self._engine.reader.stream_ranges(self.stream_id)]

    async def rewrite(self, start: int, end: int, keep: Any, max_object_bytes: int = 64 << 20,
                      max_bytes_per_s: float = 0.0) -> Any:
        """Maintenance.rewrite_stream for this stream: filter its committed payloads in
        [start, end) and replace the objects holding them in one metadata transaction."""
        return await self._engine.maintenance.rewrite_stream(
            self.stream_id, start, end, keep, max_object_bytes, max_bytes_per_s)


class _EarlierNotCommitted(Exception):
    """A release's upload found this stream's earlier entries uncommitted (their upload
    failed): it is not committed either, and its entries are taken again with those."""


class Engine(StreamStore):
    """Ties WAL, LogCache, uploader, reader and maintenance together."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config.resolved()
        self.streams: dict[int, EngineStream] = {}
        self.cache = LogCache(self.config.log_cache_bytes)
        self.closing = False
        self.wal: Any = None
        self.over_capacity_error: type[BaseException] = Exception
        self.fenced_error: type[BaseException] = _NotFenced     # storage.wal's, from start()
        self.checksum_error: type[BaseException] = _NotFenced
        self.meta: MetaStore
        self.store: ObjectStore
        self.reader: ObjectReader
        self._executor = concurrent.futures.ThreadPoolExecutor(
            self.config.io_threads, thread_name_prefix="s3kafka-io")
        # cold reads (catch-up consumers) run on their own threads, low in CPU and I/O
        # priority: a multi-megabyte read never preempts the event loop or queues ahead of
        # a WAL write (thread_priority.py)
        self._cold_executor = background_executor(self.config.cold_read_threads,
                                                  "s3kafka-cold", self.config.cold_read_nice,
                                                  self.config.cold_read_io_class)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._upload_wakeup = asyncio.Event()
        self._room = asyncio.Event()
        self._force_upload = False
        self._last_upload = time.monotonic()
        self._wal_head = 0               # WAL offset after the newest record
        self._wal_trimmed = 0
        self._tasks: list[asyncio.Task] = []
        self._uploading = False
        self._gentle_puts = 0       # puts in flight of background uploads of small records
        self.wal_fenced = False              # another node took this WAL over (_check_fenced)
        self._fence_checked = 0.0
        self._release_lock = asyncio.Lock()
        self._trim_lock = asyncio.Lock()     # WAL trims in order (drains beside the loop)
        self._inflight_streams: collections.Counter[int] = collections.Counter()
        self._foreign: set[int] = set()      # streams another node claimed under our feet
        # the WAL is never trimmed past a record not durably committed by someone (issue 17):
        # uploads in flight (first WAL offset of their entries) and dropped entries of
        # foreign streams (stream -> (first WAL offset, end offset)) hold the trim point
        self._inflight: dict[int, int] = {}
        self._take_key = 0                 # keys of uploads whose take is under way
        # per upload in flight (its _inflight key): the bytes of the entries it took from the
        # cache's pending queue and has not committed yet, and the first of them (the backlog
        # metric counts them: a retried upload in an outage holds them all)
        self._upload_takes: dict[int, tuple[int, CacheEntry]] = {}
        # what each take took, grouped by stream as it was taken (LogCache.take_grouped):
        # stream id -> its entries, and -> their running payload sums
        self._take_groups: dict[int, tuple[dict[int, list[CacheEntry]],
                                           dict[int, list[int]]]] = {}
        self._held: dict[int, tuple[int, int]] = {}
        # the cluster's lease gate (broker/cluster/room.py sets it): while it answers False
        # this node uploads, commits and trims nothing (a lapsed lease: maybe fenced already)
        self.writes_allowed: Callable[[], bool] = lambda: True
        self.writes_paused = Episode(log, "storage_writes_paused", quiet_s=float("inf"))
        self.maintenance: Any = None
        self.upload_errors = 0
        self.stats = StorageStats()          # read by storage.metrics.StorageCollector
        self.started_at = time.monotonic()
        # conditions logged once per episode (start with the reason, end with the duration)
        self.wal_full = Episode(log, "wal_full")
        self.backpressure = Episode(log, "producers_backpressured")
        self.store_failing = Episode(log, "object_store_failing", quiet_s=float("inf"))
        c = self.config
        # pending bytes from which half the LogCache holds unuploaded data (_cache_pressure)
        self._pressure_at = c.log_cache_bytes // 2 + 1
        # _maybe_upload's pending bytes test in one comparison: the upload threshold, or
        # cache pressure
        self._upload_at = min(c.upload_threshold_bytes, self._pressure_at)
        self._encode_bufs: list[Any] = []   # reused object encode buffers (see _upload)
        self.cold_pacer = ColdReadPacer(c.cold_read_bytes_per_s, c.cold_read_min_bytes_per_s,
                                        c.cold_read_lag_target_ms / 1000,
                                        hot_tolerance=c.cold_read_hot_tolerance)

    async def io(self, fn: Callable, *args: Any) -> Any:
        """Run a blocking call (object store, metadata, WAL trim) on the IO threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def cold_io(self, fn: Callable, *args: Any) -> Any:
        """Run an object read for the cold path on the low-priority threads: in the idle I/O
        class (when configured) while producers append, so their WAL writes go first; in the
        normal class when nothing hot runs, where the idle class only let other processes'
        I/O starve a lone catch-up reader (its reads are O_DIRECT with direct object writes:
        every one goes to the device)."""
        io_class = self.config.cold_read_io_class
        if io_class == "idle" and not self.cold_pacer.hot_active():
            io_class = "be"
        return await asyncio.get_running_loop().run_in_executor(
            self._cold_executor, in_io_class, io_class, fn, *args)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        from .wal import ChecksumMismatchError, DeltaWAL, FencedError, OverCapacityError, WALConfig
        from .maintenance import Maintenance
        c = self.config
        self._loop = asyncio.get_running_loop()
        os.makedirs(c.data_dir, exist_ok=True)
        self.over_capacity_error = OverCapacityError
        self.fenced_error = FencedError
        self.checksum_error = ChecksumMismatchError
        self.meta = await self.io(open_metastore, c.metadata_url)
        inner = await self.io(open_object_store, c.object_store, False,
                              c.object_recycle_bytes)
        if hasattr(inner, "direct_writes"):
            inner.direct_writes = c.object_direct_writes
        if hasattr(inner, "gentle"):       # small device reads while producers append
            inner.gentle = self.cold_pacer.hot_active
            inner.hot_read_piece = c.cold_read_piece_bytes
        if hasattr(inner, "gentle_writes"):  # small device writes beside small appends
            inner.gentle_writes = self._gentle_writes
        if hasattr(inner, "buffers"):       # free read buffers: half the BlockCache (and the
            # room returned ones leave: storage/objects/buffers.py)
            inner.buffers.max_bytes = min(inner.buffers.max_bytes, c.block_cache_bytes // 2)
        self.store = MeasuredStore(inner, self.stats)
        self.reader = ObjectReader(self.store, self.cold_io, c.block_cache_bytes,
                                   c.readahead_max_bytes)
        self.reader.hot = self.cold_pacer.hot_active
        self.maintenance = Maintenance(self)
        # metadata only: the deletes run in the background (maintenance.run), so a broker
        # restarted while the object store is down still recovers its WAL and listens
        await self.maintenance.find_leftovers()
        for m in await self.io(self.meta.streams):
            self.streams[m.stream_id] = EngineStream(self, m)
            self.cache.set_stream_state(m.stream_id, m.end_offset, m.start_offset)
            if m.deleted:
                self.cache.drop_stream(m.stream_id)
        self.reader.add(await self.io(self.meta.ranges))
        self.wal = DeltaWAL(WALConfig(path=c.wal_path, capacity=c.wal_capacity, node_id=c.node_id,
                                      node_epoch=c.node_epoch,
                                      sync_mode=c.wal_sync_mode,
                                      flush_interval_s=c.wal_flush_interval_s,
                                      io_engine=c.wal_io_engine,
                                      allow_format=c.wal_format,
                                      reformat_taken_over=c.wal_reformat_taken_over))
        recovered = await self.io(lambda: list(self.wal.open()))
        self.wal.attach_loop()
        log.info("WAL written by %s (wal_io_engine=%s)", self.wal.writer, c.wal_io_engine)
        await self._register_wal()
        self._wal_trimmed = self.wal.trim_offset
        self._recover(recovered)
        self._tasks = [asyncio.create_task(self._upload_loop(), name="s3kafka-uploader"),
                       asyncio.create_task(self.maintenance.run(), name="s3kafka-maintenance")]
        self.cold_pacer.start()
        if self.cache.pending:
            self.request_upload("recovery")
        elif recovered:
            last_off, last_body = recovered[-1]
            await self.io(self.wal.trim, last_off + WAL_RECORD_HEADER + len(last_body))

    async def _check_fenced(self) -> None:
        """Once a second: has another node taken this WAL over (this node is a zombie: paused
        or partitioned past its lease)? Then the WAL stops, appends fail, uploads are refused
        by the metadata store; logged once. One 8 KiB read."""
        if self.wal_fenced or self.wal is None:
            return
        now = time.monotonic()
        if now - self._fence_checked < 1.0:
            return
        self._fence_checked = now
        try:
            await self.io(self.wal.check_fenced)
        except self.fenced_error as e:
            self.wal_fenced = True
            log.error("this node's WAL was taken over by another node; appends and uploads "
                      "stop: %s", e)
        except Exception as e:             # noqa: BLE001 - a failed read is the WAL's episode
            log.debug("WAL fence check failed: %s", e)

    async def _register_wal(self) -> None:
        """Record this node's WAL (path, device, capacity, epoch) in the metadata store, where
        a controller finds it to hand it to a taker (storage/takeover.py)."""
        from .takeover import wal_identity
        c = self.config
        try:
            info = wal_identity(c.wal_path, c.node_id, c.node_epoch, c.wal_capacity)
            if not await self.io(self.meta.register_wal, info):
                log.warning("WAL registry holds a newer epoch of node %d than %d: not updated",
                            c.node_id, c.node_epoch)
        except Exception as e:            # the registry is for failover; serving goes on
            log.warning("could not register the WAL in the metadata store: %s", e)

    async def take_over_wal(self, path: str, node_id: int, node_epoch: int,
                            taker_epoch: int, force_lock: bool = False) -> Any:
        """Take over node ``node_id``'s WAL at ``path`` (fenced at ``node_epoch``) for this
        node at ``taker_epoch``: fence it, commit its records through this engine's metadata
        and object stores, mark it done (storage/takeover.py). Never touches this node's own
        WAL. Returns a storage.takeover.TakeoverResult; streams opened here afterwards (e.g.
        acquire_stream) see the recovered records."""
        from .takeover import take_over_wal
        c = self.config
        res = await self.io(functools.partial(
            take_over_wal, path, node_id=node_id, node_epoch=node_epoch, taker=c.node_id,
            taker_epoch=taker_epoch, meta=self.meta, store=self.store,
            own_wal_path=c.wal_path, force_lock=force_lock,
            object_block_bytes=c.object_block_bytes))
        if res.lost:
            # records of these streams are lost (a gap or another owner): the streams open
            # at their committed end; counted for alerting (s3kafka_takeover_lost_streams_total)
            # besides the ERROR lines (issue 17; docs/cluster.md)
            self.stats.takeover_lost_streams += len(res.lost)
        return res

    def _recover(self, records: list[tuple[int, bytes]]) -> None:
        """Re-append WAL records not yet committed to objects into the cache, in order."""
        n = dropped = 0
        gap: set[int] = set()
        for off, body in records:
            if len(body) < WAL_RECORD.size:
                dropped += 1
                continue
            sid, base, count = WAL_RECORD.unpack_from(body)
            s = self.streams.get(sid)
            if s is None or s.deleted or sid in gap or count <= 0:
                dropped += 1
                continue
            if base + count <= s._end:
                continue                         # already committed to an object
            if base != s._end:
                log.error("[BUG] WAL data may be lost: stream %d expects %d, WAL has %d",
                          sid, s._end, base)
                gap.add(sid)
                continue
            e = CacheEntry(sid, base, count, memoryview(body)[WAL_RECORD.size:], off,
                           off + WAL_RECORD_HEADER + len(body), durable=True)
            self.cache.add(e)
            s._end = s._confirmed = e.next_offset
            self._wal_head = max(self._wal_head, e.wal_next)
            n += 1
        if records:
            log.info("WAL recovery: %d records replayed, %d dropped", n, dropped)

    async def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        self._room.set()
        # one last upload so the next start has little to replay (best effort)
        if self._loop is None or self.wal is None:
            self._executor.shutdown(wait=False)
            self._cold_executor.shutdown(wait=False)
            return
        try:
            await asyncio.wait_for(self._drain_uploads(), timeout=10)
        except (asyncio.TimeoutError, Exception) as e:  # the WAL still has it
            log.warning("final upload skipped: %s", str(e) or type(e).__name__)
        await self.cold_pacer.stop()
        for t in self._tasks:
            t.cancel()
        await end_tasks(self._tasks, STOP_WAIT_S, log, "storage close")
        for closer in (getattr(self.wal, "close", None), getattr(getattr(self, "meta", None), "close", None),
                       getattr(getattr(self, "store", None), "close", None)):
            if closer is not None:
                try:
                    await self.io(closer)
                except Exception as e:      # keep closing the rest
                    log.warning("close: %s", e)
        self._executor.shutdown(wait=True)
        self._cold_executor.shutdown(wait=True)

    async def _drain_uploads(self) -> None:
        while self.cache.pending or self._uploading:
            if self._uploading:
                await asyncio.sleep(0.01)
                continue
            entries = self.cache.take_pending(self.config.upload_max_bytes)
            if not entries:
                await asyncio.sleep(0.001)
                continue
            try:
                await self._upload(entries)
            except Exception:
                self.cache.return_pending(entries)
                raise

    # -- streams ----------------------------------------------------------------------------
    async def create_stream(self) -> Stream:
        sid = await self.io(self.meta.create_stream)
        s = EngineStream(self, StreamMeta(sid, 0, 0, False))
        self.streams[sid] = s
        self.cache.set_stream_state(sid, 0, 0)
        return s

    async def open_stream(self, stream_id: int) -> Stream:
        s = self.streams.get(stream_id)
        if s is None or s.deleted:
            raise StorageError(f"no stream {stream_id}")
        return s

    async def delete_stream(self, stream_id: int) -> None:
        s = self.streams.get(stream_id)
        if s is None:
            return
        s.deleted = True                 # from here on no upload groups its entries
        # ...but one in flight may have grouped them already: a streamed put reads its
        # object's payloads while it writes (StreamEncoder), and dropping the stream releases
        # them (the frame pool reuses the memory), which failed that upload or could encode
        # another request's bytes in their place. So they are dropped once no upload holds
        # the stream (each attempt of a failing upload ends, so an outage does not hold this)
        await self._until_uploads_hold(stream_id, 0, time.monotonic() + DELETE_WAIT_S, 0.005)
        self.cache.drop_stream(stream_id)
        await self.io(self.meta.delete_stream, stream_id)

    async def _until_uploads_hold(self, stream_id: int, at_most: int, deadline: float,
                                  poll_s: float) -> None:
        """Wait until at most ``at_most`` uploads in flight hold entries of ``stream_id``
        (``_inflight_streams``), or until ``deadline`` (monotonic), polling every ``poll_s``."""
        while self._inflight_streams[stream_id] > at_most and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)

    # -- handing streams between nodes (a cluster sharing one object store) ----------------
    async def release_stream(self, stream_id: int, upload: bool = True) -> int:
        """Close a stream for handoff: wait for its appends in flight, upload everything
        pending (so its whole log is in the object store), stop accepting appends. Returns
        the committed end offset the next owner continues from."""
        s = self.streams.get(stream_id)
        if s is None:
            return 0
        s.owned = False                       # no new appends from here on
        if upload:
            deadline = time.monotonic() + 30
            while s._confirmed < s._end and time.monotonic() < deadline:
                await asyncio.sleep(0.002)     # appends in flight reach the WAL first
            # upload only this stream's pending entries, out of WAL order: a move waited for
            # the whole backlog ahead of the stream's last record (seconds on S3 under a
            # flat-out load). The WAL stays trimmed only up to the first entry still pending
            # (or in flight elsewhere), so skipping ahead never trims another stream's
            # records. Entries of this stream another upload holds (the upload loop) are
            # waited for: a stream's objects commit in offset order.
            # Entries of this stream another upload holds (the upload loop) are not waited
            # for before starting: this upload writes its object meanwhile and waits only
            # before its commit (a stream's objects commit in offset order).
            t0 = time.monotonic()
            waited = 0.0

            async def after_earlier(first: int) -> None:
                nonlocal waited
                t = time.monotonic()
                # the uploader commits them first
                await self._until_uploads_hold(stream_id, 1, deadline, 0.002)
                waited += time.monotonic() - t
                if s.committed < first:                 # its upload failed: ours waits too
                    raise _EarlierNotCommitted(f"stream {stream_id}: offsets {s.committed}.."
                                               f"{first} are not committed yet")
            while s.committed < s._end and time.monotonic() < deadline:
                entries = self.cache.take_pending_stream(stream_id,
                                                         self.config.upload_max_bytes)
                if not entries:
                    await asyncio.sleep(0.001)          # not durable yet / being committed
                    continue
                first = entries[0].base_offset
                try:
                    await self._upload(entries, lambda: after_earlier(first))
                except _EarlierNotCommitted:
                    self.cache.return_pending(entries)  # taken again with the earlier ones
                    await asyncio.sleep(0.01)
                    continue
                except Exception:
                    self.cache.return_pending(entries)
                    raise
            took = time.monotonic() - t0
            if took > 0.5:
                log.info("release of stream %d: uploads took %.0f ms, of which %.0f ms "
                         "waiting for an earlier upload of its entries", stream_id,
                         took * 1000, waited * 1000)
            if s.committed < s._end:
                raise StorageError(f"stream {stream_id}: only {s.committed} of {s._end} "
                                   "offsets reached the object store")
        return s.committed

    async def acquire_stream(self, stream_id: int, epoch: int) -> Stream:
        """Open a stream another node wrote, at ``epoch``: claim it in the metadata store
        (compare-and-set: a lower epoch never wins, and the previous owner's commits are
        refused from then on), then take its committed state and objects from the store.
        Appends continue from the committed end offset."""
        c = self.config
        if not await self.io(self.meta.claim_stream, stream_id, c.node_id, epoch):
            raise StorageError(f"stream {stream_id} is claimed at an epoch above {epoch}")
        m = await self.io(self.meta.stream, stream_id)
        if m is None or m.deleted:
            raise StorageError(f"no stream {stream_id}")
        ranges = await self.io(self.meta.stream_ranges, stream_id)
        self._foreign.discard(stream_id)
        s = self.streams.get(stream_id)
        if s is None:
            s = self.streams[stream_id] = EngineStream(self, m)
        else:
            s._start, s._end, s._confirmed, s.committed = (m.start_offset, m.end_offset,
                                                           m.end_offset, m.end_offset)
        s.owned = True
        self.cache.reset_stream(stream_id, m.end_offset, m.start_offset)
        self.reader.replace_stream(stream_id, ranges)
        return s

    async def written_elsewhere(self, stream_id: int) -> bool:
        """Whether another node wrote the stream after this node loaded its view of it (at
        engine start): a partition handed to a broker while it starts. Its committed end in
        the database is then past this node's view (or another node claimed it last), and
        opening the stale view would append over records another node acknowledged; such a
        stream is opened with ``acquire_stream`` at the assignment's epoch instead. A stream
        this node wrote last keeps its view: its WAL may hold a tail not uploaded yet."""
        m = await self.io(self.meta.stream, stream_id)
        if m is None or m.deleted:
            return False
        s = self.streams.get(stream_id)
        if s is None or m.end_offset > s.end_offset:
            return True
        owner = await self.io(self.meta.stream_owner, stream_id)
        return owner is not None and owner[0] != self.config.node_id

    def disown_stream(self, stream_id: int) -> None:
        """A stream this node knows but another node writes (cluster start-up)."""
        s = self.streams.get(stream_id)
        if s is not None:
            s.owned = False

    # -- upload -----------------------------------------------------------------------------
    def _upload_pause(self) -> float:
        """Seconds a background upload's encode waits after each slice: none while anything
        waits for the upload (a forced upload: WAL or cache full, shutdown; a backlog of two
        upload thresholds; cache pressure; a quarter of the WAL used), else UPLOAD_PAUSE_S."""
        c = self.config
        if (self._force_upload or self.cache.pending_bytes >= 2 * c.upload_threshold_bytes
                or self._cache_pressure()
                or self._wal_head - self._wal_trimmed > c.wal_capacity // 4):
            return 0.0
        return UPLOAD_PAUSE_S

    def _upload_urgent(self) -> bool:
        """Appends wait on the upload now or are about to: a forced upload (the cache or the
        WAL was full: producers back-pressured; recovery), half the LogCache unuploaded, or the
        WAL past half its capacity. Its puts then run URGENT_PUTS_IN_FLIGHT at a time. The
        cache's room counts what uploads in flight took (not evictable before their commit),
        so the backlog does, not only the pending queue a round's take just emptied."""
        return (self._force_upload or self._backlog_bytes() >= self._pressure_at
                or self._wal_head - self._wal_trimmed > self.config.wal_capacity // 2)

    def _puts_in_flight(self, gentle: bool) -> int:
        """How many puts an upload keeps in flight before it waits for one to end: one for a
        gentle one (see _gentle_writes), more while appends wait on it (_upload_urgent), else
        PUTS_IN_FLIGHT."""
        if gentle:
            return 1
        return URGENT_PUTS_IN_FLIGHT if self._upload_urgent() else PUTS_IN_FLIGHT

    def _cache_pressure(self) -> bool:
        """Half the LogCache holds unuploaded data: upload before appends hit back-pressure.
        (Counting evictable, already uploaded entries would keep a warm cache - which stays
        ~90 % full - uploading a tiny object after every append.)"""
        return self.cache.pending_bytes >= self._pressure_at

    def request_upload(self, why: str) -> None:
        """Upload whatever is pending now (cache/WAL pressure, shutdown, tests)."""
        self._force_upload = True
        self._upload_wakeup.set()

    async def wait_for_room(self, timeout: float) -> None:
        self._room.clear()
        await wait_event(self._room, max(timeout, 0.001))

    async def flush(self) -> None:
        """Upload everything appended so far and trim the WAL (tests, shutdown)."""
        await self._drain_uploads()

    def refresh_fixed_buffers(self) -> None:
        """The WAL's io_uring registers new frame arena slabs now, on the calling thread
        (broker/frames.py's filler, after it grew the arena), not in a produce request."""
        wal = self.wal
        if wal is not None:
            wal.refresh_fixed_buffers()

    def drop_caches(self) -> None:
        """Evict every committed cache entry and the block cache: reads go to the store."""
        self.cache.drop_all_committed()
        self.reader.block_cache.clear()

    async def _upload_loop(self) -> None:
        backoff = 0.1
        c = self.config
        while True:
            await wait_event(self._upload_wakeup, min(c.upload_interval_s, 1.0))
            self._upload_wakeup.clear()
            await self._check_fenced()
            self.wal_full.expire()
            self.backpressure.expire()
            while self.cache.pending:
                if not self.writes_allowed():
                    self.writes_paused.hit("lease lapsed: no uploads, commits or WAL trims "
                                           "until it is renewed")
                    break
                self.writes_paused.clear()
                due = (self._force_upload
                       or self.cache.pending_bytes >= c.upload_threshold_bytes
                       or time.monotonic() - self._last_upload >= c.upload_interval_s
                       or self._wal_head - self._wal_trimmed > c.wal_capacity // 2
                       or self._cache_pressure())
                if not due:
                    break
                self._uploading = True      # a drain waits for this upload from its take on
                try:
                    entries, key_ = await self._take_for_upload(c.upload_max_bytes)
                except BaseException:
                    self._uploading = False
                    raise
                if not entries:
                    self._uploading = False
                    await asyncio.sleep(0.001)      # head not durable yet
                    continue
                try:
                    await self._upload(entries, key_=key_, background=True)
                    backoff = 0.1
                    self.store_failing.clear()
                except asyncio.CancelledError:
                    self.cache.return_pending(entries)
                    raise
                except Exception as e:
                    self.cache.return_pending(entries)
                    self.upload_errors += 1
                    # once per episode, not per retry: a long outage retries every 2 s
                    self.store_failing.hit(f"upload failed, retrying with backoff: {e}")
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                finally:
                    self._uploading = False
            if not self.cache.pending:
                self._force_upload = False
                self._last_upload = time.monotonic()

    async def _trim_point(self, entries: list[CacheEntry], key_: int) -> int:
        """How far the WAL may be trimmed after committing ``entries``: up to the first entry
        still pending, but never past an entry another upload holds in flight (a release's
        drain beside the upload loop: its commit may still fail) nor past dropped entries of
        a stream another node claimed until the store's end of that stream covers them."""
        to = self.cache.pending[0].wal_offset if self.cache.pending else \
            max(map(_WAL_NEXT, entries), default=0)    # (C-level: ~46,000 small entries)
        for sid, (w0, end) in list(self._held.items()):
            m = await self.io(self.meta.stream, sid)
            if m is None or m.deleted or m.end_offset >= end:
                del self._held[sid]           # committed by someone (or gone): free to trim
                log.info("stream %d: the store's end covers the records dropped here; the "
                         "WAL may be trimmed past them", sid)
            else:
                to = min(to, w0)
        for k, w0 in self._inflight.items():
            if k != key_:
                to = min(to, w0)
        return to

    def _take_encode_buffer(self, size: int) -> Any:
        """A reusable encode buffer that ``size`` fits (taken: the next object is encoded
        while the previous ones are written, and a drain may upload beside the upload loop), a
        new one (rounded up to a power of two, so growing objects do not allocate every
        time), or None above ENCODE_BUFFER_MAX (the encoder allocates)."""
        bufs = self._encode_bufs
        for i, buf in enumerate(bufs):
            if len(buf) >= size:
                return bufs.pop(i)
        if size > ENCODE_BUFFER_MAX:
            return None
        # at least the size an object of OBJECT_SPLIT_BYTES needs: a mapping's pages are
        # faulted in only as they are written, so the room costs nothing until used, and the
        # first upload's smaller objects (~16 MiB per stream) no longer make buffers that the
        # later 28 MiB objects replace with new ones - fresh huge pages cost 2.0-2.3 s of CPU
        # per GiB on the test VM, 0.1 s per broker for those three (bench/HISTORY.md, session 25)
        buf = mmap.mmap(-1, min(ENCODE_BUFFER_MAX, 1 << (max(size, ENCODE_BUFFER_MIN) - 1)
                                .bit_length()), flags=mmap.MAP_PRIVATE)
        # huge pages where the kernel allows (advice only): the put's O_DIRECT writes pin
        # 2 MiB pages instead of 512 small ones each. Writing 28 MiB objects from a reused
        # buffer, 1 MiB O_DIRECT pieces: 0.05-0.08 ms CPU per MiB instead of 0.11-0.14
        # (bench/HISTORY.md, session 15); the buffers are kept, so the huge pages are faulted
        # in once.
        if len(buf) >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        return buf

    def _give_encode_buffer(self, buf: Any) -> None:
        """Keep ``buf`` for the next object; at most ENCODE_BUFFERS, the largest ones."""
        if buf is None:
            return
        bufs = self._encode_bufs
        bufs.append(buf)
        if len(bufs) > ENCODE_BUFFERS:
            bufs.sort(key=len, reverse=True)
            del bufs[ENCODE_BUFFERS:]

    def _gentle_writes(self) -> bool:
        """The store's ``gentle_writes`` (any thread): a background upload of small records
        is being written and nothing waits for it (``_upload_pause``): its device writes go
        in small pieces, so the WAL writes of the small appends beside it (acks=all latency)
        queue behind less object data."""
        return self._gentle_puts > 0 and self._upload_pause() > 0

    async def _put_object(self, key: str, data: Any, into: Any, kind: str,
                          gentle: bool = False) -> None:
        """Write one encoded object, then hand its encode buffer back (``gentle``: an object
        of small records of a background upload, see _gentle_writes)."""
        self._gentle_puts += gentle
        try:
            await self.io(self.store.put, key, data)
            self.stats.objects_written[kind] += 1
            self.stats.uploaded_bytes += len(data)
        finally:
            self._gentle_puts -= gentle
            if isinstance(data, memoryview):
                data.release()
            data = None
            self._give_encode_buffer(into)

    async def _encode_whole(self, recs: list[Any], into: Any, size: int, small: bool,
                            pause: Callable[[], float]) -> tuple[Any, list[Any]]:
        """Encode one object whole into ``into`` (a store that takes no PutSource, or no C
        encoder): (the object's bytes, its ranges)."""
        block = self.config.object_block_bytes
        if not small or NATIVE_ENCODE:
            # large records, or any with the C encoder: the copies run with the GIL released,
            # so the IO thread encodes without holding the loop (the C encoder holds it only
            # to gather each block's records; loop_slices.py: without it, small records'
            # Python work per record would hold it)
            data, _index, ranges = await self.io(encode_object_into, recs, block, into, size)
        else:
            # small records (per-record Python work on the loop): while nothing waits for this
            # upload, a pause after each slice keeps its share of the loop to about a
            # quarter, so hot requests are not starved meanwhile
            data, _index, ranges = await encode_object_in_slices(
                recs, block, into=into, size=size, pause=pause)
        return data, ranges

    async def _take_for_upload(self, max_bytes: int) -> tuple[list[CacheEntry], int]:
        """``cache.take_pending(max_bytes)`` in chunks of TAKE_SLICE entries with a yield in
        between (an upload of small produce requests takes tens of thousands: one step was a
        5-8 ms event-loop stall; the yield waits ``_upload_pause()``), and the key its ``_upload`` runs under. The WAL trim point
        is held at the first pending entry (pending is in WAL order) from before the first
        chunk, so a drain's trim beside it (a partition move) never passes what this upload
        took."""
        cache = self.cache
        if not cache.pending:
            return [], 0
        self._take_key += 1
        key_ = -self._take_key             # never an id() (the keys _upload makes itself)
        self._inflight[key_] = cache.pending[0].wal_offset
        out: list[CacheEntry] = []
        taken = 0
        # grouped by stream as they are taken, for _upload_entries (one C pass per chunk)
        groups, cums = self._take_groups[key_] = ({}, {})
        try:
            while True:
                n = len(out)
                taken += cache.take_grouped(max_bytes - taken, TAKE_SLICE, not out, out,
                                            groups, cums)
                if out:                      # counted in the backlog from its take on
                    self._upload_takes[key_] = (taken, out[0])
                if len(out) - n < TAKE_SLICE or not cache.pending:
                    break
                await asyncio.sleep(self._upload_pause())
        except BaseException:
            cache.return_pending(out)
            self._inflight.pop(key_, None)
            self._upload_takes.pop(key_, None)
            self._take_groups.pop(key_, None)
            raise
        if not out:
            self._inflight.pop(key_, None)
            self._take_groups.pop(key_, None)
        return out, key_

    async def _upload(self, entries: list[CacheEntry],
                      before_commit: Callable[[], Any] | None = None,
                      key_: int | None = None, background: bool = False) -> None:
        """Write entries as objects, commit them, trim the WAL, release the cache
        (``before_commit``: awaited after the objects are written, before their commit;
        ``key_``: the in-flight mark _take_for_upload already holds for them;
        ``background``: the upload loop's, paced while nothing waits for it)."""
        if key_ is None:
            key_ = id(entries)
            # C-level pass: an upload holds tens of thousands of entries
            self._inflight[key_] = min(map(_WAL_OFFSET, entries)) if entries else 1 << 62
        grouped = self._take_groups.pop(key_, None)
        sids = set(map(_STREAM_ID, entries)) if grouped is None else set(grouped[0])
        self._inflight_streams.update(sids)
        if entries and key_ not in self._upload_takes:   # (_take_for_upload sized its take)
            self._upload_takes[key_] = (sum(map(_SIZE, entries)), entries[0])
        try:
            await self._upload_entries(entries, key_, before_commit, background, grouped)
        finally:
            self._inflight.pop(key_, None)
            self._inflight_streams.subtract(sids)
            self._upload_takes.pop(key_, None)

    def upload_backlog(self) -> tuple[int, list[CacheEntry]]:
        """Bytes appended and not uploaded yet: the cache's pending queue and what uploads in
        flight took from it (during an object store outage the upload being retried holds
        all of it, and pending alone read 0); and the oldest entry of each of those."""
        firsts = [first for _, first in self._upload_takes.values()]
        if self.cache.pending:
            firsts.append(self.cache.pending[0])
        return self._backlog_bytes(), firsts

    def _backlog_bytes(self) -> int:
        """upload_backlog's bytes: the pending queue and what uploads in flight took."""
        return self.cache.pending_bytes + sum(n for n, _ in self._upload_takes.values())

    async def _commit_outcome(self, exc: BaseException, object_ids: list[int]) -> str:
        """"committed", "failed" or "unknown" for a commit that raised. One whose COMMIT was
        sent may have committed (the answer was lost with the connection): the objects'
        state is read back. Deleting committed objects as if the upload had failed lost
        committed records (the 30-minute chaos run: an object a partition's committed ranges
        point to gone from the store)."""
        if not sqldb.commit_outcome_unknown(exc):
            return "failed"
        for attempt in range(3):
            try:
                states = await self.io(self.meta.object_states, object_ids)
            except Exception:  # noqa: BLE001 - still unreachable: try again, then unknown
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            if object_ids and all(states.get(o) == "committed" for o in object_ids):
                log.warning("upload: the commit of %d objects answered an error after it "
                            "reached the database; they are committed", len(object_ids))
                return "committed"
            if all(states.get(o) == "prepared" for o in object_ids):
                return "failed"
            return "unknown"
        return "unknown"

    def _check_writes(self) -> None:
        if not self.writes_allowed():
            raise StorageError("lease lapsed: this node commits and trims nothing until it "
                               "is renewed")

    async def _upload_entries(self, entries: list[CacheEntry], key_: int,
                              before_commit: Callable[[], Any] | None = None,
                              background: bool = False,
                              grouped: tuple[dict[int, list[CacheEntry]],
                                             dict[int, list[int]]] | None = None) -> None:
        """Encode, write and commit ``entries``, then trim the WAL and release the cache
        (``grouped``: the entries by stream and their running payload sums, as
        _take_for_upload's LogCache.take_grouped made them; else grouped here)."""
        c = self.config
        # one pass over the entries (tens of thousands for small produce requests), in
        # slices on the loop (storage/loop_slices.py): unsliced it was a ~50 ms stall
        # the entries themselves are the records to encode (stream_id, base_offset, count,
        # payload, end_offset): no Record built and freed per entry
        by_stream: dict[int, list[Any]] = {}
        sizes: dict[int, int] = {}
        foreign: set[int] = set()
        streams, not_ours = self.streams, self._foreign
        clock = time.perf_counter
        until = clock() + SLICE_S
        # a background upload waits after each slice of its loop passes while nothing waits
        # for it (_upload_pause), so its share of the loop stays about a third: at a tenth of
        # the maximum produce rate the loop itself is busy most of the time, and an upload's
        # ~45,000 entries taken, grouped and summed back to back queued requests behind them
        pause = self._upload_pause if background else no_pause

        def committable(sid: int) -> Any:
            """The stream ``sid``'s taken entries may be committed to, or None: one another
            node claimed (noted in ``foreign``: never committable, dropped below) or one
            deleted meanwhile. Called once per stream run, not per entry."""
            if sid in not_ours:
                foreign.add(sid)
                return None
            s = streams.get(sid)
            return None if s is None or s.deleted else s

        cums: dict[int, Any] = {}            # stream -> its records' running payload sums
        if grouped is not None:
            # grouped as they were taken: Python work per stream, not per entry
            for sid, run in grouped[0].items():
                s = committable(sid)
                if s is None:
                    continue
                if run[0].base_offset < s.committed:
                    # some are committed already (a drain's upload beside this one): rare
                    run = [e for e in run if e.next_offset > s.committed]
                    if not run:
                        continue
                else:
                    cums[sid] = grouped[1][sid]
                by_stream[sid] = run
                sizes[sid] = cums[sid][-1] if sid in cums else \
                    sum(map(len, map(_PAYLOAD, run)))
        # per chunk of entries: sorted by stream (stable: each stream's entries keep their
        # order) and cut into runs by C-level passes; Python work per run, not per entry (the
        # loop over every entry was ~1 us each, ~45 ms of loop time per 64 MiB upload)
        for lo in range(0, len(entries) if grouped is None else 0, GROUP_CHUNK):
            chunk = entries[lo:lo + GROUP_CHUNK]
            chunk.sort(key=_STREAM_ID)
            for sid, it in itertools.groupby(chunk, _STREAM_ID):
                s = committable(sid)
                if s is None:
                    continue
                run = list(it)
                if min(map(_BASE_OFFSET, run)) < s.committed:
                    # some may be committed already (a drain's upload beside this one)
                    run = [e for e in run if e.next_offset > s.committed]
                recs = by_stream.get(sid)
                if recs is None:
                    recs = by_stream[sid] = []
                    sizes[sid] = 0
                recs.extend(run)
                sizes[sid] += sum(map(len, map(_PAYLOAD, run)))
            if clock() >= until:
                await asyncio.sleep(pause())
                until = clock() + SLICE_S
        groups: list[tuple[str, list[Any], int]] = []     # (kind, records, payload bytes)
        sso: list[Any] = []
        sso_bytes = 0
        sso_cum: list[int] | None = []       # None: a stream's sums are missing
        for sid in sorted(by_stream):
            recs = by_stream[sid]
            cum = cums.get(sid)
            if sizes[sid] >= c.stream_object_threshold_bytes:
                if cum is None:
                    cum = await _payload_cumsum(recs, pause)
                groups.extend(("so", part, n) for part, n in _split_records(recs, cum=cum))
            else:
                if cum is None:
                    sso_cum = None
                elif sso_cum is not None:    # (one stream's sums: below 8 MiB of records)
                    sso_cum.extend(map(sso_bytes.__add__, cum) if sso_bytes else cum)
                    if clock() >= until:
                        await asyncio.sleep(pause())
                        until = clock() + SLICE_S
                sso.extend(recs)
                sso_bytes += sizes[sid]
        by_stream.clear()
        cums.clear()
        if sso:
            cum = sso_cum if sso_cum is not None else await _payload_cumsum(sso, pause)
            groups.extend(("sso", part, n) for part, n in _split_records(sso, cum=cum))
        new: list[tuple[NewObject, str, str]] = []
        prepared: list[tuple[int, str]] = []
        unknown = False          # a commit whose outcome could not be read back
        writing: set[asyncio.Future] = set()      # puts in flight
        # the next object's metadata row, prepared while this one is encoded and written, while
        # appends wait on this upload (_upload_urgent): a prepare is a durable SQLite commit on
        # the disk the puts keep busy (median 5 ms, p90 10 ms under raw produce), which held
        # every object's encode and put behind it. Otherwise one at a time, as before: nothing
        # waits, and the small-record uploads beside latency-sensitive appends stay unchanged
        ahead: asyncio.Future | None = None
        # objects produced while they are written (a few MiB of buffer per put: see
        # StreamEncoder), where the store takes that and the C encoder is built
        stream = STREAM_ENCODE and getattr(self.store, "streams_puts", False)
        # ... or the large payloads written straight from their frames (GatherSource)
        gather = c.object_gather_writes and getattr(self.store, "gathers_puts", False)
        try:
            for i, (kind, recs, payload) in enumerate(groups):
                this, ahead = ahead, None
                oid, key = await (this or self.io(self.meta.prepare_object, kind, c.node_id))
                prepared.append((oid, key))
                if i + 1 < len(groups) and self._upload_urgent():
                    ahead = asyncio.ensure_future(
                        self.io(self.meta.prepare_object, groups[i + 1][0], c.node_id))
                small = payload < NOGIL_COPY_FROM * len(recs)
                into = None
                # large records (a few hundred at most: laid out in one C call) with their
                # WAL-checked CRCs: written from their frames, not copied (GatherSource)
                data = gather_source(recs, c.object_block_bytes) if gather and not small \
                    else None
                if data is not None:
                    ranges = data.ranges
                else:
                    size = await object_size_in_slices(recs, c.object_block_bytes, pause=pause)
                    if stream:
                        # encoded a window at a time by the put itself (FileObjectStore.put of
                        # a StreamEncoder): a few MiB of buffer per put in flight, not the
                        # object; its ranges list fills as it is encoded, complete once the
                        # put returned
                        data = StreamEncoder(recs, c.object_block_bytes, size)
                        ranges = data.ranges
                    else:
                        # encode buffers reused across uploads (taken while in use: the
                        # previous objects are written meanwhile, a drain may upload beside the
                        # loop): fresh memory faults a page per 4 KiB
                        into = self._take_encode_buffer(size)
                        data, ranges = await self._encode_whole(recs, into, size, small, pause)
                size = len(data)
                new.append((NewObject(oid, size, ranges), key, kind))
                # written while the next ones are encoded, _puts_in_flight at a time (one
                # at a time for a background upload of small records: the WAL writes of the
                # small appends beside it queue behind one put's piece, not two)
                gentle = background and small and self._upload_pause() > 0
                while len(writing) >= self._puts_in_flight(gentle):
                    await _put_ended(writing)
                writing.add(asyncio.ensure_future(
                    self._put_object(key, data, into, kind, gentle)))
                data = None
            while writing:
                await _put_ended(writing)
            if before_commit is not None:
                await before_commit()
            crash_point("before_commit")
            self._check_writes()
            if new:
                # conditioned on this node's WAL not being taken over (a zombie never
                # commits what a taker commits: storage/takeover.py)
                try:
                    await self.io(self.meta.commit_objects, [n for n, _, _ in new], [], None,
                                  (c.node_id, c.node_epoch))
                except Exception as exc:
                    outcome = await self._commit_outcome(exc, [n.object_id for n, _, _ in new])
                    if outcome != "committed":
                        unknown = outcome == "unknown"
                        raise
        except Exception as exc:
            if writing:                      # never forget an object still being written
                await asyncio.wait(writing)
                for w in writing:
                    if not w.cancelled():
                        w.exception()        # retrieved: this upload fails with ``exc``
            if ahead is not None:            # a row prepared for an object never written
                try:
                    prepared.append(await ahead)
                except Exception:  # noqa: BLE001 - not prepared: nothing to forget
                    pass
            if unknown:
                # the commit may have landed and could not be read back: never delete what
                # the store's metadata may point to (still prepared ones are removed at the
                # next start; committed ones are this stream's data)
                log.warning("upload: commit outcome unknown, keeping objects %s: %s",
                            [k for _, k in prepared], exc)
            else:
                # never committed: delete them later (or at the next start, from their rows)
                self.maintenance.forget_later(prepared)
            sid = getattr(exc, "stream_id", None)
            if isinstance(exc, StreamFenced) and sid is not None and sid not in self._foreign:
                # another node claimed the stream (a move or takeover this node missed):
                # retrying would block every upload behind these entries for good, so the
                # next attempt leaves them out (the new owner's log is the stream's log)
                self._foreign.add(sid)
                mine = [e for e in entries if e.stream_id == sid]
                s = self.streams.get(sid)
                if s is not None:
                    s.owned = False
                log.error("stream %d is owned by another node: dropping %d records at offsets "
                          "%d..%d appended here that cannot be committed (%s)", sid,
                          sum(e.count for e in mine), mine[0].base_offset if mine else -1,
                          mine[-1].next_offset if mine else -1, exc)
            raise
        crash_point("after_commit")
        for sid in foreign:
            # their entries leave pending and memory, but not the WAL: a taker of this WAL
            # may still commit them (held until the store's end of the stream covers them)
            dropped = [e for e in entries if e.stream_id == sid] + \
                [e for e in self.cache.pending if e.stream_id == sid]
            if dropped:
                w0, end = self._held.get(sid, (1 << 62, 0))
                self._held[sid] = (min(w0, min(e.wal_offset for e in dropped)),
                                   max(end, max(e.next_offset for e in dropped)))
            self.cache.drop_stream(sid)
        # drop the lists of entries encoded (nothing here may outlive the evictions below)
        groups.clear()
        sso.clear()
        recs = []
        added = []
        for obj, key, kind in new:
            for r in obj.ranges:
                added.append(ObjectRange(obj.object_id, key, kind, obj.size, r.stream_id,
                                         r.start_offset, r.end_offset))
                s = self.streams.get(r.stream_id)
                if s is not None:
                    s.committed = max(s.committed, r.end_offset)
                self.cache.mark_committed(r.stream_id, r.end_offset, evict=False)
        self.reader.add(added)
        # evicted in slices: a full cache of small requests frees ~70,000 entries here
        while self.cache.evict_some(EVICT_SLICE):
            await asyncio.sleep(pause())
        trim_to = await self._trim_point(entries, key_)
        # a lease lapsed meanwhile: committed, but the WAL stays as it is (a later upload
        # trims; a taker skips what is committed)
        async with self._trim_lock:      # two uploads' trims never run backwards
            if trim_to > self._wal_trimmed and self.writes_allowed():
                await self.io(self.wal.trim, trim_to)
                self._wal_trimmed = trim_to
        self._last_upload = time.monotonic()
        self.stats.uploads += 1
        self._room.set()
        log.debug("uploaded %d objects (%d entries), WAL trimmed to %d", len(new), len(entries),
                  trim_to)
