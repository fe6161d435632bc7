"""The file store's read buffer pool (storage/objects/buffers.py): a buffer comes back for
reuse only once no view of it is left (a block's records, a Fetch answer being written)."""
from __future__ import annotations

from storage.objects.buffers import BufferPool

MiB = 1 << 20


def test_a_buffer_is_reused_only_once_no_view_of_it_is_left() -> None:
    pool = BufferPool(max_bytes=16 * MiB)
    buf = pool.take(MiB)
    view = memoryview(buf)[10:20]
    pool.give_back(buf)
    del buf
    other = pool.take(MiB)
    assert other is not view.obj and pool.reused == 0, "a buffer still seen was handed out"
    seen = id(view.obj)
    view.release()
    del view
    again = pool.take(MiB)
    assert id(again) == seen and pool.reused == 1



def test_buffers_returned_while_still_seen_are_reused_beyond_the_free_budget() -> None:
    # a cold pass hands spans back when their first block leaves the BlockCache, the other
    # blocks still cached: those buffers are memory in use, not idle, and must come back
    pool = BufferPool(max_bytes=4 * MiB)
    bufs = [pool.take(2 * MiB) for _ in range(4)]           # 8 MiB: twice the free budget
    views = [memoryview(b)[:16] for b in bufs]
    ids = [id(b) for b in bufs]
    for b in bufs:
        pool.give_back(b)
    del b, bufs
    again = []
    for v in views:                   # seen no more one by one, each taken again meanwhile
        v.release()
        again.append(pool.take(2 * MiB))
    del v, views
    assert [id(b) for b in again] == ids and pool.reused == 4 and pool.fresh == 4


def test_a_larger_free_buffer_serves_a_smaller_read() -> None:
    pool = BufferPool(max_bytes=64 * MiB)
    big, mid = pool.take(8 * MiB), pool.take(2 * MiB)
    seen_big, seen_mid = id(big), id(mid)
    pool.give_back(big)
    pool.give_back(mid)
    del big, mid
    one = pool.take(MiB)
    assert id(one) == seen_mid, "the smallest free buffer that fits is taken"
    other = pool.take(MiB)
    assert id(other) == seen_big and pool.fresh == 2 and pool.reused == 2


def test_idle_and_returned_buffers_stay_bounded() -> None:
    pool = BufferPool(max_bytes=2 * MiB, max_returned=4 * MiB)
    bufs = [pool.take(MiB) for _ in range(8)]
    views = [memoryview(b)[:1] for b in bufs]
    for b in bufs:
        pool.give_back(b)
    assert pool.bytes <= 4 * MiB and pool.dropped == 4
    for v in views:
        v.release()
    del b, bufs, v, views
    pool.take(MiB)                    # collects: 2 MiB of free buffers at most are kept
    assert pool.bytes <= 2 * MiB
