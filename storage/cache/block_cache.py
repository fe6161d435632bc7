"""BlockCache: decoded data blocks of objects for cold reads, LRU, bounded, with readahead.

A miss fetches the wanted block and, in the same store call (one ranged GET on S3, one read
per block from files: ObjectStore.get_ranges), the stream's following blocks of the object
up to the reader's readahead size; the size starts at 512 KiB and grows by 512 KiB on
each sequential miss up to 32 MiB, so a catch-up consumer quickly moves to large GETs while a
random reader stays cheap. Concurrent misses for a block already being fetched wait for that
fetch instead of issuing another. A sequential reader halfway through its readahead has the
next window fetched in the background (prefetch), so a catch-up consumer seldom waits on the
store; blocks may arrive already decoded (checked on the fetching thread). It is a separate pool from the LogCache, so cold reads can
never evict the hot tail.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from ..objects.format import CorruptObjectError, Record, decode_block

log = logging.getLogger(__name__)
READAHEAD_INITIAL = 512 << 10
READAHEAD_STEP = 512 << 10
READAHEAD_MAX = 32 << 20
# a prefetch reads its window in pieces of at most this much: 8 MiB reads (two of the virtio
# disk's 4 MiB requests per call) gave a cold pass 1271-1448 MB/s against 936-1244 with 4 MiB
# (bench/HISTORY.md, session 15)
PREFETCH_PIECE = 8 << 20
PREFETCH_BATCHES = 2            # prefetches one reader may have running in one object
# objects whose fetched front a reader keeps: its own and those it reads ahead into (ObjectReader
# prefetches the first windows of the following objects within its readahead)
FRONTS_KEPT = 8
# the most bytes a writer leaves before a block that no index entry covers (a gather put places
# each large payload at its memory's offset in a page: storage/objects/format.py GatherSource)
BLOCK_GAP = 4096

BlockKey = tuple[str, int]                      # (object key, block position)
# (key, [(position, size), ...]) -> one buffer per block (ObjectStore.get_ranges)
Fetch = Callable[[str, list[tuple[int, int]]], Awaitable[list]]


@dataclass
class Readahead:
    """A reader's readahead state: the object it reads, how far each object it reads or is
    about to read was fetched or claimed, and how big the next window may be."""

    key: str = ""                       # the object this reader reads now
    size: int = READAHEAD_INITIAL
    current: BlockKey | None = None     # the block this reader read last
    # following objects whose first window was prefetched (insertion order, a few kept)
    ahead: dict[str, None] = field(default_factory=dict)
    pending: asyncio.Future | None = None   # the latest prefetch's claim
    # object key -> end of what was fetched or claimed for this reader (its object and the
    # next one: a prefetch of the next object no longer moves the reader's own front)
    fronts: dict[str, int] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)   # object key -> prefetches running

    @property
    def next_position(self) -> int:
        """Where what was fetched or claimed of the reader's object ends (-1: nothing)."""
        return self.fronts.get(self.key, -1)

    @property
    def prefetching(self) -> bool:
        return bool(self.running)

    def advance(self, key: str, end: int) -> None:
        """What was fetched or claimed of object ``key`` now reaches ``end``."""
        if end > self.fronts.get(key, -1):
            self.fronts[key] = end
            if len(self.fronts) > FRONTS_KEPT:
                old = next(k for k in self.fronts if k != self.key and k != key)
                del self.fronts[old]


