"""storage/wal/aio.py's UringContext (storage._copycrc uring_*): WAL writes through io_uring
on a real O_DIRECT file, plain and from registered (fixed) buffers, with the same completions
and bytes as libaio's; and the WAL's loop driver on it (WALConfig.io_engine "uring")."""
from __future__ import annotations

import logging
import mmap
import os
import sys
import threading
import time

import pytest

from storage.wal import DeltaWAL, WALConfig, aio
from storage.wal.aio import AioUnavailable, UringContext

from .aio_util import address_of, wait_reap


def _ring(depth: int = 8) -> UringContext:
    try:
        return UringContext(depth)
    except AioUnavailable as e:
        pytest.skip(f"io_uring unavailable: {e}")


def _arena():
    """A frame arena of 4 KiB-page slabs (1 MiB max) grown by one populated slab: registered
    with every ring at its next submit."""
    ext = aio._ext
    if getattr(ext, "frame_arena", None) is None:
        pytest.skip("storage._copycrc without frame_arena")
    arena = ext.frame_arena(2 << 20, 2 << 20, False)
    assert arena.grow(True)
    return arena


def _read(fd: int, size: int) -> bytes:
    rfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    try:
        return os.pread(rfd, size, 0)
    finally:
        os.close(rfd)


def test_fixed_and_plain_writes_land_and_complete(dfd):
    """A write from an arena frame goes as WRITE_FIXED; one from other memory, and a two-piece
    write, as plain writes; every one completes with its token and byte count, and the file
    holds each source's bytes where it was written."""
    r = _ring()
    arena = _arena()
    frame = arena.take(1 << 20)
    other = mmap.mmap(-1, 1 << 20)
    try:
        memoryview(frame)[:] = bytes(range(256)) * 4096
        other[:] = b"\x5a" * (1 << 20)
        ks, base = address_of(frame)
        ko, obase = address_of(other)
        r.submit_write(dfd, [(base + 4096, 256 << 10)], 0, 1, True)             # fixed
        assert r.fixed_writes == 1
        r.submit_write(dfd, [(obase, 256 << 10)], 1 << 20, 2, True)             # plain
        r.submit_write(dfd, [(base, 4096), (obase, 8192)], 2 << 20, 3, False)   # writev
        assert r.fixed_writes == 1
        r.submit_write(dfd, [(base, 8192), (base + 16384, 4096)], 3 << 20, 4, True)
        # both pieces in one slab: WRITEV_FIXED where the kernel has it (6.15+)
        assert r.fixed_writes == (2 if aio._ext.uring_writev_fixed(r._ring) else 1)
        assert sorted(wait_reap(r, 4)) == [(1, 256 << 10), (2, 256 << 10), (3, 12288),
                                            (4, 12288)]
        got = _read(dfd, 4 << 20)
        assert got[:256 << 10] == bytes(frame)[4096:4096 + (256 << 10)]
        assert got[1 << 20:(1 << 20) + (256 << 10)] == b"\x5a" * (256 << 10)
        assert got[2 << 20:(2 << 20) + 12288] == bytes(frame)[:4096] + b"\x5a" * 8192
        assert got[3 << 20:(3 << 20) + 12288] == bytes(frame)[:8192] + bytes(frame)[16384:20480]
        del ks, ko
    finally:
        r.close()


def test_a_slab_mapped_again_is_written_from_its_new_pages(dfd):
    """An arena that goes unmaps its slabs; memory mapped again at the same addresses (a new
    arena) must be written from its own pages: a ring that still had the old slab registered
    would write the old pages' bytes (WRITE_FIXED uses the pages pinned at registration)."""
    r = _ring()
    try:
        seen = set()
        for fill in (0x11, 0x22, 0x33):
            arena = _arena()
            frame = arena.take(1 << 20)
            memoryview(frame)[:] = bytes([fill]) * (1 << 20)
            k, base = address_of(frame)
            seen.add(base)
            r.submit_write(dfd, [(base, 1 << 20)], 0, fill, True)
            assert wait_reap(r, 1) == [(fill, 1 << 20)]
            assert _read(dfd, 1 << 20) == bytes([fill]) * (1 << 20)
            del k, frame, arena              # the arena goes: its slab is unmapped
        assert r.fixed_writes == 3
    finally:
        r.close()


