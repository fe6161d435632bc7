"""Cold read buffers on whole huge pages (storage._copycrc.map_buffer, issue 20 item 3)."""
from __future__ import annotations

import ctypes
import os

import pytest

from storage.copycrc import map_buffer
from storage.objects.buffers import GRANULE, HUGE

MiB = 1 << 20


def _address(buf: object) -> int:
    view = memoryview(buf)
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    finally:
        view.release()


def _mapping_of(addr: int) -> tuple[int, int]:
    """(start, end) of the mapping holding ``addr`` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return lo, hi
    raise AssertionError("not mapped")


@pytest.mark.skipif(map_buffer is None, reason="storage._copycrc not built")
def test_huge_buffers_start_on_a_huge_page() -> None:
    """A huge-page read buffer starts on a 2 MiB boundary, so the pages under an O_DIRECT
    read into it are huge ones up to its last boundary (the part of a buffer before its
    first boundary was 4 KiB pages, which the virtio disk takes at most 254 per request).
    Sizes like a cold span's (8 MiB plus a granule, 7 MiB) were placed anywhere by mmap;
    the buffer and its mapping are the (page-rounded) length asked for."""
    bufs = [map_buffer(n, True) for n in (8 * MiB + GRANULE, 7 * MiB, 3 * MiB + 4096)]
    for buf, n in zip(bufs, (8 * MiB + GRANULE, 7 * MiB, 3 * MiB + 4096)):
        addr = _address(buf)
        assert len(buf) == n and addr % HUGE == 0
        lo, hi = _mapping_of(addr)
        # (neighbouring mappings of the same kind may be merged into one: only the edges
        # that belong to this buffer are checked)
        assert lo <= addr and hi >= addr + -(-n // 4096) * 4096
        view = memoryview(buf)
        view[0], view[-1] = 1, 2                # writable over its whole length
        assert (view[0], view[-1]) == (1, 2)
        view.release()


@pytest.mark.skipif(map_buffer is None, reason="storage._copycrc not built")
def test_small_and_plain_buffers_are_mapped_as_asked(tmp_path) -> None:
    """Below HUGE, or without ``huge``, a buffer is a page-rounded mapping of its size, and
    an O_DIRECT-sized read into an aligned huge buffer returns the file's bytes."""
    small, plain = map_buffer(100_000, True), map_buffer(3 * MiB, False)
    assert (len(small), len(plain)) == (100_000, 3 * MiB)
    assert _address(small) % 4096 == 0 and _address(plain) % 4096 == 0
    path = tmp_path / "obj"
    data = os.urandom(4 * MiB)
    path.write_bytes(data)
    buf = map_buffer(4 * MiB + GRANULE, True)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.preadv(fd, [memoryview(buf)[:4 * MiB]], 0) == 4 * MiB
    finally:
        os.close(fd)
    assert bytes(memoryview(buf)[:4 * MiB]) == data
