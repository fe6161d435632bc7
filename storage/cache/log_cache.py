"""LogCache: every stream's recent batches in memory, bounded, evicted first-in first-out.

Appends land here right after the WAL; reads of the tail never touch the object store. An entry
may be evicted only once the object store holds it (``mark_committed``), so a full cache of
unuploaded data is back-pressure for producers, never loss. Data waiting for upload is kept in
WAL order in ``pending``: the uploader takes a durable prefix, and after the commit the WAL can be
trimmed up to the first entry still pending.
"""
from __future__ import annotations

import asyncio
import bisect
import itertools
import operator
from collections import deque
from typing import Any, Callable

from ..copycrc import _copycrc_module
from ..stream import Batch
from ..waits import wait_event

# the upload's take in one C pass (storage/_copycrc.c; None without the extension)
_take_grouped = getattr(_copycrc_module, "take_grouped", None)
# an entry off the cyclic collector's lists (None without the extension: entries stay tracked)
_gc_untrack = getattr(_copycrc_module, "gc_untrack", None)
_STREAM_ID = operator.attrgetter("stream_id")
_PAYLOAD = operator.attrgetter("payload")


_DURABLE = operator.attrgetter("durable")
_SIZE = operator.attrgetter("size")
_TAKE_CHUNK = 4096
# a cached view of at most this many bytes is kept as a copy (bytes, which the cyclic collector
# does not track) instead of the view: a memoryview and its managed buffer are two tracked
# objects per small Produce request, 2 of the 3 that every young collection had to scan
# (~20,000 of them, 2-7 ms with the event loop stopped; bench/HISTORY.md session 34 gc). The
# copy (~0.1 us for 1 KiB) costs less than scanning them, and frees the request's frame at once.
# Larger payloads stay views: no copy of big frames, which the frame pool recycles (``recycle``)
SMALL_COPY = 8 << 10


class CacheEntry:
    """One appended payload plus where it sits in the WAL."""

    __slots__ = ("stream_id", "base_offset", "count", "payload", "wal_offset", "wal_next",
                 "durable", "size", "added", "check")

    def __init__(self, stream_id: int, base_offset: int, count: int, payload: bytes,
                 wal_offset: int = -1, wal_next: int = -1, durable: bool = False,
                 added: float = 0.0, check: tuple[int, int] | None = None) -> None:
        self.stream_id = stream_id
        self.base_offset = base_offset
        self.count = count
        if type(payload) is memoryview and payload.nbytes <= SMALL_COPY:
            payload = bytes(payload)
        self.payload = payload
        self.wal_offset = wal_offset
        self.wal_next = wal_next
        self.durable = durable
        self.size = len(payload) + 64
        self.added = added          # time.perf_counter() at the append (0: recovered)
        # (split, crc): the CRC-32C of payload[split:], checked by the WAL's pass over the
        # record at its append (None: not checked there). The upload then writes a large
        # payload straight from its memory and carries its block CRC instead of computing it
        # (storage/objects/format.py GatherSource)
        self.check = check
        if _gc_untrack is not None:
            # numbers and a byte payload: never in a reference cycle, freed by its refcount.
            # Tracked, the ~1 entry per Produce request was the bulk of every young collection
            _gc_untrack(self)

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count

    @property
    def end_offset(self) -> int:
        """As ``objects.format.Record.end_offset``: the uploader encodes entries as records
        directly (no Record per entry: tens of thousands per upload of small requests)."""
        return self.base_offset + self.count


class _StreamCache:
    """One stream's cached entries, sorted by offset; evicted from the front."""

    __slots__ = ("entries", "bases", "head", "committed", "start")

    def __init__(self) -> None:
        self.entries: list[CacheEntry] = []
        self.bases: list[int] = []
        self.head = 0
        self.committed = 0          # offsets below are in the object store
        self.start = 0              # offsets below were trimmed away

    def index(self, offset: int) -> int:
        """Index of the entry holding ``offset`` (or the first one after it; ``head`` when
        ``offset`` is older than everything cached)."""
        return max(bisect.bisect_right(self.bases, offset, lo=self.head) - 1, self.head)

    def pop_front(self) -> None:
        self.head += 1
        if self.head >= 1024 and self.head * 2 >= len(self.entries):
            del self.entries[:self.head]
            del self.bases[:self.head]
            self.head = 0


