"""storage/wal/aio.py's AIO calls in C (storage._copycrc aio_submit / aio_reap /
eventfd_reset) against its ctypes path: the same writes on a real O_DIRECT file, the same
completions, the same errors. Both paths run in every test; the C one must be the default
when the extension is built (else the WAL's loop driver would quietly run the slower path)."""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import select
import sys
import threading
import time

import pytest

from storage.wal import aio
from storage.wal.aio import AioContext, TimerFD

from .aio_util import address_of, wait_reap

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"),
                                reason="native AIO mapped for x86_64 and aarch64 only")

PATHS = pytest.mark.parametrize("native", [False, True], ids=["ctypes", "c"])


def _ext():
    try:
        from storage import _copycrc
    except ImportError:
        return None
    return _copycrc


def _ctx(native: bool) -> AioContext:
    if native and not aio.NATIVE:
        pytest.skip("storage._copycrc not built")
    a = AioContext(8, native=native)
    assert a.native is native
    return a


def _buf(size: int, fill: int) -> mmap.mmap:
    m = mmap.mmap(-1, size)                 # page-aligned: O_DIRECT's alignment
    m.write(bytes([fill]) * size)
    return m


def test_the_c_calls_are_built_and_the_default():
    """With the extension built, AioContext (and so the WAL's loop driver) uses the C calls."""
    ext = _ext()
    if ext is None:
        pytest.skip("storage._copycrc not built")
    assert all(hasattr(ext, n) for n in ("aio_submit", "aio_reap", "eventfd_reset",
                                         "timerfd_arm"))
    assert aio.NATIVE
    t = TimerFD()
    assert t.native
    t.close()
    a = AioContext(8)
    try:
        assert a.native
        assert getattr(a.submit_write, "func", None) is ext.aio_submit
        assert getattr(a.reap, "func", None) is ext.aio_reap
    finally:
        a.close()


@PATHS
@pytest.mark.parametrize("dsync", [True, False])
def test_writes_of_one_and_of_several_pieces_land_and_complete(native, dsync, dfd):
    a = _ctx(native)
    one, two, three = _buf(8192, 1), _buf(4096, 2), _buf(12288, 3)
    keep = [address_of(m) for m in (one, two, three)]
    try:
        a.submit_write(dfd, [(keep[0][1], 8192)], 4096, 7, dsync)
        a.submit_write(dfd, [(keep[1][1], 4096), (keep[2][1], 12288)], 65536, 1 << 40, dsync)
        got = wait_reap(a, 2)
        assert sorted(got) == [(7, 8192), (1 << 40, 16384)]
        assert a.reap() == []                     # nothing more; returns at once
        data = os.pread(os.open(f"/proc/self/fd/{dfd}", os.O_RDONLY), 1 << 20, 0)
        assert data[:4096] == b"\0" * 4096
        assert data[4096:12288] == b"\1" * 8192
        assert data[65536:65536 + 4096] == b"\2" * 4096
        assert data[69632:69632 + 12288] == b"\3" * 12288
    finally:
        del keep
        a.close()


@PATHS
def test_a_failed_write_completes_with_its_negative_errno(native, tmp_path):
    """An O_DIRECT write at an unaligned offset: EINVAL, at submit or in its completion,
    the same way on both paths."""
    path = tmp_path / "g"
    path.write_bytes(b"\0" * 65536)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        pytest.skip("no O_DIRECT here")
    a = _ctx(native)
    m = _buf(4096, 9)
    c, addr = address_of(m)
    try:
        try:
            a.submit_write(fd, [(addr, 4096)], 100, 5, True)
        except OSError as e:
            outcome = ("raised", e.errno)
        else:
            outcome = ("completed", wait_reap(a, 1))
        assert outcome in (("raised", errno.EINVAL), ("completed", [(5, -errno.EINVAL)]))
    finally:
        del c
        a.close()
        os.close(fd)


def _errors(native: bool, call) -> tuple[type, int]:
    a = _ctx(native)
    try:
        with pytest.raises(OSError) as ei:
            call(a)
        return type(ei.value), ei.value.errno
    finally:
        a.close()


def test_submit_to_a_bad_fd_raises_the_same_error_on_both_paths():
    m = _buf(4096, 1)
    c, addr = address_of(m)
    bad = 1 << 20                    # open nowhere (above any fd limit): EBADF (a just
                                     # closed number would be the context's new eventfd)
    call = lambda a: a.submit_write(bad, [(addr, 4096)], 0, 1, True)  # noqa: E731
    assert _errors(False, call) == (OSError, errno.EBADF)
    if aio.NATIVE:
        assert _errors(True, call) == (OSError, errno.EBADF)
    del c