def test_a_ring_refreshed_from_another_thread_has_the_new_slab_and_writes_it_fixed(dfd):
    """refresh_fixed() (the frame arena's filler, for the event loop's ring) registers a slab
    mapped since the ring's last submit, from another thread; the owner's next write from it
    goes as WRITE_FIXED with the slab's bytes. Without an arena change it registers nothing."""
    r = _ring()
    try:
        assert r.registered_bytes == 0
        arena = _arena()                          # one 2 MiB slab, not yet on this ring
        t = threading.Thread(target=r.refresh_fixed)
        t.start()
        t.join()
        assert r.registered_bytes == 2 << 20
        frame = arena.take(1 << 20)
        memoryview(frame)[:] = b"\x6b" * (1 << 20)
        k, base = address_of(frame)
        r.submit_write(dfd, [(base, 1 << 20)], 0, 9, True)
        assert r.fixed_writes == 1
        assert wait_reap(r, 1) == [(9, 1 << 20)]
        assert _read(dfd, 1 << 20) == b"\x6b" * (1 << 20)
        r.refresh_fixed()                         # nothing new: stays as it is
        assert r.registered_bytes == 2 << 20
        del k, frame, arena                       # the slab goes: the next sync drops it
        r.refresh_fixed()
        assert r.registered_bytes == 0
    finally:
        r.close()


def test_registering_slabs_lets_other_threads_run():
    """Pinning slabs for a ring (~2-3 ms per 64 MiB here) happens with the interpreter lock
    released: another thread runs Python meanwhile. Held, it stalled the event loop 31-65 ms
    at a broker's first uploads (every gather put's ring registers every slab once). The
    switch interval is made long so the registering thread never gives the lock up on its
    own; three tries for a machine too busy to schedule the other thread in time."""
    ext = aio._ext
    if getattr(ext, "frame_arena", None) is None:
        pytest.skip("storage._copycrc without frame_arena")
    arena = ext.frame_arena(64 << 20, 256 << 20, False)
    for _ in range(4):
        assert arena.grow(True)
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        for _attempt in range(3):
            r = _ring()
            span: list[float] = []
            ticks: list[float] = []

            def register() -> None:
                span.append(time.perf_counter())
                r.refresh_fixed()
                span.append(time.perf_counter())

            t = threading.Thread(target=register)
            t.start()
            while t.is_alive():
                ticks.append(time.perf_counter())
                time.sleep(0.0002)
            t.join()
            assert r.registered_bytes == 256 << 20
            r.close()
            if any(span[0] < x < span[1] for x in ticks):
                return
        pytest.fail(f"no other thread ran while 256 MiB were registered ({span})")
    finally:
        sys.setswitchinterval(old)
        del arena


def test_a_failed_write_reports_its_errno(dfd):
    """An unaligned O_DIRECT write completes (or is refused) with an error, as libaio's."""
    r = _ring()
    buf = mmap.mmap(-1, 8192)
    try:
        k, base = address_of(buf)
        try:
            r.submit_write(dfd, [(base + 1, 4096)], 0, 7, True)
        except OSError:
            return
        [(token, res)] = wait_reap(r, 1)
        assert token == 7 and (res < 0 or res == 4096)   # 4096: O_DIRECT was refused
        del k
    finally:
        r.close()


def test_a_closed_ring_refuses_its_calls():
    r = _ring()
    ring = r._ring
    r.close()
    with pytest.raises(ValueError):
        aio._ext.uring_reap(ring)


@pytest.mark.parametrize("engine,writer", [("uring", "io_uring"), ("aio", "libaio")])
async def test_the_configured_engine_writes_the_wal(tmp_path, engine, writer):
    """WALConfig.io_engine picks what the loop writes with: "uring" the ring (where the kernel
    allows it), "aio" libaio; before attach_loop() the IO threads write."""
    if engine == "uring":
        _ring().close()                                    # skips without io_uring
    w = DeltaWAL(WALConfig(path=str(tmp_path / "wal"), capacity=4 << 20, io_engine=engine))
    list(w.open())
    try:
        assert w.writer == "IO threads"
        if not w.attach_loop():
            pytest.skip("O_DIRECT refused here: the IO threads keep writing")
        assert w.writer == writer
        r = w.append_loop(b"x" * 5000)
        await r.future
    finally:
        w.close()
    w = DeltaWAL(WALConfig(path=str(tmp_path / "wal"), capacity=4 << 20))
    try:
        assert [bytes(b) for _, b in w.open()] == [b"x" * 5000]
    finally:
        w.close()


def test_uring_unavailable_falls_back_to_libaio_logged_once(monkeypatch, caplog):
    """Where io_uring cannot be set up "uring" writes with libaio, and says why once (a broker
    opens one WAL, a test process many)."""
    monkeypatch.setattr(aio, "_c_uring_setup", None)
    monkeypatch.setattr(aio, "_uring_fallback_logged", False)
    with caplog.at_level(logging.INFO, logger=aio.log.name):
        for _ in range(2):
            ctx = aio.open_context(8, "uring")
            try:
                assert type(ctx) is aio.AioContext
            finally:
                ctx.close()
    said = [r.getMessage() for r in caplog.records if r.name == aio.log.name]
    assert len(said) == 1 and "io_uring unavailable" in said[0] and "extension" in said[0]
