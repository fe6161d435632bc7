"""LogCache and BlockCache behaviour with real objects in memory."""
from __future__ import annotations

import asyncio
import itertools

import pytest
import contextlib

from storage.cache.block_cache import READAHEAD_INITIAL, BlockCache, Readahead
from storage.cache.log_cache import CacheEntry, LogCache
from storage.objects.format import Record, decode_footer, decode_index, encode_object, FOOTER


def _object(n: int = 400, size: int = 4096) -> tuple[bytes, list[tuple[int, int]]]:
    recs = [Record(1, i, 1, bytes([i % 256]) * size) for i in range(n)]
    data, index, _ = encode_object(recs, block_size=16 << 10)
    pos, length, crc = decode_footer(data[-FOOTER.size:], len(data))
    assert decode_index(data[pos:pos + length], crc) == index
    return data, sorted({(e.position, e.size) for e in index})


async def read_in_turn(bc: BlockCache, blocks: list[tuple[int, int]], ra: Readahead | None = None,
                       start: int = 0, pause: float = 0.0) -> list[int]:
    """Base offsets of the records of blocks[start:], read in turn with one Readahead (a
    sequential reader), sleeping ``pause`` s after each block."""
    ra = ra or Readahead()
    seen: list[int] = []
    for i in range(start, len(blocks)):
        seen += [r.base_offset for r in await bc.get("o", blocks, i, ra)]
        if pause:
            await asyncio.sleep(pause)
    return seen