def test_a_destroyed_context_raises_the_same_error_on_both_paths(dfd):
    """io_submit / io_getevents on a context that io_destroy() ended: EINVAL from both."""
    def destroyed(native: bool) -> AioContext:
        a = _ctx(native)
        aio._syscall(aio._nr[1], a._ctx)        # destroy it under the context's feet
        return a

    m = _buf(4096, 1)
    c, addr = address_of(m)
    for native in ([False, True] if aio.NATIVE else [False]):
        a = destroyed(native)
        with pytest.raises(OSError) as ei:
            a.submit_write(dfd, [(addr, 4096)], 0, 1, True)
        assert ei.value.errno == errno.EINVAL
        with pytest.raises(OSError) as ei:
            a.reap()
        assert ei.value.errno == errno.EINVAL
        with pytest.raises(OSError) as ei:
            a.reap(0.01)
        assert ei.value.errno == errno.EINVAL
        a._ctx = ctypes.c_ulong(0)                # already destroyed: close() skips it
        a.close()
    del c


@PATHS
def test_a_waiting_reap_returns_a_completion_and_an_empty_list_after_its_timeout(native, dfd):
    a = _ctx(native)
    m = _buf(4096, 4)
    c, addr = address_of(m)
    try:
        assert a.reap(0.01) == []                 # nothing in flight: the wait runs out
        a.submit_write(dfd, [(addr, 4096)], 0, 3, True)
        got: list = []
        while not got:
            got = a.reap(1.0)
        assert got == [(3, 4096)]
    finally:
        del c
        a.close()


@PATHS
def test_clear_signal_resets_the_eventfd_and_does_not_fail_when_unsignalled(native, dfd):
    a = _ctx(native)
    m = _buf(4096, 5)
    c, addr = address_of(m)
    try:
        a.clear_signal()                          # not signalled: EAGAIN, ignored
        a.submit_write(dfd, [(addr, 4096)], 0, 1, True)
        assert select.select([a.eventfd], [], [], 10)[0]
        a.clear_signal()
        assert not select.select([a.eventfd], [], [], 0)[0]
        assert a.reap(1.0) == [(1, 4096)]
    finally:
        del c
        a.close()


def test_after_close_the_calls_are_the_closed_contexts():
    """close() drops the C calls bound to the context and eventfd, so a late call meets the
    closed context (0) and fd (-1), not whatever reused the eventfd's number."""
    a = _ctx(True)
    a.close()
    for name in ("submit_write", "reap", "clear_signal"):
        assert getattr(a, name).__func__ is getattr(AioContext, name)
    assert a.eventfd == -1
    a.clear_signal()                              # reads fd -1: nothing


def test_the_c_calls_keep_the_interpreter_lock(tmp_path):
    """The event loop's calls (submit, the reap that does not wait, the eventfd reset) keep
    the interpreter lock, as the ctypes path's PyDLL calls do: a release would hand it to a
    thread waiting for it, which the loop then waits to get it back from. A thread is made to
    wait for the lock (woken from a lock of its own) with the switch interval out of reach:
    it can only run if a call releases the lock."""
    a = _ctx(True)
    fd = os.open(tmp_path / "h", os.O_RDWR | os.O_CREAT)     # buffered: completes in submit
    m = _buf(4096, 6)
    c, addr = address_of(m)
    timer = TimerFD()
    assert timer.native
    gate = threading.Lock()
    gate.acquire()
    ran: list[int] = []
    t = threading.Thread(target=lambda: (gate.acquire(), ran.append(1)))
    t.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        gate.release()                # the thread wakes and waits for the interpreter lock
        for i in range(20_000):
            if i % 100 == 0:
                a.submit_write(fd, [(addr, 4096)], 0, i, False)
            a.clear_signal()
            a.reap()
            timer.armed_at = None
            timer.arm(1e9 + i)
            timer.consume()
        assert ran == []
    finally:
        sys.setswitchinterval(interval)
        t.join()
        del c
        a.close()
        timer.close()
        os.close(fd)
    assert ran == [1]


@PATHS
def test_the_timer_fires_at_its_deadline_and_consume_resets_it(native):
    if native and not aio.NATIVE:
        pytest.skip("storage._copycrc not built")
    t = TimerFD(native=native)
    assert t.native is native
    try:
        t.arm(time.monotonic() + 3600)
        assert t.armed_at is not None
        assert not select.select([t.fd], [], [], 0)[0]
        t.arm(time.monotonic() + 7200)                # later: the earlier deadline stays
        assert t.armed_at < time.monotonic() + 3601
        t.arm(time.monotonic() - 1)                   # earlier (already past): fires now
        assert select.select([t.fd], [], [], 10)[0]
        t.consume()
        assert t.armed_at is None
        assert not select.select([t.fd], [], [], 0)[0]
        t.consume()                                   # not expired: nothing to read, no error
        t.arm(time.monotonic() + 0.001)
        assert select.select([t.fd], [], [], 10)[0]
    finally:
        t.close()
    assert not t.native                               # a late consume: the ctypes path's


def test_arming_a_bad_timer_fd_raises_the_same_error_on_both_paths():
    for native in ([False, True] if aio.NATIVE else [False]):
        t = TimerFD(native=native)
        fd = t.fd
        t.fd = 1 << 20                                # open nowhere: EBADF
        with pytest.raises(OSError) as ei:
            t.arm(time.monotonic() + 1)
        assert ei.value.errno == errno.EBADF
        t.fd = fd
        t.close()
