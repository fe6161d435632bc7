"""storage/wal/aio.py's UringContext (storage._copycrc uring_*): WAL writes through io_uring
on a real O_DIRECT file, plain and from registered (fixed) buffers, with the same completions
and bytes as libaio's; and the WAL's loop driver on it (S3KAFKA_WAL_IO=uring)."""
from __future__ import annotations

import ctypes
import mmap
import os
import select

import pytest

from storage.wal import aio
from storage.wal.aio import AioUnavailable, UringContext


def _ring(depth: int = 8) -> UringContext:
    try:
        return UringContext(depth)
    except AioUnavailable as e:
        pytest.skip(f"io_uring unavailable: {e}")


@pytest.fixture
def dfd(tmp_path):
    """A 4 MiB file opened O_DIRECT (plain where the file system refuses O_DIRECT)."""
    path = tmp_path / "f"
    path.write_bytes(b"\0" * (4 << 20))
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDWR)
    yield fd
    os.close(fd)


def _addr(m: mmap.mmap) -> tuple[ctypes.c_char, int]:
    c = ctypes.c_char.from_buffer(m)
    return c, ctypes.addressof(c)


def _wait_reap(r: UringContext, want: int) -> list[tuple[int, int]]:
    got: list[tuple[int, int]] = []
    while len(got) < want:
        assert select.select([r.eventfd], [], [], 10)[0], "no completion signalled"
        r.clear_signal()
        got += r.reap()
    return got


def test_fixed_and_plain_writes_land_and_complete(dfd):
    """A write inside a registered slab goes as WRITE_FIXED, one outside it, and a two-piece
    write, as plain writes; every one completes with its token and byte count, and the file
    holds each source's bytes where it was written."""
    r = _ring()
    slab = mmap.mmap(-1, 1 << 20)
    other = mmap.mmap(-1, 1 << 20)
    try:
        slab[:] = bytes(range(256)) * 4096
        other[:] = b"\x5a" * (1 << 20)
        ks, base = _addr(slab)
        ko, obase = _addr(other)
        r.register([(base, 1 << 20)])
        r.submit_write(dfd, [(base + 4096, 256 << 10)], 0, 1, True)             # fixed
        assert r.fixed_writes == 1
        r.submit_write(dfd, [(obase, 256 << 10)], 1 << 20, 2, True)             # plain
        r.submit_write(dfd, [(base, 4096), (obase, 8192)], 2 << 20, 3, False)   # writev
        r.submit_write(dfd, [(base + (1 << 20) - 4096, 8192)], 3 << 20, 4, True)
        assert r.fixed_writes == 1          # crosses the slab's end: not fixed (EFAULT else)
        assert sorted(_wait_reap(r, 4)) == [(1, 256 << 10), (2, 256 << 10), (3, 12288),
                                            (4, 8192)]
        rfd = os.open(f"/proc/self/fd/{dfd}", os.O_RDONLY)
        try:
            got = os.pread(rfd, 4 << 20, 0)
        finally:
            os.close(rfd)
        assert got[:256 << 10] == bytes(slab[4096:4096 + (256 << 10)])
        assert got[1 << 20:(1 << 20) + (256 << 10)] == b"\x5a" * (256 << 10)
        assert got[2 << 20:(2 << 20) + 12288] == bytes(slab[:4096]) + b"\x5a" * 8192
        del ks, ko
    finally:
        r.close()


def test_a_failed_write_reports_its_errno(dfd):
    """An unaligned O_DIRECT write completes (or is refused) with an error, as libaio's."""
    r = _ring()
    buf = mmap.mmap(-1, 8192)
    try:
        k, base = _addr(buf)
        try:
            r.submit_write(dfd, [(base + 1, 4096)], 0, 7, True)
        except OSError:
            return
        [(token, res)] = _wait_reap(r, 1)
        assert token == 7 and (res < 0 or res == 4096)   # 4096: O_DIRECT was refused
        del k
    finally:
        r.close()


def test_register_rejects_overlaps_and_closed_rings():
    r = _ring()
    m = mmap.mmap(-1, 1 << 16)
    k, base = _addr(m)
    with pytest.raises(ValueError):
        r.register([(base, 8192), (base + 4096, 8192)])
    r.register([])
    ring = r._ring
    r.close()
    with pytest.raises(ValueError):          # a closed ring's capsule refuses its calls
        aio._ext.uring_reap(ring)
    del k


def test_open_context_follows_the_setting(monkeypatch):
    """S3KAFKA_WAL_IO=uring selects the ring; anything else libaio."""
    monkeypatch.setattr(aio, "WAL_IO", "uring")
    ctx = aio.open_context(8)
    try:
        if aio._c_uring_setup is not None:
            assert isinstance(ctx, UringContext)
    finally:
        ctx.close()
    monkeypatch.setattr(aio, "WAL_IO", "aio")
    ctx = aio.open_context(8)
    try:
        assert isinstance(ctx, aio.AioContext)
    finally:
        ctx.close()