async def test_readahead_grows_and_merges_concurrent_misses() -> None:
    data, blocks = _object()
    calls: list[tuple[int, int]] = []

    async def fetch(key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        calls.append((ranges[0][0], ranges[-1][0] + ranges[-1][1]))
        await asyncio.sleep(0.01)
        return [data[p:p + n] for p, n in ranges]

    bc = BlockCache(64 << 20, fetch)
    assert await read_in_turn(bc, blocks) == list(range(400))
    sizes = [e - s for s, e in calls]
    assert len(calls) < len(blocks) / 4, "sequential reads are served by readahead"
    assert sizes[0] <= READAHEAD_INITIAL < max(sizes), "readahead grew"
    # concurrent misses of one block share one GET
    bc.clear()
    calls.clear()
    res = await asyncio.gather(*(bc.get("o", blocks, 5, Readahead()) for _ in range(8)))
    assert len(calls) == 1 and all(r[0].base_offset == res[0][0].base_offset for r in res)


async def test_block_cache_is_bounded() -> None:
    data, blocks = _object()

    async def fetch(key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        return [data[p:p + n] for p, n in ranges]

    bc = BlockCache(100 << 10, fetch, readahead_max=64 << 10)
    ra = Readahead()
    for i in range(len(blocks)):
        await bc.get("o", blocks, i, ra)
        assert bc.used <= 100 << 10


def test_log_cache_evicts_only_committed() -> None:
    lc = LogCache(10_000)
    for i in range(20):
        lc.add(CacheEntry(1, i, 1, b"x" * 400, i * 500, i * 500 + 500, durable=True))
    assert lc.used > lc.capacity * 0.9
    assert not lc.has_room(1000), "nothing is committed: no room, nothing dropped"
    assert lc.first_offset(1) == 0
    taken = lc.take_pending(4000)
    assert taken and taken[0].base_offset == 0
    lc.mark_committed(1, taken[-1].next_offset)
    assert lc.first_offset(1) > 0 and lc.has_room(1000)
    assert [b.base_offset for b in lc.read(1, lc.first_offset(1), 1 << 20, 20, True)] == \
        list(range(lc.first_offset(1), 20))
    assert lc.read(1, 19, 10, 19, True) == []       # beyond the confirmed limit


def test_log_cache_evicts_in_slices_after_a_commit() -> None:
    """The engine marks an upload committed without evicting, then evicts a slice of entries
    per loop turn (evict_some): at most that many each time, down to 90 % of the capacity,
    committed entries only."""
    lc = LogCache(10_000)
    for i in range(30):          # the bound is the caller's (has_room): 13,920 bytes here
        lc.add(CacheEntry(1, i, 1, b"x" * 400, i * 500, i * 500 + 500, durable=True))
    lc.take_pending(1 << 30)
    lc.mark_committed(1, 25, evict=False)
    assert lc.first_offset(1) == 0 and lc.used > lc.capacity * 0.9
    used = lc.used
    steps = 0
    while lc.evict_some(2):
        steps += 1
        assert used - lc.used <= 2 * 464
        used = lc.used
    assert lc.used <= lc.capacity * 0.9 and steps >= 2
    assert lc.first_offset(1) <= 25                 # uncommitted entries stay


def test_log_cache_takes_a_durable_prefix_in_chunks() -> None:
    """take_pending (C-level passes over chunks of entries, see its docstring) takes what the
    one-entry-at-a-time rule takes: the durable prefix within max bytes (at least one entry
    unless at_least_one is False), at most max_entries, leaving the rest in WAL order."""
    import random
    from collections import deque

    def reference(pending: deque, max_bytes: int, max_entries: int | None,
                  at_least_one: bool) -> list:
        out, size = [], 0
        while pending and pending[0].durable and (max_entries is None
                                                  or len(out) < max_entries):
            e = pending[0]
            if (out or not at_least_one) and size + e.size > max_bytes:
                break
            out.append(pending.popleft())
            size += e.size
        return out

    rnd = random.Random(7)
    for _ in range(400):
        n = rnd.choice([0, 1, 3, 4095, 4096, 4097, 9000])
        durable = rnd.choice([n, rnd.randint(0, n)])
        entries = [CacheEntry(1, i, 1, b"x" * rnd.randint(0, 300), i, i + 1,
                              durable=i < durable) for i in range(n)]
        max_bytes = rnd.choice([0, 100, 5000, 200_000, 1 << 30])
        max_entries = rnd.choice([None, 0, 1, 4096, 5000])
        at_least_one = rnd.random() < 0.5
        lc = LogCache(1 << 30)
        for e in entries:
            lc.add(e)
        want_left = deque(entries)
        want = reference(want_left, max_bytes, max_entries, at_least_one)
        assert lc.take_pending(max_bytes, max_entries, at_least_one) == want
        assert list(lc.pending) == list(want_left)
        assert lc.pending_bytes == sum(e.size for e in want_left)


def test_log_cache_take_grouped_takes_groups_and_sums_in_one_pass() -> None:
    """take_grouped (the upload's take: one C pass when the extension is built) takes what
    take_pending takes and hands it over grouped by stream, in offset order, with each
    stream's running payload sums, across calls that continue the same groups; the Python
    fallback gives the same. Entries of another type (a subclass with a property: no direct
    slot reads) and memoryview payloads too."""
    import random
    from collections import deque

    from storage.cache import log_cache

    class Odd(CacheEntry):
        __slots__ = ("_sid",)

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self._sid = a[0]

        @property
        def stream_id(self) -> int:     # type: ignore[override]
            return self._sid

        @stream_id.setter
        def stream_id(self, v: int) -> None:
            self._sid = v

    def reference(pending: deque, max_bytes: int, max_entries: int, at_least_one: bool):
        out, size = [], 0
        while pending and pending[0].durable and (max_entries < 0 or len(out) < max_entries):
            e = pending[0]
            if (out or not at_least_one) and size + e.size > max_bytes:
                break
            out.append(pending.popleft())
            size += e.size
        return out, size

    rnd = random.Random(11)
    modes = [False] + ([True] if log_cache._take_grouped is not None else [])
    for _ in range(300):
        n = rnd.choice([0, 1, 3, 50, 700])
        durable = rnd.choice([n, rnd.randint(0, n)])
        nstreams = rnd.choice([1, 2, 5])
        offs = [0] * nstreams
        entries = []
        for i in range(n):
            sid = rnd.randrange(nstreams) + 7
            cls = Odd if rnd.random() < 0.1 else CacheEntry
            data = bytearray(rnd.randint(0, 400) + 8)
            pay = memoryview(data)[4:-4] if rnd.random() < 0.5 else bytes(data)
            entries.append(cls(sid, offs[sid - 7], 1, pay, i, i + 1, durable=i < durable))
            offs[sid - 7] += 1
        calls = [(rnd.choice([0, 100, 5000, 1 << 30]), rnd.choice([-1, 0, 1, 3, 100]),
                  rnd.random() < 0.5) for _ in range(rnd.choice([1, 3]))]
        results = []
        for native in modes:
            lc = LogCache(1 << 30)
            for e in entries:
                lc.add(e)
            out, groups, cums = [], {}, {}
            sizes = [lc.take_grouped(mb, me, one, out, groups, cums, native=native)
                     for mb, me, one in calls]
            results.append((out, groups, cums, sizes, list(lc.pending), lc.pending_bytes))
            left = deque(entries)
            want, want_sizes = [], []
            for mb, me, one in calls:
                got, size = reference(left, mb, me, one)
                want.extend(got)
                want_sizes.append(size)
            assert out == want and sizes == want_sizes
            assert list(lc.pending) == list(left)
            assert lc.pending_bytes == sum(e.size for e in left)
            want_groups: dict = {}
            for e in want:
                want_groups.setdefault(e.stream_id, []).append(e)
            assert groups == want_groups
            for sid, recs in want_groups.items():
                assert cums[sid] == list(itertools.accumulate(len(e.payload) for e in recs))
        assert all(r == results[0] for r in results)


def test_log_cache_take_grouped_leaves_nothing_lost_on_an_error() -> None:
    """An entry whose payload has no length fails the take: what was popped before it is in
    ``out`` (the engine returns it to pending) and pending_bytes counts only the rest."""
    from storage.cache import log_cache
    for native in [False] + ([True] if log_cache._take_grouped is not None else []):
        lc = LogCache(1 << 30)
        good = [CacheEntry(1, i, 1, b"x" * 10, i, i + 1, durable=True) for i in range(3)]
        bad = CacheEntry(1, 3, 1, b"y", 3, 4, durable=True)
        for e in good + [bad]:
            lc.add(e)
        bad.payload = object()                  # type: ignore[assignment]
        out: list = []
        with pytest.raises(TypeError):
            lc.take_grouped(1 << 30, -1, True, out, {}, {}, native=native)
        assert out[:3] == good[:len(out[:3])]
        assert lc.pending_bytes == sum(e.size for e in lc.pending)
        lc.return_pending(out)
        assert list(lc.pending) == good + [bad]


async def test_sequential_reader_prefetches_the_next_window_in_the_background() -> None:
    """A reader halfway through its readahead gets the next window fetched while it reads
    (it then mostly hits); a prefetch that fails leaves nothing behind: the reader fetches
    the block itself."""
    data, blocks = _object()
    calls: list[int] = []
    fail_prefetch = [False]

    async def fetch(key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        calls.append(ranges[0][0])
        await asyncio.sleep(0.002)
        if fail_prefetch[0] and len(calls) > 1:
            raise OSError("store down")
        return [data[p:p + n] for p, n in ranges]

    bc = BlockCache(64 << 20, fetch)
    seen = await read_in_turn(bc, blocks, pause=0.001)  # pause: the reader's own work (sending)
    assert seen == list(range(400))
    assert bc.prefetches >= 2 and bc.misses <= 2, (bc.prefetches, bc.misses)

    bc = BlockCache(64 << 20, fetch)
    fail_prefetch[0] = True
    calls.clear()
    ra = Readahead()
    assert [r.base_offset for r in await bc.get("o", blocks, 0, ra)][0] == 0
    await asyncio.sleep(0.05)                       # a prefetch ran (and failed)
    fail_prefetch[0] = False
    got = await read_in_turn(bc, blocks, ra, start=1)
    assert 0 < got[0] and got == list(range(got[0], 400))


async def test_a_prefetch_is_claimed_before_it_runs_so_no_block_is_read_twice() -> None:
    """A reader that asks for a block of a prefetch that has not started yet waits for it;
    before, it fetched the same blocks again (a cold scan read 47 % of its bytes twice)."""
    data, blocks = _object()
    fetched: list[int] = []

    async def fetch(key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        fetched.extend(p for p, _ in ranges)
        await asyncio.sleep(0)
        return [data[p:p + n] for p, n in ranges]

    bc = BlockCache(64 << 20, fetch)
    # no pause: the prefetch task lags behind
    assert await read_in_turn(bc, blocks) == list(range(400))
    assert sorted(fetched) == sorted(set(fetched)) == [p for p, _ in blocks]
    assert bc.bytes_fetched == sum(n for _, n in blocks)


async def test_blocks_a_scan_has_passed_are_dropped_and_their_buffers_handed_back() -> None:
    """A catch-up scan keeps at most scan_keep_bytes of the blocks it has moved past (the rest
    go, their buffers to on_evict, so the store's pool reuses them instead of faulting in
    fresh memory); a block another reader hits again is kept."""
    data, blocks = _object()
    handed: list[object] = []

    async def fetch(key: str, ranges: list[tuple[int, int]]) -> list[bytearray]:
        return [bytearray(data[p:p + n]) for p, n in ranges]

    bc = BlockCache(64 << 20, fetch, readahead_max=64 << 10, on_evict=handed.append)
    assert bc.scan_keep_bytes == READAHEAD_INITIAL
    bc.scan_keep_bytes = 64 << 10
    ra = Readahead()
    for i in range(len(blocks)):
        await bc.get("o", blocks, i, ra)
        assert bc._passed_bytes <= 64 << 10
    assert bc.used < 4 * (64 << 10) + blocks[0][1] * 4, "passed blocks did not stay"
    assert len(handed) > len(blocks) // 2
    assert all(type(h) is bytearray for h in handed)
    # a second reader right behind still hits what the first one passed
    bc2 = BlockCache(64 << 20, fetch, readahead_max=64 << 10)
    bc2.scan_keep_bytes = 10 * blocks[0][1]
    a, b = Readahead(), Readahead()
    for i in range(20):
        await bc2.get("o", blocks, i, a)
        if i >= 2:
            await bc2.get("o", blocks, i - 2, b)
    assert bc2.misses <= 3 and bc2.hits >= 18


# one object per flush: a background upload in the middle of a fill (threshold or timer,
# which a loaded machine hits at other points) left tiny objects, and a read that runs from
# one into the next starts it with a miss
ONLY_FLUSH_UPLOADS = dict(upload_threshold_bytes=1 << 30, upload_interval_s=3600)


async def _consumer_work(reader) -> None:
    """The consumer's own work (sending) between reads, always slower than the store: it ends
    once every read ahead started so far (next objects' indexes, prefetch pieces) has been
    answered, so a miss counted is the readahead's state, not timing. (A fixed 2 ms pause did
    that only while the store answered sooner: at load > 6 the tests below saw 3 misses now
    and then, each at the first block of an object whose index load was still running.)"""
    await asyncio.sleep(0.002)
    while reader.reads_ahead:
        await asyncio.sleep(0.001)


async def test_a_sequential_reader_gets_the_next_objects_first_blocks_ahead(tmp_path) -> None:
    """Reading one stream across several objects: the next object's first window is fetched
    while the reader finishes the current one, so only the first object starts with a miss
    (before, every object did)."""
    from storage.engine import open_engine
    from storage_helpers import fill, read_all, small_config
    eng = open_engine(small_config(tmp_path, block_cache_bytes=8 << 20,
                                   readahead_max_bytes=64 << 10, **ONLY_FLUSH_UPLOADS))
    await eng.start()
    try:
        s = await eng.create_stream()
        for _ in range(6):
            await fill(s, 60, size=4000)             # ~240 KB per object, its own object
            await eng.flush()
        assert len(eng.reader.stream_ranges(s.stream_id)) == 6
        eng.drop_caches()
        bc = eng.reader.block_cache
        off, got = 0, 0
        while off < s.confirmed_offset:
            batches = await s.read(off, 16 << 10)
            got += len(batches)
            off = batches[-1].next_offset
            await _consumer_work(eng.reader)
        assert got == 360
        assert bc.misses <= 2, (bc.misses, bc.hits)
        assert bc.bytes_fetched <= sum(r.size for r in eng.reader.stream_ranges(s.stream_id))
    finally:
        await eng.close()


async def test_a_large_prefetch_is_read_in_pieces_the_reader_can_use_early() -> None:
    """A prefetch window of several MiB is fetched in pieces of at most PREFETCH_PIECE (each
    its own read on the cold threads), so a reader waits only for the piece holding its next
    block; every block is still read once, in order for the reader."""
    from storage.cache.block_cache import PREFETCH_PIECE
    data, blocks = _object(n=3000, size=16 << 10)       # ~48 MiB in 16 KiB blocks
    calls: list[int] = []

    async def fetch(key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        calls.append(sum(n for _, n in ranges))
        await asyncio.sleep(0.001)
        return [data[p:p + n] for p, n in ranges]

    bc = BlockCache(256 << 20, fetch, readahead_max=32 << 20)
    assert await read_in_turn(bc, blocks) == list(range(3000))
    assert bc.bytes_fetched == sum(n for _, n in blocks)   # nothing read twice
    assert max(calls) <= PREFETCH_PIECE
    assert bc.prefetches < len(calls)                       # windows were cut into pieces


async def test_a_reader_keeps_its_readahead_across_objects_while_prefetches_run(tmp_path) -> None:
    """A sequential reader whose readahead is about an object's size (a cold pass: 32 MiB
    windows, ~28 MiB objects) on a slow store: the next object's first window is fetched
    while the current object's prefetches still run, and neither moves the reader's own
    front, so only the very first block is a miss. Before, the next object's prefetch took
    over the reader's state, and the rest of its own object, or the next one, was fetched
    on demand with the readahead reset to 512 KiB (7 misses here)."""
    from storage.engine import open_engine
    from storage_helpers import fill, payload, small_config
    eng = open_engine(small_config(tmp_path, block_cache_bytes=16 << 20, log_cache_bytes=16 << 20,
                                   wal_capacity=32 << 20, readahead_max_bytes=1 << 20,
                                   **ONLY_FLUSH_UPLOADS))
    await eng.start()
    try:
        s = await eng.create_stream()
        for _ in range(8):
            await fill(s, 256, size=4000)            # ~1 MiB (64 blocks) per object
            await eng.flush()
        assert len(eng.reader.stream_ranges(s.stream_id)) == 8
        eng.drop_caches()
        io = eng.reader._io

        async def slow_io(fn, *args):                # a store that answers after 10 ms
            await asyncio.sleep(0.01)
            return await io(fn, *args)
        eng.reader._io = slow_io
        bc = eng.reader.block_cache
        off, got = 0, []
        while off < s.confirmed_offset:
            batches = await s.read(off, 16 << 10)
            got += batches
            off = batches[-1].next_offset
            await _consumer_work(eng.reader)
        assert [b.base_offset for b in got] == list(range(0, 8 * 256 * 5, 5))
        assert all(bytes(b.payload) == payload(s.stream_id, b.base_offset, 4000) for b in got)
        assert bc.misses <= 2, (bc.misses, bc.hits)
        assert bc.bytes_fetched <= sum(r.size for r in eng.reader.stream_ranges(s.stream_id))
    finally:
        await eng.close()


@contextlib.asynccontextmanager
async def _objects_read_once(tmp_path, objects: int, hot: bool, records: int = 60):
    """An engine holding one stream in ``objects`` small objects (~240 KB each, caches
    dropped), whose reader has read the first blocks of the first object with producers
    appending (``hot``) or not, and let the read-ahead it started run: (engine, stream,
    the stream's object ranges)."""
    from storage.engine import open_engine
    from storage_helpers import fill, small_config
    eng = open_engine(small_config(tmp_path, block_cache_bytes=16 << 20,
                                   readahead_max_bytes=4 << 20, **ONLY_FLUSH_UPLOADS))
    await eng.start()
    try:
        s = await eng.create_stream()
        for _ in range(objects):
            await fill(s, records, size=4000)        # ~240 KB per object, its own object
            await eng.flush()
        ranges = eng.reader.stream_ranges(s.stream_id)
        assert len(ranges) == objects
        eng.drop_caches()
        eng.reader.hot = lambda: hot
        await s.read(0, 16 << 10)                    # the first blocks of the first object
        await _consumer_work(eng.reader)
        yield eng, s, ranges
    finally:
        await eng.close()


async def test_a_reader_reads_ahead_into_every_object_within_its_readahead(tmp_path) -> None:
    """Objects smaller than the readahead (a cold pass: ~17 MiB objects, 32 MiB readahead):
    the reader at the start of one object already has the first windows of the following
    objects within its readahead on their way, each one's index loaded first. With one object
    ahead only, the object after next was asked for when the reader entered the next one, and
    a reader faster than two store round trips (index, then blocks) waited at every object
    (bench/HISTORY.md, session 18)."""
    async with _objects_read_once(tmp_path, 8, hot=False) as (eng, s, ranges):
        ahead = [r.object_id in eng.reader._index for r in ranges]
        assert ahead[:3] == [True, True, True], ahead
        bc = eng.reader.block_cache
        assert any(k[0] == ranges[2].key for k in bc._lru), "object 2's first window"
        misses = bc.misses
        off = 0
        while off < s.confirmed_offset:
            batches = await s.read(off, 16 << 10)
            off = batches[-1].next_offset
            await _consumer_work(eng.reader)
        assert bc.misses == misses, (bc.misses, misses)
        assert bc.bytes_fetched <= sum(r.size for r in ranges)


async def test_while_producers_append_a_reader_reads_ahead_into_the_next_object_only(tmp_path) -> None:
    """Catch-up reads beside producers are paced (item 5): the read-ahead into objects after
    the next one is for unpaced readers; while producers append, no more device reads are
    queued beside the WAL's writes than one object ahead."""
    async with _objects_read_once(tmp_path, 4, hot=True) as (eng, s, ranges):
        ahead = [r.object_id in eng.reader._index for r in ranges]
        assert ahead == [True, True, False, False], ahead


async def test_a_reader_reads_ahead_into_a_bounded_number_of_tiny_objects(tmp_path) -> None:
    """A run of tiny objects (a store outage's backlog is uploaded as ~100 objects of 2-17 KB)
    within the readahead: the reader reads ahead into at most AHEAD_KEYS of them. Before,
    every object within the readahead's bytes was read ahead (two store reads each), and the
    reader, remembering only AHEAD_KEYS of them, asked for the rest again at every read: its
    own read queued behind hundreds of store reads on the cold threads (a restarted broker
    served the tail for 50 s on a CPU-starved machine, FINDINGS lead 22:40)."""
    from storage.reader import AHEAD_KEYS
    async with _objects_read_once(tmp_path, 3 * AHEAD_KEYS, hot=False, records=2) as (eng, s,
                                                                                       ranges):
        ahead = [r.object_id in eng.reader._index for r in ranges]
        assert sum(ahead) <= 3 + AHEAD_KEYS, ahead      # the objects read, and 8 beyond
        assert ahead[:3] == [True, True, True], ahead
        off = 0
        while off < s.confirmed_offset:               # the whole stream, still in order
            batches = await s.read(off, 16 << 10)
            assert batches[0].base_offset == off
            off = batches[-1].next_offset
            await _consumer_work(eng.reader)


async def test_an_object_index_is_read_once_when_the_reader_meets_its_read_ahead(tmp_path) -> None:
    """A reader that reaches the next object while the read-ahead's load of that object's
    index is still on its way waits for that load instead of reading the index again (on a
    slow store, every object's tail was read twice)."""
    from storage.engine import open_engine
    from storage_helpers import fill, small_config
    eng = open_engine(small_config(tmp_path, block_cache_bytes=8 << 20,
                                   readahead_max_bytes=1 << 20, **ONLY_FLUSH_UPLOADS))
    await eng.start()
    try:
        s = await eng.create_stream()
        for _ in range(6):
            await fill(s, 4, size=1000)              # ~4 KB per object, its own object
            await eng.flush()
        ranges = eng.reader.stream_ranges(s.stream_id)
        assert len(ranges) == 6
        eng.drop_caches()
        io = eng.reader._io
        tails: list[str] = []
        get = eng.reader.store.get

        async def slow_io(fn, *args):                # a store that answers after 20 ms
            if fn == get:
                tails.append(args[0])
            await asyncio.sleep(0.02)
            return await io(fn, *args)
        eng.reader._io = slow_io
        off = 0
        while off < s.confirmed_offset:              # a reader that never waits
            batches = await s.read(off, 1 << 20)
            off = batches[-1].next_offset
        while eng.reader.reads_ahead:
            await asyncio.sleep(0.005)
        assert sorted(tails) == sorted({r.key for r in ranges}), tails
    finally:
        await eng.close()


async def test_a_new_readers_first_window_is_what_its_request_takes() -> None:
    """A reader starting (or jumping) with a request that takes more than READAHEAD_INITIAL
    gets that much (up to the readahead's maximum) in its first store read, not 512 KiB and
    then a doubling per round trip (a cold pass after a restart spent its first ~0.25 s on
    that ramp, bench/HISTORY.md session 26); a small request keeps the small first window."""
    data, blocks = _object(1200)
    calls: list[int] = []

    async def fetch(key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        calls.append(ranges[-1][0] + ranges[-1][1] - ranges[0][0])
        return [data[p:p + n] for p, n in ranges]

    bc = BlockCache(64 << 20, fetch)
    assert sum(n for _, n in blocks) > 3 * READAHEAD_INITIAL
    await bc.get("o", blocks, 0, Readahead(), 2 * READAHEAD_INITIAL)
    assert READAHEAD_INITIAL < calls[0] <= 2 * READAHEAD_INITIAL, calls
    bc.clear()
    calls.clear()
    await bc.get("o", blocks, 0, Readahead(), 64 << 10)
    assert calls[0] <= READAHEAD_INITIAL, calls
    # capped by the readahead's maximum
    bc = BlockCache(64 << 20, fetch, readahead_max=256 << 10)
    calls.clear()
    await bc.get("o", blocks, 0, Readahead(), 2 * READAHEAD_INITIAL)
    assert calls[0] <= READAHEAD_INITIAL, calls


async def test_an_object_reader_sizes_its_first_window_by_the_reads_budget(tmp_path) -> None:
    """ObjectReader.read hands its request's budget to the BlockCache: a read of 2 MiB from a
    cold stream starts with one store read of more than READAHEAD_INITIAL (with no producer
    appending: while they do, a read takes at most cold_read_max_bytes, which keeps the small
    first window of the paced catch-up path)."""
    from storage.engine import open_engine
    from storage_helpers import fill, small_config
    eng = open_engine(small_config(tmp_path, block_cache_bytes=64 << 20, **ONLY_FLUSH_UPLOADS))
    await eng.start()
    try:
        s = await eng.create_stream()
        await fill(s, 120, size=16000)           # ~2 MB in one object
        await eng.flush()
        eng.drop_caches()
        bc = eng.reader.block_cache
        sizes: list[int] = []
        inner = bc._fetch

        async def fetch(key: str, ranges: list[tuple[int, int]]) -> list:
            sizes.append(sum(n for _, n in ranges))
            return await inner(key, ranges)
        bc._fetch = fetch
        eng.cold_pacer._hot_at = float("-inf")     # the fill's appends: not producers now
        batches = await s.read(0, 2 << 20)
        assert batches and sizes[0] > READAHEAD_INITIAL, sizes
        # while producers append: the catch-up slice, the small first window as before
        eng.drop_caches()
        sizes.clear()
        eng.cold_pacer._hot_at = eng.cold_pacer._clock()
        assert eng.cold_pacer.hot_active()
        await s.read(0, 2 << 20)
        assert sizes[0] <= READAHEAD_INITIAL, sizes
    finally:
        await eng.close()


async def test_a_sequential_reader_reads_ahead_across_the_gaps_of_a_gather_put() -> None:
    """Blocks with gaps of < 4 KiB before them (a gather put's layout): the reader is still
    sequential - its readahead grows, the next windows are prefetched while it reads, it
    misses as rarely as over back-to-back blocks. (Counted as jumps, every block after a gap
    reset the readahead and started no prefetch: cold passes ran ~30 % slower.)"""
    import random

    from test_object_gaps import _with_gaps

    data, _ = _object()
    gapped, index = _with_gaps(bytes(data), random.Random(7))
    blocks = sorted({(e.position, e.size) for e in index})
    assert all(b[0] > a[0] + a[1] for a, b in zip(blocks, blocks[1:]))     # a gap before each
    calls: list[tuple[int, int]] = []

    async def fetch(key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        calls.append((ranges[0][0], ranges[-1][0] + ranges[-1][1]))
        await asyncio.sleep(0.002)
        return [gapped[p:p + n] for p, n in ranges]

    bc = BlockCache(64 << 20, fetch)
    assert await read_in_turn(bc, blocks, pause=0.001) == list(range(400))
    assert bc.prefetches >= 2 and bc.misses <= 2, (bc.prefetches, bc.misses)
    assert len(calls) < len(blocks) / 4
    assert max(e - s for s, e in calls) > READAHEAD_INITIAL, "readahead grew"
