"""Cold read path: which objects hold a stream's offsets, their indexes, and the BlockCache."""
from __future__ import annotations

import asyncio
import bisect
import functools
import logging
from collections import OrderedDict
from typing import Awaitable, Callable

from .cache.block_cache import BlockCache, Readahead
from .metastore import ObjectRange
from .objects.format import (BLOCK_HEADER, FOOTER, CorruptObjectError, IndexEntry, decode_block,
                             decode_footer, decode_index)
from .objects.store import ObjectNotFound, ObjectStore, ObjectStoreError
from .stream import Batch, RetriableStorageError, StorageError

log = logging.getLogger(__name__)
Io = Callable[..., Awaitable]
INDEX_TAIL = 64 << 10
AHEAD_KEYS = 8          # following objects a reader remembers having prefetched


class ObjectReader:
    """Reads stream offsets from committed objects; owns the in-memory object map."""

    def __init__(self, store: ObjectStore, io: Io, block_cache_bytes: int,
                 readahead_max: int) -> None:
        self.store = store
        self._io = io
        self.objects: dict[int, list[ObjectRange]] = {}
        self._ranges: dict[int, list[ObjectRange]] = {}
        self._starts: dict[int, list[int]] = {}
        self._index: OrderedDict[int, list[IndexEntry]] = OrderedDict()
        self._index_loads: dict[int, asyncio.Future] = {}
        self._readers: OrderedDict[tuple[int, int], Readahead] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        # set by the engine: True while producers append (cold reads are paced then)
        self.hot: Callable[[], bool] | None = None
        buffers = getattr(store, "buffers", None)     # the file store's read buffer pool
        self.block_cache = BlockCache(block_cache_bytes, self._fetch, readahead_max,
                                      buffers.give_back if buffers is not None else None)

    async def _fetch(self, key: str, ranges: list[tuple[int, int]]) -> list:
        got = await self._io(self._get_decoded, key, ranges)
        # the executor's future (in a reference cycle with the loop's future until the
        # cyclic GC runs) keeps this list: emptied, so the block buffers go back to the
        # store's pool as soon as the cache and the readers let go of them
        out = list(got)
        got.clear()
        return out

    def _get_decoded(self, key: str, ranges: list[tuple[int, int]]) -> list:
        """On the cold read thread: the blocks, each decoded (its CRC-32C checked, which runs
        without the GIL) when whole and sound; a short or bad block stays raw bytes, so the
        error is raised only to the reader of that block (BlockCache decodes it then)."""
        # the file store computes the blocks' CRCs in the same call as their read (one
        # interpreter lock hand-off per span, not per block); None where it did not
        parts, crcs = self.store.get_ranges_crc(key, ranges, BLOCK_HEADER.size)
        out: list = []
        for part, (_, size), body_crc in zip(parts, ranges, crcs):
            if len(part) == size:
                try:
                    out.append(decode_block(part, body_crc))
                    continue
                except CorruptObjectError:
                    pass
            out.append(part)
        return out

    # -- object map -------------------------------------------------------------------------
    def add(self, ranges: list[ObjectRange]) -> None:
        """Make committed ranges readable."""
        for r in ranges:
            self.objects.setdefault(r.object_id, []).append(r)
            # new ranges nearly always go at the end: an insert, not a re-sort of the whole
            # (ever growing until compaction) list after every upload
            rs = self._ranges.setdefault(r.stream_id, [])
            starts = self._starts.setdefault(r.stream_id, [])
            i = bisect.bisect_right(starts, r.start_offset)
            rs.insert(i, r)
            starts.insert(i, r.start_offset)

    def remove(self, object_ids: list[int]) -> None:
        """Forget objects (compacted away or deleted); their keys may vanish from the store."""
        touched = set()
        for oid in object_ids:
            for r in self.objects.pop(oid, []):
                touched.add(r.stream_id)
                self.block_cache.invalidate_object(r.key)
            self._index.pop(oid, None)
        for sid in touched:
            rs = [r for r in self._ranges.get(sid, []) if r.object_id not in object_ids]
            self._ranges[sid] = rs
            self._starts[sid] = [r.start_offset for r in rs]

    def replace_stream(self, stream_id: int, ranges: list[ObjectRange]) -> None:
        """Forget what this node knew of one stream's objects and take ``ranges`` (the
        database's current view, e.g. when the stream arrives from another node)."""
        for r in self._ranges.pop(stream_id, []):
            kept = [x for x in self.objects.get(r.object_id, []) if x.stream_id != stream_id]
            if kept:
                self.objects[r.object_id] = kept
            else:
                self.objects.pop(r.object_id, None)
        self._starts.pop(stream_id, None)
        self.add(ranges)

    def stream_ranges(self, stream_id: int) -> list[ObjectRange]:
        return list(self._ranges.get(stream_id, []))

    # -- reads ------------------------------------------------------------------------------
    async def _load_index(self, r: ObjectRange) -> list[IndexEntry]:
        idx = self._index.get(r.object_id)
        if idx is not None:
            self._index.move_to_end(r.object_id)
            return idx
        # one load per object at a time: a reader and its read-ahead (or two readers) asking
        # together share it instead of reading the object's tail twice
        loading = self._index_loads.get(r.object_id)
        if loading is None:
            loading = asyncio.ensure_future(self._read_index(r))
            self._index_loads[r.object_id] = loading
            loading.add_done_callback(functools.partial(self._index_loaded, r.object_id))
        return await asyncio.shield(loading)

    def _index_loaded(self, object_id: int, fut: asyncio.Future) -> None:
        self._index_loads.pop(object_id, None)
        if not fut.cancelled():
            fut.exception()             # retrieved: every waiter got it (or none is left)

    async def _read_index(self, r: ObjectRange) -> list[IndexEntry]:
        start = max(0, r.size - INDEX_TAIL)
        tail = await self._io(self.store.get, r.key, start, r.size)
        if len(tail) != r.size - start:
            raise CorruptObjectError(f"object {r.key} has {len(tail) + start} bytes, expected {r.size}")
        pos, length, crc = decode_footer(tail[-FOOTER.size:], r.size)
        if pos >= start:
            data = tail[pos - start:pos - start + length]
        else:
            data = await self._io(self.store.get, r.key, pos, pos + length)
        idx = decode_index(data, crc)
        self._index[r.object_id] = idx
        while len(self._index) > 20000:
            self._index.popitem(last=False)
        return idx

    @property
    def reads_ahead(self) -> int:
        """Background reads not finished yet: next objects' index loads and the block
        cache's prefetch pieces (a store slower than its reader has some)."""
        return len(self._tasks) + self.block_cache.prefetches_running

    def _reads_ahead_of(self, stream_id: int, i: int, left: int, ra: Readahead) -> None:
        """A sequential reader with ``left`` bytes of object ``i`` of its stream still ahead:
        prefetch the first window of the following objects (each one's index first) that
        start within its readahead: the next one once ``left`` is within twice the readahead,
        those after it while the bytes up to their start stay within one readahead.

        One object ahead was not enough with objects smaller than the readahead (a cold pass
        with ~17 MiB objects and a 32 MiB readahead): the index of the object after next was
        asked for only when the reader entered the next one, so every object started with two
        store round trips in a row (index, then blocks) that the reader waited for; readers
        waited on first blocks ~70 times per 4.3 GB pass (bench/HISTORY.md, session 18)."""
        rs = self._ranges[stream_id]
        k = i + 1
        limit = 2 * ra.size
        # while producers append, catch-up reads are paced: the next object is enough ahead,
        # and no more device reads are queued beside the WAL's writes than before (item 5).
        # Otherwise at most AHEAD_KEYS objects: the reader remembers no more (it asked for the
        # others again at every read), and a run of tiny objects (the uploads of a store
        # outage's backlog: ~100 objects of 2-17 KB within a 512 KiB readahead) queued two
        # store reads per object on the cold threads ahead of the reader's own read, which
        # then waited 50 s behind them on a CPU-starved machine (FINDINGS, lead 22:40)
        hot = self.hot is not None and self.hot()
        last = min(i + (1 if hot else AHEAD_KEYS), len(rs) - 1)
        while k <= last and left <= limit:
            nxt = rs[k]
            if nxt.key not in ra.ahead:
                self._read_ahead(stream_id, nxt, ra)
            left += nxt.size           # the object's size: at least the stream's share of it
            limit = ra.size
            k += 1

    def _read_ahead(self, stream_id: int, nxt: ObjectRange, ra: Readahead) -> None:
        """Prefetch the first window of a following object of the stream (its index first)
        while the reader finishes this one; errors are left to the reader's own read."""
        ra.ahead[nxt.key] = None
        while len(ra.ahead) > AHEAD_KEYS:
            del ra.ahead[next(iter(ra.ahead))]

        async def run() -> None:
            try:
                index = await self._load_index(nxt)
                entries = [e for e in index if e.stream_id == stream_id]
                blocks = sorted({(e.position, e.size) for e in entries})
                first = next((e for e in entries if e.end_offset > nxt.start_offset), None)
                if first is not None and not self.block_cache.prefetch(
                        nxt.key, blocks, bisect.bisect_left(blocks, (first.position, first.size)),
                        ra):
                    ra.ahead.pop(nxt.key, None)     # busy: the next block asks again
            except Exception as e:  # noqa: BLE001 - the reader reads (and reports) itself
                log.debug("read-ahead of %s failed: %r", nxt.key, e)
        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def read(self, stream_id: int, offset: int, max_bytes: int, limit: int,
                   first_required: bool) -> list[Batch]:
        """Batches from objects starting at the one holding ``offset``, below ``limit``.

        Stops at the end of the committed data; raises StorageError for a corrupt object and
        RetriableStorageError when the store cannot be reached."""
        out: list[Batch] = []
        size = 0
        rkey = (stream_id, offset)
        ra = self._readers.pop(rkey, None) or Readahead()
        retries = 0
        while offset < limit:
            starts = self._starts.get(stream_id, [])
            i = bisect.bisect_right(starts, offset) - 1
            if i < 0 or self._ranges[stream_id][i].end_offset <= offset:
                break
            r = self._ranges[stream_id][i]
            try:
                index = await self._load_index(r)
                entries = [e for e in index if e.stream_id == stream_id]
                blocks = sorted({(e.position, e.size) for e in entries})
                done = False
                for e in entries:
                    if e.end_offset <= offset:
                        continue
                    bi = bisect.bisect_left(blocks, (e.position, e.size))
                    self._reads_ahead_of(stream_id, i,
                                         blocks[-1][0] + blocks[-1][1] - blocks[bi][0], ra)
                    records = await self.block_cache.get(r.key, blocks, bi, ra, max_bytes - size)
                    for rec in records:
                        if rec.stream_id != stream_id or rec.end_offset <= offset:
                            continue
                        if rec.end_offset > limit or rec.base_offset >= r.end_offset:
                            done = True
                            break
                        if (out or not first_required) and size + len(rec.payload) > max_bytes:
                            done = True
                            break
                        out.append(Batch(rec.base_offset, rec.count, rec.payload))
                        size += len(rec.payload)
                        offset = rec.end_offset
                    if done:
                        break
                if done:
                    break
                if offset < r.end_offset:
                    raise CorruptObjectError(f"object {r.key} lacks offsets {offset}..{r.end_offset}")
            except ObjectNotFound:
                if r.object_id not in self.objects or retries < 1:
                    retries += 1      # compaction replaced it meanwhile: look the offset up again
                    await asyncio.sleep(0)
                    continue
                raise StorageError(f"object {r.key} is missing from the store")
            except CorruptObjectError as e:
                log.error("corrupt object %s: %s", r.key, e)
                raise StorageError(f"corrupt object {r.key}: {e}") from e
            except ObjectStoreError as e:
                raise RetriableStorageError(f"object store: {e}") from e
        self._readers[(stream_id, offset)] = ra
        while len(self._readers) > 1000:
            self._readers.popitem(last=False)
        return out
