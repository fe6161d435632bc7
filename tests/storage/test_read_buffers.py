"""The file store's read buffer pool (storage/objects/buffers.py): a buffer comes back for
reuse only once no view of it is left (a block's records, a Fetch answer being written)."""
from __future__ import annotations

import ctypes
import os

import pytest

from storage.copycrc import fault_in
from storage.objects import buffers
from storage.objects.buffers import BufferPool, fresh_buffer

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
    assert pool.limit == 6 * MiB
    bufs = [pool.take(MiB) for _ in range(8)]
    views = [memoryview(b)[:1] for b in bufs]
    for b in bufs:
        pool.give_back(b)
    assert pool.bytes <= 4 * MiB and pool.dropped == 4
    for v in views:
        v.release()
    del b, bufs, v, views
    pool.take(MiB)                    # collects: the 3 others are free now
    assert pool.bytes == 3 * MiB
    more = [pool.take(MiB) for _ in range(8)]      # 3 reused, 5 fresh
    views = [memoryview(b)[:1] for b in more]
    for b in more:                    # returned while seen: idle ones make room for them
        pool.give_back(b)
        assert pool.bytes <= pool.limit
    assert pool._returned_bytes == 4 * MiB and pool.bytes <= pool.limit
    del b, more
    for v in views:
        v.release()
    del v, views
    pool.take(MiB)
    assert pool.bytes <= pool.limit


def test_a_paused_readers_buffers_are_all_kept_for_its_next_window() -> None:
    """A paced catch-up reader's readahead ramps up again after each pause (spans of 1, 2, 4,
    then 7.5 MiB); its buffers all come back while it is paused. They are kept as long as
    free and returned ones together stay within the pool's bound, so its later windows map
    no fresh buffer (with the free list capped at max_bytes, the 7.5 MiB ones were let go and
    every window mapped them again, each faulted in afresh: issue 20 item 5)."""
    pool = BufferPool(max_bytes=12 * MiB)                # bound: 12 + 24 MiB
    ramp = [MiB, MiB, 2 * MiB, 4 * MiB, 7 * MiB + MiB // 2, 7 * MiB + MiB // 2]
    for window in range(4):
        bufs = [pool.take(n) for n in ramp]
        views = [memoryview(b)[:1] for b in bufs]       # the blocks read into them
        for b in bufs:                                   # the BlockCache drops the blocks
            pool.give_back(b)
        del b, bufs
        for v in views:
            v.release()
        del v, views
        assert pool.fresh == len(ramp), f"window {window} mapped fresh buffers"
    assert pool.dropped == 0 and pool.reused == 3 * len(ramp)


def test_larger_free_buffers_are_kept_over_smaller_ones() -> None:
    """With the pool full, a buffer coming back makes room by letting go of free ones,
    smallest first: a larger free buffer serves a smaller read too, a smaller one not a
    larger."""
    pool = BufferPool(max_bytes=2 * MiB, max_returned=4 * MiB)     # bound: 6 MiB
    small = [pool.take(MiB) for _ in range(6)]
    big = pool.take(4 * MiB)
    seen_big = id(big)
    while small:                       # seen by no one: free once collected
        pool.give_back(small.pop())
    assert pool.bytes == 6 * MiB and pool.dropped == 0
    view = memoryview(big)[:1]         # a block still cached in it
    pool.give_back(big)
    del big
    assert pool.bytes == 6 * MiB and pool.dropped == 4, "four 1 MiB ones made room"
    view.release()
    del view
    again = pool.take(4 * MiB)
    assert id(again) == seen_big and pool.fresh == 7 and pool.reused == 1


def test_fresh_buffers_are_mapped_without_the_interpreter_lock(monkeypatch) -> None:
    """A fresh pool buffer comes from storage._copycrc's map_buffer (mmap and MADV_HUGEPAGE
    with the interpreter lock released: both wait for the process's mmap lock behind other
    threads' page faults, and through Python's mmap module a cold thread waited so holding
    the lock the event loop needs, bench/HISTORY.md session 24): a writable, page-aligned
    buffer of the size asked (rounded to GRANULE), huge pages asked for from HUGE, reused
    and bounded like any other."""
    if buffers._map_buffer is None:
        pytest.skip("storage._copycrc not built")
    calls = []
    real = buffers._map_buffer
    monkeypatch.setattr(buffers, "_map_buffer",
                        lambda n, huge: calls.append((n, huge)) or real(n, huge))
    pool = BufferPool(max_bytes=64 * MiB)
    small, big = pool.take(100_000), pool.take(3 * MiB + 5)
    assert calls == [(2 * buffers.GRANULE, False), (3 * MiB + buffers.GRANULE, True)]
    assert (len(small), len(big)) == (2 * buffers.GRANULE, 3 * MiB + buffers.GRANULE)
    view = memoryview(big)
    assert not view.readonly and view.format == "B" and view.obj is big
    view[-1] = 7
    assert memoryview(big)[-1] == 7 and bytes(memoryview(small)[:3]) == b"\0\0\0"
    assert ctypes.addressof(ctypes.c_char.from_buffer(view)) % 4096 == 0
    view.release()
    seen = id(big)
    pool.give_back(big)
    del big
    assert id(pool.take(3 * MiB)) == seen and pool.reused == 1 and len(calls) == 2


def _resident_pages(buf: object) -> tuple[int, int]:
    """(resident, total) 4 KiB pages of a page-aligned buffer, by mincore(2): an anonymous
    page never touched is not resident."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    n = len(buf)
    pages = -(-n // os.sysconf("SC_PAGE_SIZE"))
    vec = ctypes.create_string_buffer(pages)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert libc.mincore(addr, n, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw), pages


def test_fresh_buffers_are_faulted_in_before_the_read() -> None:
    """A fresh buffer comes out of take with every page faulted in (storage._copycrc's
    fault_in, a write per page on the cold thread): left to the O_DIRECT read, the kernel
    faults them in while pinning them, under the process's mmap_lock, and the event loop's
    mmap/munmap waits for the read (bench/HISTORY.md session 36 coldfault). Both kinds of
    fresh buffer (map_buffer's, and Python's mmap on the paced path), with and without
    huge pages; a reused buffer is handed out as it is."""
    if fault_in is None:
        pytest.skip("storage._copycrc not built (no fault_in)")
    pool = BufferPool(max_bytes=64 * MiB)
    for size, unlocked in ((MiB, True), (MiB, False), (6 * MiB, True), (6 * MiB, False)):
        buf = pool.take(size, unlocked=unlocked)
        resident, pages = _resident_pages(buf)
        assert resident == pages, (size, unlocked, resident, pages)
    taken = pool.fresh
    pool.give_back(buf)
    del buf
    again = pool.take(6 * MiB)
    assert pool.fresh == taken and pool.reused == 1
    assert _resident_pages(again)[0] == _resident_pages(again)[1]


def test_a_fresh_mapping_is_not_resident_until_touched() -> None:
    """The check above can fail: an untouched fresh mapping has no resident page."""
    for unlocked in (True, False):
        assert _resident_pages(fresh_buffer(MiB, unlocked))[0] == 0
