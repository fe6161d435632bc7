"""Encoding an object on the event loop in slices lets other callbacks run in between."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from storage import copycrc
from storage.cache.log_cache import CacheEntry
from storage.loop_slices import CHECK_EVERY, encode_object_in_slices, object_size_in_slices
from storage.objects.format import NATIVE_CHECK_EVERY, Record, encode_object, object_size


def _records(n: int) -> list[Record]:
    return [Record(1, 3 * i, 3, bytes([i % 251]) * 700) for i in range(n)]


async def _turns_during(work: Awaitable[Any]) -> tuple[int, Any]:
    """(loop turns another task got while ``work`` ran, work's result)."""
    turns = 0
    done = False

    async def count_turns() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.ensure_future(count_turns())
    await asyncio.sleep(0)
    start = turns
    result = await work
    during = turns - start
    done = True
    await counter
    return during, result


async def test_sliced_encode_yields_to_the_loop_and_matches_encode_object() -> None:
    """With a zero slice the encoder yields after every step - a record in Python, the
    block in which NATIVE_CHECK_EVERY records were reached in C: a task that counts loop turns
    must get about one turn per step (without yields it would get none until the encode is
    over), and the bytes are those of encode_object."""
    recs = _records(2000)
    during, (data, index, ranges) = await _turns_during(
        encode_object_in_slices(recs, 4096, slice_s=0.0))
    # 6 records of 700 B fill a 4 KiB block
    step = NATIVE_CHECK_EVERY + 6 if copycrc.encode_blocks is not None else 1
    assert during >= len(recs) // step - 1
    want, want_index, want_ranges = encode_object(recs, 4096)
    assert bytes(data) == bytes(want)
    assert index == want_index
    assert [(r.stream_id, r.start_offset, r.end_offset) for r in ranges] == \
        [(r.stream_id, r.start_offset, r.end_offset) for r in want_ranges]


async def test_sliced_encode_does_not_yield_within_a_slice() -> None:
    """A long slice does the whole (small) object in one go, on the loop (a worker thread
    would let the counting task run meanwhile): slicing costs nothing when the work is
    short."""
    during, _ = await _turns_during(encode_object_in_slices(_records(20), 4096, slice_s=10.0))
    assert during == 0


def test_thread_encode_of_large_records_releases_the_gil_and_matches_encode_object() -> None:
    """Objects of large records are encoded on a worker thread (encode_object_into): their
    payload copies run with the GIL released (with a 0.2 s switch interval another thread runs
    Python during the copies only if they release it), and views of writable frames and
    read-only bytes alike give the bytes of encode_object."""
    import mmap
    import sys
    import threading
    import time

    from storage.loop_slices import encode_object_into
    from storage.objects.format import NOGIL_COPY_FROM, _copy_nogil

    n = NOGIL_COPY_FROM * 8
    frames = [bytearray(bytes([i]) * (n + 100)) for i in range(24)]
    recs = [Record(1 + i // 12, 7 * (i % 12), 7,
                   memoryview(f)[50:50 + n] if i % 3 else bytes(f[50:50 + n]))
            for i, f in enumerate(frames)]
    want = encode_object([Record(r.stream_id, r.base_offset, r.count, bytes(r.payload))
                          for r in recs], 1 << 20)
    into = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE)
    got = encode_object_into(recs, 1 << 20, into)
    assert bytes(got[0]) == bytes(want[0])
    assert got[1] == want[1] and [vars(r) for r in got[2]] == [vars(r) for r in want[2]]
    assert not _copy_nogil(into, 0, bytes(n), n)       # read-only: the caller slices

    src = bytearray(8 << 20)
    ticks = 0
    stop = False

    def count() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1

    old = sys.getswitchinterval()
    t = threading.Thread(target=count)
    t.start()
    try:
        time.sleep(0.01)
        sys.setswitchinterval(0.2)
        time.sleep(0.01)
        during = 0
        # single copies until one lets the counter run, for up to 5 s (each costs up to a
        # switch interval to get the GIL back from the counter; on a loaded machine - 4 test
        # workers on 2 cores - the counter may get no CPU during many copies). A copy that
        # holds the GIL never lets it run: it takes far less than the 0.2 s interval
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            before = ticks
            assert _copy_nogil(into, 0, memoryview(src), len(src))
            during = ticks - before
            if during:
                break
    finally:
        sys.setswitchinterval(old)
        stop = True
        t.join()
    assert during > 0


async def test_sliced_object_size_yields_and_matches_object_size() -> None:
    """The upload sizes its object in slices too: the same figure as object_size for mixed
    streams and block sizes, and loop turns in between (a 64 MiB upload of small requests is
    ~45,000 records: unsliced, one 5-10 ms stall)."""
    recs = [Record(s, 3 * i, 3, bytes([i % 251]) * (50 + 37 * (i % 23)))
            for s in (1, 2, 5) for i in range(3000)]
    for block in (512, 4096, 1 << 20):
        assert await object_size_in_slices(recs, block) == object_size(recs, block)
    assert await object_size_in_slices([], 4096) == object_size([], 4096)
    during, size = await _turns_during(object_size_in_slices(recs, 4096, slice_s=0.0))
    assert size == object_size(recs, 4096)
    assert during >= len(recs) // CHECK_EVERY - 1


async def test_cache_entries_encode_like_records() -> None:
    """The uploader hands its LogCache entries to the encoder as they are (no Record per
    entry): the object is byte for byte the one of the equivalent Records."""
    recs = _records(300)
    entries = [CacheEntry(r.stream_id, r.base_offset, r.count, r.payload) for r in recs]
    size = await object_size_in_slices(entries, 4096)
    data, index, _ = await encode_object_in_slices(entries, 4096, size=size)
    want, want_index, _ = encode_object(recs, 4096)
    assert bytes(data) == bytes(want)
    assert index == want_index


async def test_sliced_encode_waits_what_pause_asks_after_each_slice() -> None:
    """A background upload paces its encode: ``pause()`` is asked after every slice and
    waited (the engine answers 0 once anything waits for the upload)."""
    asked: list[float] = []

    def pause() -> float:
        asked.append(0.002)
        return 0.002
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    # C: a step ends at the block where NATIVE_CHECK_EVERY records were reached
    n = 20 * (NATIVE_CHECK_EVERY + 6) if copycrc.encode_blocks is not None else 20
    data, _, _ = await encode_object_in_slices(_records(n), 4096, slice_s=0.0, pause=pause)
    assert len(asked) >= 19 and loop.time() - t0 >= 19 * 0.002
    assert bytes(data) == bytes(encode_object(_records(n), 4096)[0])