class LogCache:
    """Bounded FIFO cache of all streams' tails."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.pending: deque[CacheEntry] = deque()     # not yet taken by an upload, WAL order
        self.pending_bytes = 0
        self._fifo: deque[CacheEntry] = deque()
        self._streams: dict[int, _StreamCache] = {}
        self._space = asyncio.Event()
        # called with [payload] of each evicted entry, the only reference left here (the
        # broker returns produce frames to its pool: fresh memory costs a page fault per
        # 4 KiB, ~0.5 ms per MiB on this VM)
        self.recycle: Callable[[list[Any]], None] | None = None

    def _stream(self, stream_id: int) -> _StreamCache:
        sc = self._streams.get(stream_id)
        if sc is None:
            sc = self._streams[stream_id] = _StreamCache()
        return sc

    def set_stream_state(self, stream_id: int, committed: int, start: int) -> None:
        """Tell the cache how far a stream is committed/trimmed (at open and recovery)."""
        sc = self._stream(stream_id)
        sc.committed = max(sc.committed, committed)
        sc.start = max(sc.start, start)

    def has_room(self, size: int) -> bool:
        """True if ``size`` more bytes fit, evicting committed entries if needed."""
        if self.used + size <= self.capacity:
            return True
        self._evict(self.used + size - self.capacity)
        return self.used + size <= self.capacity

    def add(self, entry: CacheEntry) -> None:
        """Insert an appended entry (the caller checked has_room; the bound is soft by one)."""
        sc = self._streams.get(entry.stream_id)
        if sc is None:
            sc = self._stream(entry.stream_id)
        sc.entries.append(entry)
        sc.bases.append(entry.base_offset)
        self._fifo.append(entry)
        self.pending.append(entry)
        self.pending_bytes += entry.size
        self.used += entry.size

    def take_pending(self, max_bytes: int, max_entries: int | None = None,
                     at_least_one: bool = True) -> list[CacheEntry]:
        """A durable prefix of pending entries (at least one if any, unless ``at_least_one``
        is False; at most ``max_entries``), removed from pending.

        Runs on the event loop in one step, over up to tens of thousands of entries (a 64 MiB
        upload of small produce requests): the entries are scanned in chunks by C-level
        passes (map, accumulate, bisect), not one Python iteration each (which took 17 ms
        for 46,000 entries, an event-loop stall at every upload)."""
        pending = self.pending
        out: list[CacheEntry] = []
        size = 0
        it = iter(pending) if max_entries is None else \
            itertools.islice(pending, max(0, max_entries))
        while True:
            chunk = list(itertools.islice(it, _TAKE_CHUNK))
            if not chunk:
                break
            flags = list(map(_DURABLE, chunk))
            cut = flags.index(False) if False in flags else len(chunk)
            cum = list(itertools.accumulate(map(_SIZE, itertools.islice(chunk, cut)),
                                            initial=size))
            k = bisect.bisect_right(cum, max_bytes, lo=1) - 1   # entries within max_bytes
            if not out and not k and cut and at_least_one:
                k = 1                                          # at least one
            out.extend(itertools.islice(chunk, k))
            size = cum[k]
            if k < len(chunk):
                break
        if out:
            # removed in place by C-level poplefts: rebuilding the deque copied every entry
            # still pending after each chunk an upload takes (O(pending) per chunk)
            deque(itertools.starmap(pending.popleft, itertools.repeat((), len(out))), maxlen=0)
            self.pending_bytes -= size
        return out

    def take_grouped(self, max_bytes: int, max_entries: int, at_least_one: bool,
                     out: list[CacheEntry], groups: dict[int, list[CacheEntry]],
                     cums: dict[int, list[int]], native: bool = True) -> int:
        """``take_pending`` for an upload, grouped as it goes: each entry taken is appended to
        ``out`` (WAL order) and to ``groups[stream_id]`` (offset order), and its stream's
        running payload sum (len(payload)) to ``cums[stream_id]`` (the cut points of the
        objects, engine._split_records); returns the bytes (``size``) taken. One C pass over
        the entries when the extension is built (``native``): the take, the upload's grouping
        by stream and its payload sums were ~6 passes of ~0.04-0.3 us per entry each, 30-45 ms
        of event-loop time per 64 MiB of small produce requests (bench/HISTORY.md, session
        20); else take_pending and C-level passes over what it took. ``max_entries`` < 0: no
        limit."""
        n0 = len(out)
        if native and _take_grouped is not None:
            try:
                taken = _take_grouped(self.pending, max_bytes, max_entries, at_least_one,
                                      out, groups, cums)
            except BaseException:
                # what it popped is in ``out`` (the caller returns it to pending)
                self.pending_bytes -= sum(map(_SIZE, out[n0:]))
                raise
            self.pending_bytes -= taken
            return taken
        chunk = self.take_pending(max_bytes, None if max_entries < 0 else max_entries,
                                  at_least_one)
        out.extend(chunk)
        for sid, it in itertools.groupby(sorted(chunk, key=_STREAM_ID), _STREAM_ID):
            run = list(it)
            recs = groups.get(sid)
            if recs is None:
                recs = groups[sid] = []
                cums[sid] = []
            recs.extend(run)
            cum = cums[sid]
            cum.extend(itertools.islice(itertools.accumulate(
                map(len, map(_PAYLOAD, run)), initial=cum[-1] if cum else 0), 1, None))
        return sum(map(_SIZE, chunk))

    def take_pending_stream(self, stream_id: int, max_bytes: int) -> list[CacheEntry]:
        """One stream's durable pending entries from its first on (at least one if any; a
        partition move uploads only its own stream), removed from pending; the others keep
        their WAL order."""
        out: list[CacheEntry] = []
        kept: deque[CacheEntry] = deque()
        size = 0
        taking = True
        for e in self.pending:
            if taking and e.stream_id == stream_id:
                if e.durable and (not out or size + e.size <= max_bytes):
                    out.append(e)
                    size += e.size
                    continue
                taking = False       # the stream's entries go in offset order
            kept.append(e)
        if out:
            self.pending = kept
            self.pending_bytes -= size
        return out

    def return_pending(self, entries: list[CacheEntry]) -> None:
        """Put back entries whose upload failed, in WAL order (the trim point is the first
        pending entry: entries taken out of order must not go back ahead of older ones)."""
        for e in reversed(entries):
            self.pending.appendleft(e)
            self.pending_bytes += e.size
        n = len(entries)
        if n and len(self.pending) > n and entries[-1].wal_offset > self.pending[n].wal_offset:
            self.pending = deque(sorted(self.pending, key=lambda e: e.wal_offset))

    def mark_committed(self, stream_id: int, end_offset: int, evict: bool = True) -> None:
        """Offsets below end_offset are in the object store: their entries become evictable
        (and are evicted down to 90 % of the capacity, unless ``evict`` is False: the engine
        then evicts in slices, ``evict_some``)."""
        sc = self._stream(stream_id)
        if end_offset > sc.committed:
            sc.committed = end_offset
        if evict:
            self._evict(self.used - int(self.capacity * 0.9))
        self._space.set()

    def evict_some(self, max_entries: int) -> bool:
        """Evict committed entries toward 90 % of the capacity, at most ``max_entries``; True
        while more could go. A full cache of small produce requests evicts ~70,000 entries
        after an upload: in one step that was a ~100 ms event-loop stall."""
        self._evict(self.used - int(self.capacity * 0.9), max_entries)
        return bool(self.used > self.capacity * 0.9 and self._fifo
                    and self._evictable(self._fifo[0]))

    def trim(self, stream_id: int, start_offset: int) -> None:
        """Entries wholly below the new start are no longer needed once committed."""
        sc = self._stream(stream_id)
        sc.start = max(sc.start, start_offset)

    def forget_below(self, stream_id: int, end_offset: int) -> None:
        """Stop serving a stream's committed entries below ``end_offset`` (their objects were
        rewritten: reads must go there); the FIFO eviction releases their memory as usual."""
        sc = self._streams.get(stream_id)
        if sc is None:
            return
        end = min(end_offset, sc.committed)
        while sc.head < len(sc.entries) and sc.entries[sc.head].next_offset <= end:
            sc.pop_front()

    def drop_stream(self, stream_id: int) -> None:
        """Forget a deleted stream: its entries become evictable at once and leave pending."""
        sc = self._stream(stream_id)
        sc.committed = sc.start = 1 << 62
        kept = [e for e in self.pending if e.stream_id != stream_id]
        self.pending = deque(kept)
        self.pending_bytes = sum(e.size for e in kept)
        self._evict(self.used)
        self._space.set()

    def reset_stream(self, stream_id: int, committed: int, start: int) -> None:
        """Stop serving a stream's cached entries (another node wrote it meanwhile, so the
        cache would have a gap) and set its state anew; the entries leave memory through the
        FIFO as usual (they are all committed)."""
        sc = self._stream(stream_id)
        sc.entries, sc.bases, sc.head = [], [], 0
        sc.committed, sc.start = committed, start

    def _evictable(self, e: CacheEntry) -> bool:
        sc = self._streams[e.stream_id]
        return e.next_offset <= sc.committed

    def _evict(self, need: int, max_entries: int = -1) -> None:
        while need > 0 and max_entries and self._fifo and self._evictable(self._fifo[0]):
            max_entries -= 1
            e = self._fifo.popleft()
            sc = self._streams[e.stream_id]
            if sc.head < len(sc.entries) and sc.entries[sc.head] is e:
                sc.pop_front()
            self.used -= e.size
            need -= e.size
            if self.recycle is not None:
                box, e.payload = [e.payload], b""   # the callee holds the only reference
                self.recycle(box)

    def drop_all_committed(self) -> None:
        """Evict everything already in the object store (tests: force cold reads)."""
        self._evict(self.used)

    async def wait_for_space(self, timeout: float) -> None:
        """Wait until some entries were committed (or the timeout passes)."""
        self._space.clear()
        await wait_event(self._space, timeout)

    def first_offset(self, stream_id: int) -> int | None:
        """Base offset of the oldest cached entry of a stream, None if nothing is cached."""
        sc = self._streams.get(stream_id)
        if sc is None or sc.head >= len(sc.entries):
            return None
        return sc.entries[sc.head].base_offset

    def added_at(self, stream_id: int, offset: int) -> float | None:
        """When the cached entry holding ``offset`` was appended (perf_counter), None if it
        is not cached: how far behind the tail a reader at ``offset`` is, in time."""
        sc = self._streams.get(stream_id)
        if sc is None or sc.head >= len(sc.entries):
            return None
        i = sc.index(offset)
        e = sc.entries[i]
        if e.base_offset > offset or e.next_offset <= offset:
            return None
        return e.added

    def read(self, stream_id: int, offset: int, max_bytes: int, limit: int,
             first_required: bool) -> list[Batch]:
        """Cached batches from the one holding ``offset``, below ``limit`` (confirmed offset)."""
        sc = self._streams.get(stream_id)
        out: list[Batch] = []
        if sc is None:
            return out
        i = sc.index(offset)
        size = 0
        n = len(sc.entries)
        while i < n:
            e = sc.entries[i]
            i += 1
            if e.next_offset <= offset:
                continue
            if e.next_offset > limit:
                break
            if (out or not first_required) and size + len(e.payload) > max_bytes:
                break
            out.append(Batch(e.base_offset, e.count, e.payload))
            size += len(e.payload)
        return out
