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

