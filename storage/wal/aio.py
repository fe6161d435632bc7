"""Linux native AIO and timerfd through raw syscalls: no extra package, no threads.

Why: a WAL written by IO threads pays a GIL hand-off on the event loop for every write
started and every write finished. With native AIO the loop submits a write itself (io_submit
returns once the request is queued) and learns of its completion from an eventfd in its own
epoll set, so nothing else has to run Python code for the write path. The kernel ABI used here
(struct iocb, struct io_event, syscall numbers) is fixed; only x86_64 and aarch64 are mapped.

The per-write calls (io_submit, the reap, the eventfd reset, the timer's arm and reset) run in C when storage._copycrc is
built (aio_submit, aio_reap, eventfd_reset, timerfd_arm), keeping the interpreter lock: building the iocb with ctypes and calling through
it cost ~3 us of Python per WAL write on the event loop. Without the extension (or with a
stale in-place build that predates them) the ctypes path below does the same calls.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import select

try:
    from .. import _copycrc as _ext
except ImportError:                 # not built: the ctypes path
    _ext = None
_c_submit = getattr(_ext, "aio_submit", None)
_c_reap = getattr(_ext, "aio_reap", None)
_c_eventfd_reset = getattr(_ext, "eventfd_reset", None)
_c_timerfd_arm = getattr(_ext, "timerfd_arm", None)
_c_uring_setup = getattr(_ext, "uring_setup", None)
# the per-write AIO calls run in C (AioContext(native=None) follows this)
NATIVE = None not in (_c_submit, _c_reap, _c_eventfd_reset)

__all__ = ["AioContext", "UringContext", "TimerFD", "AioUnavailable", "yield_cpu", "open_context"]

# The loop driver writes through io_uring (UringContext) with WALConfig.io_engine "uring" (the
# default), through libaio with "aio" (the path before session 33, and the fallback where
# io_uring cannot be set up); with "uring" broker/frames.py cuts large frames from 4 KiB-page
# arena slabs registered with the ring: plain io_uring writes cost as much CPU as libaio's,
# writes from registered memory (WRITE_FIXED / WRITEV_FIXED) skip the per-write page pinning
# (raw 1 MiB produce, 8 pairs alternating: broker 0.421-0.498 ms CPU/MiB against 0.473-0.523;
# bench/HISTORY.md session 33).
_uring_fallback_logged = False      # the fallback to libaio is logged once per process
log = logging.getLogger(__name__)

# (io_setup, io_destroy, io_getevents, io_submit, timerfd_create, timerfd_settime)
_SYSCALLS = {
    "x86_64": (206, 207, 208, 209, 283, 286),
    "aarch64": (0, 1, 4, 2, 85, 86),
}
_IOCB_CMD_PWRITE = 1
_IOCB_CMD_PWRITEV = 8
_IOCB_FLAG_RESFD = 1
RWF_DSYNC = 2
_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class AioUnavailable(OSError):
    """Native AIO cannot be used here (architecture, kernel without CONFIG_AIO, limits)."""


class _Iocb(ctypes.Structure):
    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32),
                ("aio_rw_flags", ctypes.c_int32), ("aio_lio_opcode", ctypes.c_uint16),
                ("aio_reqprio", ctypes.c_int16), ("aio_fildes", ctypes.c_uint32),
                ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64),
                ("aio_flags", ctypes.c_uint32), ("aio_resfd", ctypes.c_uint32)]


class _IoEvent(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_nr = _SYSCALLS.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_pylibc = ctypes.PyDLL(None, use_errno=True)       # PyDLL: the GIL stays with the caller
_sched_yield = _pylibc.sched_yield
_sched_yield.restype = ctypes.c_int
# The event loop's own AIO calls (io_submit, a reap that does not wait, the eventfd reset)
# keep the GIL: none of them waits, and releasing it hands the GIL to a waiting thread (an
# upload writer) which the loop must then wait to get back from: a futex wake and a futex
# wait per call, ~2-3 of them per MiB of 1 MiB produce requests (bench/HISTORY.md, session 18).
# A waiting reap (a closing thread's drain) releases it as before.
_syscall_held = _pylibc.syscall
_syscall_held.restype = ctypes.c_long
_read_held = _pylibc.read
_read_held.restype = ctypes.c_ssize_t
_read_held.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)


def yield_cpu() -> None:
    """Give this CPU to runnable kernel work for a moment, keeping the GIL (no other Python
    thread gets in). Costs ~0.3 us when nothing else is runnable."""
    _sched_yield()


def _check(ret: int) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


class AioContext:
    """One io_setup() context whose completions signal an eventfd (readable in epoll).

    submit() takes (address, length) pieces that stay valid until the completion is reaped;
    the caller keeps the buffers alive. Completions come back as (token, result) pairs, where
    result is the byte count written or a negative errno."""

    kind = "libaio"          # what writes the WAL (DeltaWAL.writer, the start-up log line)

    def __init__(self, depth: int, native: bool | None = None) -> None:
        if _nr is None:
            raise AioUnavailable(f"native AIO not mapped for {platform.machine()}")
        self._ctx = ctypes.c_ulong(0)
        try:
            _check(_syscall(_nr[0], ctypes.c_uint(depth), ctypes.byref(self._ctx)))
        except OSError as e:
            raise AioUnavailable(f"io_setup({depth}) failed: {e}") from e
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._events = (_IoEvent * depth)()
        self._depth = depth
        self._zero = _Timespec(0, 0)
        self._count = ctypes.c_uint64(0)           # the eventfd's counter, read to reset it
        self.native = NATIVE if native is None else (native and NATIVE)
        if self.native:     # the same calls and signatures as the methods below, in C
            ctx = self._ctx.value
            self.submit_write = functools.partial(_c_submit, ctx, self.eventfd)
            self.reap = functools.partial(_c_reap, ctx, depth)
            self.clear_signal = functools.partial(_c_eventfd_reset, self.eventfd)

    def submit_write(self, fd: int, pieces: list[tuple[int, int]], offset: int, token: int,
                     dsync: bool) -> object:
        """Queue one write of `pieces` at `offset`; returns what must outlive the request
        (the buffers themselves the caller keeps)."""
        cb = _Iocb()
        cb.aio_data = token
        cb.aio_fildes = fd
        cb.aio_offset = offset
        cb.aio_flags = _IOCB_FLAG_RESFD
        cb.aio_resfd = self.eventfd
        cb.aio_rw_flags = RWF_DSYNC if dsync else 0
        keep: tuple
        if len(pieces) == 1:
            cb.aio_lio_opcode = _IOCB_CMD_PWRITE
            cb.aio_buf, cb.aio_nbytes = pieces[0]
            keep = (cb,)
        else:
            iov = (_Iovec * len(pieces))(*[_Iovec(a, n) for a, n in pieces])
            cb.aio_lio_opcode = _IOCB_CMD_PWRITEV
            cb.aio_buf = ctypes.addressof(iov)
            cb.aio_nbytes = len(pieces)
            keep = (cb, iov)
        ptrs = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(cb))
        _check(_syscall_held(_nr[3], self._ctx, ctypes.c_long(1), ptrs))
        return keep

    def reap(self, wait_s: float | None = None) -> list[tuple[int, int]]:
        """Completed requests; waits up to wait_s for at least one (None: do not wait)."""
        if wait_s is None:      # returns at once: keeps the GIL
            minimum, ts, call = 0, self._zero, _syscall_held
        else:
            minimum, call = 1, _syscall
            ts = _Timespec(int(wait_s), int((wait_s % 1) * 1e9))
        n = _check(call(_nr[2], self._ctx, ctypes.c_long(minimum),
                        ctypes.c_long(self._depth), self._events, ctypes.byref(ts)))
        ev = self._events
        return [(ev[i].data, ev[i].res) for i in range(n)]

    def clear_signal(self) -> None:
        """Reset the eventfd before reaping, so a completion after the reap wakes us again.
        (A non-blocking read that keeps the GIL; EAGAIN when it was not signalled.)"""
        _read_held(self.eventfd, ctypes.addressof(self._count), 8)

    def close(self) -> None:
        for name in ("submit_write", "reap", "clear_signal"):
            self.__dict__.pop(name, None)   # the methods below: a closed context, a closed fd
        if self._ctx.value:
            _syscall(_nr[1], self._ctx)      # waits for requests still in flight
            self._ctx = ctypes.c_ulong(0)
        if self.eventfd >= 0:
            os.close(self.eventfd)
            self.eventfd = -1


class UringContext:
    """AioContext's interface (eventfd, submit_write, reap, clear_signal, close) over an
    io_uring whose completions signal the same kind of eventfd. The frame arena's slabs
    (storage._copycrc frame_arena, 4 KiB pages: broker/frames.py with io_engine "uring")
    are registered with the ring as fixed buffers, pinned once, and a write whose single piece
    lies inside one goes as WRITE_FIXED, without the per-write pinning of each source page (1 MiB
    O_DIRECT|RWF_DSYNC writes from 4 KiB pages, QD 8: libaio 0.036-0.052 ms CPU/MiB,
    WRITE_FIXED 0.018-0.028; bench/HISTORY.md session 33). Needs the C extension; raises
    AioUnavailable where io_uring cannot be set up (the caller uses AioContext)."""

    kind = "io_uring"

    def __init__(self, depth: int) -> None:
        if _c_uring_setup is None:
            raise AioUnavailable("io_uring needs the storage._copycrc extension")
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            self._ring = _c_uring_setup(depth, self.eventfd)
        except OSError as e:
            os.close(self.eventfd)
            raise AioUnavailable(f"io_uring_setup({depth}) failed: {e}") from e
        self.native = True
        self.fixed_writes = 0                     # writes submitted as WRITE_FIXED (tests)
        self.submit_write = functools.partial(self._submit, _ext.uring_submit, self._ring)
        self.clear_signal = functools.partial(_c_eventfd_reset, self.eventfd)

    def _submit(self, submit, ring, fd: int, pieces: list[tuple[int, int]], offset: int,
                token: int, dsync: bool) -> tuple:
        """AioContext.submit_write; nothing but the buffers must outlive the request (the
        kernel copied the iovecs at submission: IORING_FEAT_SUBMIT_STABLE)."""
        if submit(ring, fd, pieces, offset, token, dsync):
            self.fixed_writes += 1
        return ()

    def reap(self, wait_s: float | None = None) -> list[tuple[int, int]]:
        """Completed requests; waits up to wait_s for the eventfd (None: do not wait)."""
        if wait_s is not None:
            select.select([self.eventfd], [], [], wait_s)
            self.clear_signal()
        return _ext.uring_reap(self._ring)

    @property
    def registered_bytes(self) -> int:
        """Bytes of frame arena slabs registered with this ring as fixed buffers."""
        ring = self._ring
        if ring is None:
            return 0
        try:
            return _ext.uring_registered(ring)
        except ValueError:                        # closed meanwhile
            return 0

    def refresh_fixed(self) -> None:
        """Register the frame arena's new slabs with this ring now, from any thread (the
        interpreter lock released while the kernel pins them), instead of in the next submit:
        on the event loop that pinning (~2-3 ms per 64 MiB slab) held up a produce request.
        A ring closed meanwhile is left alone."""
        ring = self._ring
        if ring is None:
            return
        try:
            _ext.uring_refresh(ring)
        except ValueError:                        # closed meanwhile
            pass

    def close(self) -> None:
        """Close the ring (drain first: completions of writes in flight are lost)."""
        if self._ring is not None:
            _ext.uring_close(self._ring)
            self._ring = None
        if self.eventfd >= 0:
            os.close(self.eventfd)
            self.eventfd = -1


def open_context(depth: int, engine: str) -> "AioContext | UringContext":
    """The WAL driver's completion context for WALConfig.io_engine ``engine``: "uring" is
    io_uring where the kernel allows it, else libaio (the reason logged once per process, as a
    broker opens one WAL and tests many); "aio" is libaio."""
    global _uring_fallback_logged
    if engine == "uring":
        try:
            return UringContext(depth)
        except AioUnavailable as e:
            if not _uring_fallback_logged:
                _uring_fallback_logged = True
                log.warning("WAL: io_uring unavailable, libaio writes instead: %s", e)
    return AioContext(depth)


class TimerFD:
    """A CLOCK_MONOTONIC timerfd: microsecond wake-ups for an event loop whose own timers
    (uvloop) fire in whole milliseconds, too coarse for a 1/3000 s seal interval."""

    def __init__(self, native: bool | None = None) -> None:
        if _nr is None:
            raise AioUnavailable(f"timerfd not mapped for {platform.machine()}")
        self.fd = _check(_syscall(_nr[4], ctypes.c_int(_CLOCK_MONOTONIC),
                                  ctypes.c_int(_TFD_NONBLOCK | _TFD_CLOEXEC)))
        self.armed_at: float | None = None
        self.native = (_c_timerfd_arm is not None and _c_eventfd_reset is not None
                       and native is not False)

    def arm(self, deadline: float) -> None:
        """Fire once at time.monotonic() == deadline (earlier deadlines win)."""
        if self.armed_at is not None and self.armed_at <= deadline:
            return
        deadline = max(deadline, 1e-6)
        if self.native:
            _c_timerfd_arm(self.fd, deadline)
            self.armed_at = deadline
            return
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(int(deadline), int((deadline % 1) * 1e9)))
        _check(_syscall(_nr[5], ctypes.c_int(self.fd), ctypes.c_int(_TFD_TIMER_ABSTIME),
                        ctypes.byref(spec), None))
        self.armed_at = deadline

    def consume(self) -> None:
        """Acknowledge an expiry (the fd stays readable until read)."""
        self.armed_at = None
        if self.native:
            _c_eventfd_reset(self.fd)        # the same read, keeping the interpreter lock
            return
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.native = False                  # a late consume() reads fd -1, not a reused fd
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