class BlockCache:
    """LRU of decoded blocks keyed by (object key, position)."""

    def __init__(self, capacity: int, fetch: Fetch, readahead_max: int = READAHEAD_MAX,
                 on_evict: Callable[[object], None] | None = None) -> None:
        """``on_evict``: called with the buffer under each block the cache drops (the file
        store's read buffers go back to its pool; it reuses one only once no view of it is
        left)."""
        self.capacity = capacity
        self._on_evict = on_evict
        self.used = 0
        self.readahead_max = readahead_max
        self._fetch = fetch
        # raw bytes until first read, then the decoded records (checked once, not per hit)
        self._lru: OrderedDict[BlockKey, memoryview | list[Record]] = OrderedDict()
        self._sizes: dict[BlockKey, int] = {}
        self._inflight: dict[BlockKey, asyncio.Future] = {}
        # blocks a sequential reader has moved past, oldest first: dropped once they pass
        # ``scan_keep_bytes`` (see _passed)
        self._passed: OrderedDict[BlockKey, None] = OrderedDict()
        self._passed_bytes = 0
        self.scan_keep_bytes = max(readahead_max, READAHEAD_INITIAL)
        self.hits = 0
        self.misses = 0
        self.bytes_fetched = 0
        self.prefetches = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def prefetches_running(self) -> int:
        """Background prefetch pieces not finished yet."""
        return len(self._tasks)

    def _put(self, key: BlockKey, data: memoryview | list[Record], size: int) -> None:
        if key in self._lru:
            return
        self._lru[key] = data
        self._sizes[key] = size
        self.used += size
        while self.used > self.capacity and len(self._lru) > 1:
            old, data = self._lru.popitem(last=False)
            self._unpass(old)
            self.used -= self._sizes.pop(old)
            self._dropped(data)

    def _passed_by(self, ra: Readahead, bkey: BlockKey) -> None:
        """Reader ``ra`` now reads ``bkey``: the block it read before is passed. A catch-up
        scan reads each block once, so keeping what it passed until the LRU overflows would
        fill the cache with fresh memory (a page fault per 4 KiB: 0.4-1.1 ms of CPU per MiB
        on the test VM) before any buffer is reused; passed blocks are dropped once more than
        ``scan_keep_bytes`` of them are held (a reader just behind still hits), and their
        buffers go back to the store's pool. A hit takes a block off the passed list."""
        prev, ra.current = ra.current, bkey
        if prev is None or prev == bkey or prev not in self._lru or prev in self._passed:
            return
        self._passed[prev] = None
        self._passed_bytes += self._sizes[prev]
        while self._passed_bytes > self.scan_keep_bytes and len(self._passed) > 1:
            old, _ = self._passed.popitem(last=False)
            data = self._lru.pop(old, None)
            size = self._sizes.pop(old, 0)
            self._passed_bytes -= size
            if data is not None:
                self.used -= size
                self._dropped(data)

    def _unpass(self, bkey: BlockKey) -> None:
        if self._passed.pop(bkey, 0) is None:
            self._passed_bytes -= self._sizes.get(bkey, 0)

    def _dropped(self, data: memoryview | list[Record]) -> None:
        """Hand the buffer under a dropped block to ``on_evict``."""
        if self._on_evict is None:
            return
        if isinstance(data, list):
            if not data:
                return
            data = data[0].payload
        owner = getattr(data, "obj", None)
        if owner is not None:
            self._on_evict(owner)

    def _decoded(self, key: BlockKey, data: memoryview | list[Record]) -> list[Record]:
        if isinstance(data, list):
            return data
        records = decode_block(data)
        if key in self._lru:
            self._lru[key] = records            # same bytes (views), same size
        return records

    def invalidate_object(self, key: str) -> None:
        """Drop every cached block of an object (deleted by compaction/retention)."""
        for k in [k for k in self._lru if k[0] == key]:
            self._unpass(k)
            self._dropped(self._lru.pop(k))
            self.used -= self._sizes.pop(k)

    def clear(self) -> None:
        for data in self._lru.values():
            self._dropped(data)
        self._lru.clear()
        self._passed.clear()
        self._passed_bytes = 0
        self._sizes.clear()
        self.used = 0

    async def get(self, key: str, blocks: list[tuple[int, int]], i: int, ra: Readahead,
                  want: int = 0) -> list[Record]:
        """Records of block ``blocks[i]`` ((position, size), sorted, distinct) of object ``key``.

        A fetch may hand back blocks already decoded (ObjectReader decodes them on the cold
        read thread, where the checksum runs without the GIL); raw blocks are decoded
        (checksum included) when first asked for, and the decoded records replace the bytes,
        so later hits cost no checksum. When a sequential reader gets into the second half of
        what it read ahead, the next window is fetched in the background (prefetch), so a
        catch-up reader rarely waits for the store. Raises CorruptObjectError (bad bytes) or
        the fetch's error (store down).

        ``want``: the bytes the reader's request can still take from this block on (its
        Fetch's budget). A miss that starts a reader's readahead over (a new reader, or a
        jump) sizes the window to that, up to the readahead's maximum, rather than
        READAHEAD_INITIAL: a request that takes 8 MiB waits for those 8 MiB either way, and
        growing from 512 KiB took it ~5 store round trips in a row (one per doubling; the
        first ~0.25 s of a cold pass after a restart ran at a third to half of its steady
        rate, bench/HISTORY.md session 26), each into a small fresh read buffer that the
        8 MiB spans after it could not reuse. A small request (a random reader; a catch-up
        slice while producers append, cold_read_max_bytes) keeps the small first window."""
        bkey = (key, blocks[i][0])
        hit = self._lru.get(bkey)
        if hit is None:
            fut = self._inflight.get(bkey)
            if fut is not None:
                await asyncio.shield(fut)
                hit = self._lru.get(bkey)
        if hit is not None:
            ra.key = key
            self._lru.move_to_end(bkey)
            self._unpass(bkey)
            self._passed_by(ra, bkey)
            self.hits += 1
            self._maybe_prefetch(key, blocks, i, ra)
            return self._decoded(bkey, hit)
        self.misses += 1
        # grow the readahead on sequential misses (doubling: a cold pass reached 32 MiB
        # windows only after 63 misses at +512 KiB, each a wait on the store), reset it on a jump
        pos0 = blocks[i][0]
        if _follows(ra.fronts.get(key, -1), pos0) or (ra.key and ra.key != key
                                                      and _follows(0, pos0)):
            ra.size = min(max(ra.size * 2, ra.size + READAHEAD_STEP), self.readahead_max)
        else:
            ra.size = max(READAHEAD_INITIAL, min(want, self.readahead_max))
        ra.key = key
        # the reader waits for one piece at most; the rest of its window is prefetched
        # (a 32 MiB window read as one job kept it waiting for all of it)
        parts = await self._load(key, self._window(key, blocks, i, min(ra.size, PREFETCH_PIECE)),
                                 ra, quiet=False)
        self._passed_by(ra, bkey)
        self._maybe_prefetch(key, blocks, i, ra)
        return self._decoded(bkey, parts[0])

    def _window(self, key: str, blocks: list[tuple[int, int]], i: int, size: int
                ) -> list[tuple[int, int]]:
        """blocks[i] and the following blocks up to ``size`` bytes that are neither cached
        nor being fetched."""
        j = i + 1
        total = blocks[i][1]
        while j < len(blocks) and total + blocks[j][1] <= size \
                and (key, blocks[j][0]) not in self._lru and (key, blocks[j][0]) not in self._inflight:
            total += blocks[j][1]
            j += 1
        return blocks[i:j]

    def _claim(self, key: str, wanted: list[tuple[int, int]]) -> asyncio.Future:
        """Mark ``wanted`` as being fetched: readers of those blocks wait for this future."""
        fut = asyncio.get_running_loop().create_future()
        for pos, _ in wanted:
            self._inflight[(key, pos)] = fut
        return fut

    async def _load(self, key: str, wanted: list[tuple[int, int]], ra: Readahead,
                    quiet: bool, fut: asyncio.Future | None = None) -> list:
        """Fetch ``wanted`` into the cache (readers of those blocks wait for it meanwhile).
        ``quiet`` (a prefetch): a failure only leaves the blocks out, the readers then fetch
        them themselves and see the error. ``fut``: the blocks were claimed already."""
        if fut is None:
            fut = self._claim(key, wanted)
        end = wanted[-1][0] + wanted[-1][1]
        try:
            parts = list(await self._fetch(key, wanted))
            if len(parts) != len(wanted):
                raise CorruptObjectError(f"object {key} is shorter than its index says")
            for k, ((pos, size), part) in enumerate(zip(wanted, parts)):
                if not isinstance(part, list):          # raw bytes: decoded on first read
                    part = parts[k] = memoryview(part)
                    if len(part) != size:
                        raise CorruptObjectError(f"object {key} is shorter than its index says")
                self.bytes_fetched += size
                self._put((key, pos), part, size)
            # a prefetch's pieces may finish out of order: the front only grows
            ra.advance(key, end)
            fut.set_result(None)
            return parts
        except BaseException as e:
            if not fut.done():
                if quiet:
                    fut.set_result(None)
                else:
                    fut.set_exception(e)
                    fut.exception()      # mark retrieved
            raise
        finally:
            for pos, _ in wanted:
                self._inflight.pop((key, pos), None)

    def _maybe_prefetch(self, key: str, blocks: list[tuple[int, int]], i: int,
                        ra: Readahead) -> None:
        """Keep a sequential reader's readahead (``ra.size``) fetched or on its way ahead of
        it: once less than three quarters of it (at least half) is ahead, the next quarter
        (at least PREFETCH_PIECE, at most the readahead) is fetched in the background, with
        at most PREFETCH_BATCHES such prefetches running per object. (One
        whole window at a time, started once the reader was in its second half, left the
        store idle for this reader between windows: a cold pass waited on reads half its
        time with ~5 reads in flight out of 16 threads, bench/HISTORY.md session 15.)"""
        if ra.key != key or ra.running.get(key, 0) >= PREFETCH_BATCHES:
            return
        nxt = ra.fronts.get(key, -1)
        batch = min(ra.size, max(ra.size // 4, PREFETCH_PIECE))
        if nxt < 0 or nxt - blocks[i][0] > max(ra.size - batch, ra.size // 2, blocks[i][1]):
            return
        j = bisect.bisect_left(blocks, (nxt, 0))
        if j >= len(blocks) or not _follows(nxt, blocks[j][0]):
            return
        if (key, blocks[j][0]) in self._lru or (key, blocks[j][0]) in self._inflight:
            return
        self._start_prefetch(key, self._window(key, blocks, j, batch), ra)
        ra.size = min(max(ra.size * 2, ra.size + READAHEAD_STEP), self.readahead_max)

    def prefetch(self, key: str, blocks: list[tuple[int, int]], i: int, ra: Readahead) -> bool:
        """Fetch reader ``ra``'s first window of another object (from ``blocks[i]``, half the
        readahead: the reader still has up to a readahead of its own object ahead) in the
        background: a sequential reader near the end of one object gets the next one's first
        blocks before it asks (else every object starts with a wait). False when that object
        has a prefetch of this reader running (try again later); nothing is fetched when the
        block is cached or on its way."""
        if ra.running.get(key):
            return False
        if (key, blocks[i][0]) not in self._lru and (key, blocks[i][0]) not in self._inflight:
            self._start_prefetch(key, self._window(key, blocks, i, max(ra.size // 2, 1)), ra)
        return True

    def _start_prefetch(self, key: str, wanted: list[tuple[int, int]], ra: Readahead) -> None:
        """Fetch ``wanted`` in the background, in pieces of at most PREFETCH_PIECE bytes, each
        its own read on the cold threads: a reader waits only for the piece holding its next
        block (one 32 MiB window read as one job kept it waiting for the whole window), and
        the pieces are read side by side on the cold threads."""
        ra.running[key] = ra.running.get(key, 0) + 1
        ra.advance(key, wanted[-1][0] + wanted[-1][1])
        self.prefetches += 1
        loop = asyncio.get_running_loop()
        pieces = _pieces(wanted, PREFETCH_PIECE)
        left = [len(pieces)]
        whole = ra.pending = loop.create_future()
        for piece in pieces:
            # claimed now, not when the task first runs: a reader asking for one of these
            # blocks meanwhile waits for the prefetch instead of fetching the same blocks again
            # (it did: 47 % of the bytes of a cold scan were read twice, bench/HISTORY.md
            # session 12)
            fut = self._claim(key, piece)
            task = loop.create_task(self._prefetch(key, piece, ra, fut))
            self._tasks.add(task)

            def done(t: asyncio.Task, fut: asyncio.Future = fut,
                     piece: list[tuple[int, int]] = piece) -> None:
                self._tasks.discard(t)
                if not fut.done():          # cancelled before it ran: readers fetch themselves
                    fut.set_result(None)
                    for pos, _ in piece:
                        if self._inflight.get((key, pos)) is fut:
                            del self._inflight[(key, pos)]
                left[0] -= 1
                if not left[0]:
                    n = ra.running.get(key, 0) - 1
                    if n > 0:
                        ra.running[key] = n
                    else:
                        ra.running.pop(key, None)
                    if not whole.done():
                        whole.set_result(None)
            task.add_done_callback(done)

    async def _prefetch(self, key: str, wanted: list[tuple[int, int]], ra: Readahead,
                        fut: asyncio.Future) -> None:
        try:
            await self._load(key, wanted, ra, quiet=True, fut=fut)
        except Exception as e:  # noqa: BLE001 - the reader will fetch (and report) itself
            log.debug("prefetch of %s failed: %r", key, e)
            if ra.fronts.get(key, -1) > wanted[0][0]:
                ra.fronts[key] = wanted[0][0]       # from here on, fetched by the reader


def _follows(front: int, position: int) -> bool:
    """A block at ``position`` is the next one after a reader's ``front`` (where what it
    fetched ends): it starts there, or after a gap of less than BLOCK_GAP (a gather put's large
    payloads: storage/objects/format.py GatherSource). Seen as a jump instead, every block
    after a gap reset the readahead and started no prefetch: a cold pass over such objects ran
    at 1,242-1,588 MB/s instead of 2,006-2,229 (bench/HISTORY.md, session 40)."""
    return front >= 0 and 0 <= position - front < BLOCK_GAP


def _pieces(wanted: list[tuple[int, int]], most: int) -> list[list[tuple[int, int]]]:
    """``wanted`` (consecutive blocks) cut into runs of at most ``most`` bytes (a block larger
    than that is a run of its own)."""
    out: list[list[tuple[int, int]]] = []
    run: list[tuple[int, int]] = []
    size = 0
    for b in wanted:
        if run and size + b[1] > most:
            out.append(run)
            run, size = [], 0
        run.append(b)
        size += b[1]
    if run:
        out.append(run)
    return out
