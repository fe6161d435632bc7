"""BlockCache: decoded data blocks of objects for cold reads, LRU, bounded, with readahead.

A miss fetches the wanted block and, in the same store call (one ranged GET on S3, one read
per block from files: ObjectStore.get_ranges), the stream's following blocks of the object
up to the reader's readahead size; the size starts at 512 KiB and grows by 512 KiB on
each sequential miss up to 32 MiB, so a catch-up consumer quickly moves to large GETs while a
random reader stays cheap. Concurrent misses for a block already being fetched wait for that
fetch instead of issuing another. It is a separate pool from the LogCache, so cold reads can
never evict the hot tail.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

from ..objects.format import CorruptObjectError, Record, decode_block

READAHEAD_INITIAL = 512 << 10
READAHEAD_STEP = 512 << 10
READAHEAD_MAX = 32 << 20

BlockKey = tuple[str, int]                      # (object key, block position)
# (key, [(position, size), ...]) -> one buffer per block (ObjectStore.get_ranges)
Fetch = Callable[[str, list[tuple[int, int]]], Awaitable[list]]


@dataclass
class Readahead:
    """A reader's readahead state: where the last fetch ended and how big the next may be."""

    key: str = ""
    next_position: int = -1
    size: int = READAHEAD_INITIAL


class BlockCache:
    """LRU of decoded blocks keyed by (object key, position)."""

    def __init__(self, capacity: int, fetch: Fetch, readahead_max: int = READAHEAD_MAX) -> None:
        self.capacity = capacity
        self.used = 0
        self.readahead_max = readahead_max
        self._fetch = fetch
        # raw bytes until first read, then the decoded records (checked once, not per hit)
        self._lru: OrderedDict[BlockKey, memoryview | list[Record]] = OrderedDict()
        self._sizes: dict[BlockKey, int] = {}
        self._inflight: dict[BlockKey, asyncio.Future] = {}
        self.hits = 0
        self.misses = 0
        self.bytes_fetched = 0

    def _put(self, key: BlockKey, data: memoryview | list[Record], size: int) -> None:
        if key in self._lru:
            return
        self._lru[key] = data
        self._sizes[key] = size
        self.used += size
        while self.used > self.capacity and len(self._lru) > 1:
            old, _ = self._lru.popitem(last=False)
            self.used -= self._sizes.pop(old)

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
            del self._lru[k]
            self.used -= self._sizes.pop(k)

    def clear(self) -> None:
        self._lru.clear()
        self._sizes.clear()
        self.used = 0

    async def get(self, key: str, blocks: list[tuple[int, int]], i: int, ra: Readahead
                  ) -> list[Record]:
        """Records of block ``blocks[i]`` ((position, size), sorted, distinct) of object ``key``.

        Blocks are cached as raw bytes and decoded (checksum included) when first asked for,
        so a large readahead costs the event loop nothing until the reader gets there; the
        decoded records replace the bytes, so later hits cost no checksum. Raises
        CorruptObjectError (bad bytes) or the fetch's error (store down)."""
        bkey = (key, blocks[i][0])
        hit = self._lru.get(bkey)
        if hit is None:
            fut = self._inflight.get(bkey)
            if fut is not None:
                await asyncio.shield(fut)
                hit = self._lru.get(bkey)
        if hit is not None:
            self._lru.move_to_end(bkey)
            self.hits += 1
            return self._decoded(bkey, hit)
        self.misses += 1
        # grow the readahead on sequential misses, reset it on a jump
        pos0 = blocks[i][0]
        if (ra.key == key and ra.next_position == pos0) or (ra.key and ra.key != key and pos0 == 0):
            ra.size = min(ra.size + READAHEAD_STEP, self.readahead_max)
        else:
            ra.size = READAHEAD_INITIAL
        j = i + 1
        total = blocks[i][1]
        while j < len(blocks) and total + blocks[j][1] <= ra.size \
                and (key, blocks[j][0]) not in self._lru and (key, blocks[j][0]) not in self._inflight:
            total += blocks[j][1]
            j += 1
        wanted = blocks[i:j]
        fut = asyncio.get_running_loop().create_future()
        for pos, _ in wanted:
            self._inflight[(key, pos)] = fut
        end = wanted[-1][0] + wanted[-1][1]
        try:
            parts = [memoryview(p) for p in await self._fetch(key, wanted)]
            self.bytes_fetched += sum(len(p) for p in parts)
            if len(parts) != len(wanted) or any(len(p) != n for p, (_, n) in zip(parts, wanted)):
                raise CorruptObjectError(f"object {key} is shorter than its index says")
            for (pos, size), part in zip(wanted, parts):
                self._put((key, pos), part, size)
            ra.key, ra.next_position = key, end
            fut.set_result(None)
            return self._decoded(bkey, parts[0])
        except BaseException as e:
            if not fut.done():
                fut.set_exception(e)
                fut.exception()      # mark retrieved
            raise
        finally:
            for pos, _ in wanted:
                self._inflight.pop((key, pos), None)
