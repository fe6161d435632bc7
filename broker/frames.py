"""Large request frames: carved from arena slabs that are faulted in once and never unmapped
while the broker runs (storage._copycrc.frame_arena) with the io_uring WAL (wal_io_engine
"uring", the default: the broker's FramePool(arena=True)) or FramePool(huge=True); else
allocated without zero-filling, recycled once nothing sees them, and (for large produce
frames) faulted in ahead of need by a background thread.

Arena slabs, because the WAL writes large Produce frames with O_DIRECT straight from them
(storage/wal/placed.py): from 4 KiB pages each libaio write pins every page of its source
(``gup_fast_fallback``, 5-6.5 % of the broker's CPU under raw 1 MiB produce, bench/HISTORY.md
sessions 27 and 33). 4 KiB-page slabs faulted in by the filler thread are registered with the
WAL's io_uring as fixed buffers (pinned once), and its writes from them skip the pinning.
Huge-page slabs (session 28, not the default) avoid it too but a fresh huge page costs ~2 s
of CPU per GiB on this VM (freed 2 MiB blocks go back to the host).

Every large frame a socket receives into is fresh memory until the LogCache is full and
starts handing evicted frames back: on this VM each 4 KiB page costs a fault (~285 per MiB,
a third of the broker's CPU while the 1 GiB cache fills), taken on the event loop inside the
socket read. The ``s3kafka-frames`` thread faults frames and slabs in ahead of need, off the
loop (the loop then receives into memory that is already there), with a write per page and
the GIL released (storage._copycrc frame_arena's grow and fault_in): not one
``madvise(MADV_POPULATE_WRITE)`` per slab or frame, which costs the same CPU here but holds
the process's mmap_lock across the whole range, so the loop's next mmap/munmap (its
allocator's, ~100 a second) waited 22-60 ms behind a 64 MiB slab (bench/HISTORY.md session 35
stall).

``--frame-pretouch`` (default on, ``FramePool.pretouch``): the same thread faults in the
LogCache's worth of arena slabs right after start-up instead of while the first GiB is
produced (the JVM's AlwaysPreTouch; ~0.35 s of CPU per GiB on this VM). Raw 1 MiB produce
then costs less broker CPU per MiB, the pre-touch counted, and not only while the cache
fills (bench/HISTORY.md session 35 touch). It waits while catch-up reads are served fast
(``RateWatch``, PRETOUCH_YIELD_RATE): a restarted broker's catch-up readers arrive at the
same moment, and faulting in 1 GiB beside their cold pass (the zeroing, the page faults)
took 15-30 % of its MB/s (bench/HISTORY.md session 53).

Which free run a frame takes does not change the socket receive copy's cost (session 37 recv:
pre-touch on or off, huge-page slabs, a client whose records shift by 16-byte steps: 93-124 us
per MiB in every case). Frames come back from the LogCache's evictions ~1 GiB of traffic after
they were last touched, so every free run is equally cold; and the kernel's copy (``rep movsb``
on this AMD EPYC) costs ~15x when (destination - source) mod 64 is 1-15, while the destination
is fixed by storage/wal/placed.py (records at a page + 44 bytes) and the source by the sender's
socket pages. A loopback micro-benchmark (the same history) puts that alignment at +30-50 us
per MiB and a cold destination at +25-40 us per MiB over a warm, aligned copy.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import struct
import sys
import threading
import time
from typing import Any, Callable

from protocol import MalformedRequestError
from protocol.frames import read_uvarint
from storage.thread_priority import lower_current_thread

log = logging.getLogger(__name__)

# finished large frames nobody references any more are kept for reuse, up to this many bytes
# in all (a fresh bytearray is zero-filled and page-faulted: ~7 % of broker CPU at 1 MiB)
FRAME_POOL_BYTES = 32 << 20
FRAME_POOL_MAX_FRAME = 4 << 20
# frames from this size on are faulted in ahead of need by the prefill thread...
PREFILL_FROM = 256 << 10
# ...in size classes: eight per doubling of the size, at least this far apart (a frame may
# carry up to an eighth more bytes than its request, which the LogCache does not count)
PREFILL_CLASS = 16 << 10
# ...at most this many bytes ahead (and at most a quarter of the pool's bound)
PREFILL_AHEAD = 32 << 20
MADV_POPULATE_WRITE = 23          # Linux >= 5.14
# huge-page slabs: frames from DIRECT_FRAME (the server's) up to FRAME_POOL_MAX_FRAME are cut
# from them; the filler thread keeps ARENA_AHEAD bytes of them free and faulted in
ARENA_SLAB = 16 << 20
# 4 KiB-page slabs (registered with the WAL's io_uring): a WAL write of several frames goes
# as one WRITEV_FIXED only when they all lie in one slab (session 33: with 16 MiB slabs half
# of the raw 1 MiB run's writes spanned two)
REGISTERED_SLAB = 64 << 20
ARENA_AHEAD = 32 << 20
# slabs mapped at most unless fit_cache sizes them for a LogCache (without one, frames live
# only while their requests do)
ARENA_BYTES = 256 << 20
# beyond the LogCache's capacity: the requests being received and handled
ARENA_SLACK = 64 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# the pre-touch (its floor, not the need-driven grows) waits while catch-up reads are served
# at least this fast (bytes/s over the last RATE_WINDOW_S): a restarted broker's catch-up
# readers want the same CPU and memory bandwidth, and faulting in 1 GiB is ~0.7 s of CPU
PRETOUCH_YIELD_RATE = 64 << 20
RATE_WINDOW_S = 1.0
# while it waits, it looks again this often (a take that needs memory wakes it at once)
PRETOUCH_POLL_S = 0.25


def _alloc_frame(size: int) -> bytearray:
    """A bytearray of ``size`` bytes whose contents are undefined: ``bytearray(size)`` zero-fills
    (a memset pass that also page-faults fresh memory: while the 1 GiB LogCache fills, every
    produce frame is fresh), and a frame is always overwritten by the socket before use."""
    return _from_string_and_size(None, size)


try:  # CPython: PyByteArray_FromStringAndSize(NULL, n) allocates without initialising
    _from_string_and_size = ctypes.pythonapi.PyByteArray_FromStringAndSize
    _from_string_and_size.restype = ctypes.py_object
    _from_string_and_size.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
except (AttributeError, OSError):  # pragma: no cover - not CPython
    def _from_string_and_size(_none: None, size: int) -> bytearray:
        return bytearray(size)

try:  # a CDLL call releases the GIL for its duration
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int
except (AttributeError, OSError):  # pragma: no cover - no libc symbol
    _madvise = None


def populate(buf: bytearray) -> bool:
    """Map every page of ``buf`` writable now (its contents become undefined): a write per
    page with the GIL released (storage._copycrc fault_in), else one madvise(
    MADV_POPULATE_WRITE), which holds mmap_lock across the buffer. False where neither can
    (then pages fault as usual)."""
    if not buf:
        return False
    if _fault_in is not None:
        _fault_in(buf)
        return True
    if _madvise is None:
        return False
    c = ctypes.c_char.from_buffer(buf)       # an export: buf cannot move meanwhile
    try:
        addr = ctypes.addressof(c)
        start = addr & ~(PAGE - 1)
        end = (addr + len(buf) + PAGE - 1) & ~(PAGE - 1)
        return _madvise(start, end - start, MADV_POPULATE_WRITE) == 0
    finally:
        del c


def size_class(size: int) -> int:
    """``size`` rounded up to its class: a step of at most an eighth of it (at least
    PREFILL_CLASS), so a frame of a request's class always fits it (``_Prefill._fits``)."""
    step = max(PREFILL_CLASS, 1 << max(size.bit_length() - 4, 0))
    return (size + step - 1) // step * step


try:
    from storage.copycrc import fault_in as _fault_in
    from storage.copycrc import frame_arena as _frame_arena
except ImportError:  # pragma: no cover - storage not importable: bytearrays
    _frame_arena = _fault_in = None


def huge_pages_possible() -> bool:
    """False where transparent huge pages are off (a slab would be 4 KiB pages: no gain)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


class FramePool:
    """Large request frames for reuse: zero-copy frames are received into buffers of their
    own, and allocating one means page-faulting it each time.

    A frame is only taken back when nothing can still see it: the caller checked that no
    other reference to the bytearray exists, and here a resize probe fails while any
    memoryview of it (a request's ``records``, a cache entry) is alive. The engine's LogCache
    keeps the produced payload's buffer itself, so produce frames come back only when the
    cache evicts them (``recycle``); until then (the cache filling) frames of at least
    PREFILL_FROM bytes come from the prefill thread, faulted in ahead of need."""

    def __init__(self, max_bytes: int = FRAME_POOL_BYTES, huge: bool = False,
                 arena: bool = False) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._free: list[bytearray] = []
        self._prefill: _Prefill | None = None
        self.prefilled = 0       # frames served from the prefill thread (tests, bench)
        arena = arena or huge   # arena: 4 KiB-page slabs registered with the WAL's io_uring
        huge = huge and huge_pages_possible()
        # frames up to FRAME_POOL_MAX_FRAME come from here while it has room (None: never)
        self.arena = _frame_arena(ARENA_SLAB if huge else REGISTERED_SLAB, ARENA_BYTES, huge) \
            if arena and _frame_arena else None
        self.huge = huge
        self._filler: _Filler | None = None
        # called on the filler thread after it grew the arena: the WAL's io_uring registers
        # the new slabs there, not in the loop's next submit (Engine.refresh_fixed_buffers)
        self.on_grown: Callable[[], None] | None = None
        self.arena_frames = 0    # frames cut from the arena (tests, bench)
        self.arena_misses = 0    # ...and taken elsewhere because it was at its bound

    def fit_cache(self, capacity: int) -> None:
        """Size the pool for a LogCache of ``capacity`` bytes, which keeps the produce frames
        whose payloads it holds until it evicts them (``recycle``): the cache evicts down to
        90 % after each upload, and the free bytearrays hold that tenth for the appends that
        follow; the arena's slabs hold the whole cache plus the requests in flight."""
        self.max_bytes = max(self.max_bytes, capacity // 8)
        if self.arena is None:
            log.info("large frames: bytearrays (no arena: wal_io_engine is not uring, no "
                     "transparent huge pages, or no extension)")
            return
        self.arena.max_bytes = capacity + capacity // 8 + ARENA_SLACK
        log.info("large frames: %s slabs of %d MiB, at most %d MiB",
                 "huge-page" if self.huge else "4 KiB-page", self.arena.slab >> 20,
                 self.arena.max_bytes >> 20)

    def pretouch(self, nbytes: int, defer: Callable[[], bool] | None = None) -> bool:
        """Fault in arena slabs up to ``nbytes`` now, on the filler thread (SCHED_BATCH, in
        the background: nothing waits for it), instead of while the first ``nbytes`` are
        produced (the JVM's AlwaysPreTouch). ``defer`` (called on that thread before each
        slab the floor alone asks for): while it says True, the floor waits (the broker's:
        catch-up reads running, RateWatch). False without an arena (frames are bytearrays)."""
        arena = self.arena
        if arena is None or nbytes <= 0:
            return False
        self._filler_of(arena).pretouch(min(nbytes, arena.max_bytes), defer)
        return True

    def _filler_of(self, arena: Any) -> _Filler:
        """The arena's filler thread's handle, made on first use (its thread starts on wake)."""
        if self._filler is None:
            self._filler = _Filler(arena, self)
        return self._filler

    def take(self, size: int) -> bytearray | Any:
        """A frame of exactly ``size`` bytes (contents undefined): an arena frame (a buffer;
        write it through a memoryview) while the arena has room, else a bytearray.

        A pooled frame is taken when ``size`` fits its allocation (resized within it: no
        realloc, no copy), else the largest pooled frame of at least half of ``size``, grown
        to it: only the added tail is fresh memory (a realloc of a large block remaps its
        pages). Without growing, a request larger than every pooled frame faulted in a whole
        new frame while the pool kept the smaller ones: after make bench's 100 B row (requests
        of ~0.95 MB) the 1 KiB row (~1.05 MB) faulted in ~0.9 GB of new frames (223k faults,
        the prefill thread 0.9 s of CPU in 8 s) while the evicted 100 B frames went unused.
        Growing a 0.99 MB frame to 1.05 MB: ~14 faults and ~28 us; a new 1.05 MB frame
        faulted in: ~257 faults and ~330 us (this VM, bench/HISTORY.md session 29)."""
        arena = self.arena
        if arena is not None and size <= FRAME_POOL_MAX_FRAME:
            frame = self._take_arena(arena, size)
            if frame is not None:
                return frame
        free = self._free
        smaller = -1                    # the largest frame below ``size``, at least half of it
        for i in range(len(free) - 1, -1, -1):
            buf = free[i]
            cap = buf.__alloc__()
            if cap // 2 <= size < cap:  # resized within its allocation: no realloc, no copy
                return self._reuse(i, size)
            n = len(buf)
            if size // 2 <= n < size and (smaller < 0 or n > len(free[smaller])):
                smaller = i
        if smaller >= 0:
            return self._reuse(smaller, size)
        if size >= PREFILL_FROM:
            pre = self._prefill
            if pre is None:
                pre = self._prefill = _Prefill(min(PREFILL_AHEAD, self.max_bytes // 4))
            buf = pre.take(size)
            if buf is not None:
                self.prefilled += 1
                return buf
        # exact size: the LogCache may keep the frame (it holds the payload view), and
        # headroom would be memory it does not account for
        return _alloc_frame(size)

    def _reuse(self, i: int, size: int) -> bytearray:
        """Pooled frame ``i`` out of the pool, resized to ``size`` (nothing sees it: ``give``)."""
        buf = self._free.pop(i)
        n = len(buf)
        self.bytes -= n
        if n > size:
            del buf[size:]
        elif n < size:
            buf.extend(bytes(size - n))
        return buf

    def _take_arena(self, arena: Any, size: int) -> Any:
        """A frame cut from the arena; when no free run fits, a huge-page arena grows by a
        slab that is only mapped (its pages fault in as the socket fills them: the filler
        thread, woken here, normally keeps slabs faulted in ahead). None at the arena's bound,
        and from a 4 KiB-page arena when the filler is behind: only slabs it faulted in are
        registered with the WAL's io_uring (registering untouched memory faults it in at ~2 s
        of CPU per GiB against ~0.36 for MADV_POPULATE_WRITE; bench/HISTORY.md session 33), so
        the frame is a bytearray then, written as before."""
        frame = arena.take(size)
        if frame is None and self.huge and arena.grow(False):
            frame = arena.take(size)
        if arena.free < ARENA_AHEAD and arena.mapped + arena.slab <= arena.max_bytes:
            self._filler_of(arena).wake()
        if frame is None:
            self.arena_misses += 1
        else:
            self.arena_frames += 1
        return frame

    def recycle(self, box: list[Any]) -> None:
        """An evicted LogCache payload (``[payload]``, whose list is the only reference to it):
        a view into a produce frame goes back to the pool
        once nothing else holds the frame (readers still holding this view or a slice of it
        keep the frame: the resize probe in ``give`` sees their views)."""
        payload = box.pop()   # the caller keeps no reference
        if type(payload) is not memoryview:
            return
        frame = payload.obj
        del payload           # not released: a reader may hold this very view
        # refcount 2 (this name + the call's argument): nobody else has the frame
        if type(frame) is bytearray and sys.getrefcount(frame) == 2:
            self.give(frame)

    def give(self, buf: bytearray) -> None:
        """Keep ``buf`` for reuse if it is unshared and the pool has room (an arena frame
        goes back to its arena by itself, when its last reference goes)."""
        if type(buf) is not bytearray:
            return
        n = len(buf)
        if not n or n > FRAME_POOL_MAX_FRAME or self.bytes + n > self.max_bytes:
            return
        try:  # a resize fails with BufferError while any view of the buffer exists
            last = buf.pop()
            buf.append(last)
        except BufferError:
            return
        self._free.append(buf)
        self.bytes += n

    def close(self) -> None:
        """Stop the prefill and filler threads and drop what they hold (the arena goes with
        the last of its frames)."""
        if self._filler is not None:
            self._filler.stop()
            self._filler = None
        if self._prefill is not None:
            self._prefill.stop()
            self._prefill = None


class _Filler:
    """Grows the frame arena by slabs faulted in (a write per page, in frame_arena's grow
    with the interpreter lock released) while less than ARENA_AHEAD of it is free: the loop
    then receives into pages that are there. Once the LogCache is full, frames come back to
    the arena as it evicts and the thread stays asleep. ``pretouch`` sets a floor: the thread
    also grows the arena until that many bytes are mapped, produced or not, and then says so
    once (``pretouched``: the floor is mapped, or the arena could not grow to it)."""

    def __init__(self, arena: Any, pool: "FramePool | None" = None) -> None:
        self.arena = arena
        self._pool = pool                # its on_grown is called after a pass that grew
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.floor = 0                   # bytes to map ahead of any request (pretouch)
        self._floor_at = 0.0             # when the floor was set (for the log line)
        self.pretouched = False          # the floor was reached, or the arena's end (tests)
        self._defer: Callable[[], bool] | None = None   # True: the floor waits (pretouch)
        self.deferred_s = 0.0            # time the floor waited for it (log, tests)

    def pretouch(self, nbytes: int, defer: Callable[[], bool] | None = None) -> None:
        """Grow the arena until ``nbytes`` are mapped (FramePool.pretouch), starting now;
        the slabs only the floor asks for wait while ``defer()`` is true."""
        self._defer = defer
        self.floor = nbytes
        self._floor_at = time.monotonic()
        self.wake()

    def wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="s3kafka-frames",
                                            daemon=True)
            self._thread.start()
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        lower_current_thread(0)          # SCHED_BATCH: ahead of need (see _Prefill._run)
        arena = self.arena
        cpu = time.thread_time()
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            # this pass's floor, read once after the clear: a floor set later (pretouch) wakes
            # another pass. Re-read in the log's condition, a floor set after the grow loop
            # ended was logged as reached with less mapped (session 35 review)
            floor = self.floor
            grown = True                 # False: the arena could not grow (its bound, mmap)
            mapped = arena.mapped
            while not self._stopped and (arena.free < ARENA_AHEAD or arena.mapped < floor):
                if arena.free >= ARENA_AHEAD and self._floor_waits():
                    floor = self.floor       # a wake (a take, a new floor) ends the wait
                    continue
                if not arena.grow(True):
                    grown = False
                    break
            if arena.mapped != mapped and not self._stopped:
                self._grew()
            if floor and not self.pretouched and not self._stopped \
                    and (arena.mapped >= floor or not grown):
                self._pretouched(time.thread_time() - cpu)

    def _floor_waits(self) -> bool:
        """Only the floor wants another slab: while ``defer`` says so (catch-up reads are
        being served), wait PRETOUCH_POLL_S or until woken (a take short of free memory,
        which the grow loop then serves, or stop) and say True; else False at once."""
        defer = self._defer
        if defer is None or not defer():
            return False
        t0 = time.monotonic()
        if self._wake.wait(PRETOUCH_POLL_S):
            self._wake.clear()
        self.deferred_s += time.monotonic() - t0
        return True

    def _grew(self) -> None:
        """The pool's on_grown, here on the filler thread (registering ~1 GiB of new slabs
        with the WAL's io_uring pins them for ~35 ms: in the loop's next submit that held a
        produce request up as long, bench/HISTORY.md session 46). Best effort: a failure
        leaves it to that submit, as before."""
        hook = self._pool.on_grown if self._pool is not None else None
        if hook is None:
            return
        try:
            hook()
        except Exception as e:           # noqa: BLE001 - the next submit registers instead
            log.debug("registering new frame slabs with the WAL failed: %s", e)

    def _pretouched(self, cpu: float) -> None:
        """Log once that the floor is mapped (or that the arena could not grow to it)."""
        self.pretouched = True
        log.info("large frames pre-touched: %d MiB of arena slabs in %.2f s (%.2f s of CPU, "
                 "%.2f s waiting for catch-up reads)", self.arena.mapped >> 20,
                 time.monotonic() - self._floor_at, cpu, self.deferred_s)


class RateWatch:
    """A callable saying whether a growing counter (bytes served) rose at ``rate`` per second
    or more over about the last ``window_s``: the pre-touch's ``defer`` with the engine's
    catch-up bytes (ColdReadPacer.bytes). Made on the counter's thread, then called from one
    thread (the filler's); it keeps the samples of the window plus the one before (the first
    taken when it is made, so its first call already has a span), and says False while they
    span less than MIN_SPAN_S."""

    MIN_SPAN_S = 0.05

    def __init__(self, count: Callable[[], int], rate: float, window_s: float = RATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._count, self.rate, self.window_s, self._clock = count, rate, window_s, clock
        self._samples: collections.deque[tuple[float, int]] = collections.deque(
            [(clock(), count())])

    def __call__(self) -> bool:
        now, n = self._clock(), self._count()
        samples = self._samples
        samples.append((now, n))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()
        t0, n0 = samples[0]
        span = now - t0
        return span >= self.MIN_SPAN_S and n - n0 >= self.rate * span


class _Prefill:
    """Frames of the recent size classes, faulted in by a thread before the loop needs them.

    The loop takes one (``take``) whenever the pool had nothing to recycle and wakes the
    thread, which refills up to ``ahead`` bytes and sleeps: once the LogCache is full the pool
    serves every frame and the thread stays asleep. The thread first replaces each frame taken
    (or missed) by one of its request's class, then makes frames of the classes of the last
    RECENT requests in turn: the ready frames follow the mix of request sizes. A
    ready frame serves a request it fits closely (at most an eighth plus a class larger:
    memory the LogCache does not count), or one at most half its size (trimmed: the
    allocation shrinks to the request). Requests of varying sizes (linger-5 clients: every
    request another class) used to empty the whole ready queue at each class change (~32 MiB
    faulted in per request); then the thread made frames of the largest recent class only, so
    that a confluent-kafka 100 B run (requests of 0.26-1 MB, p10 547 KB, p90 907 KB) had half
    of its frames missed (faulted in on the loop) and 41 % of the frames made dropped at those
    misses (bench/HISTORY.md, session 26). A miss drops the oldest ready frame only when the
    ready frames are at ``ahead`` (to make room for the current mix)."""

    RECENT = 32

    def __init__(self, ahead: int) -> None:
        self.ahead = max(ahead, 0)
        self._lock = threading.Lock()
        self._ready: collections.deque[bytearray] = collections.deque()
        self._ready_bytes = 0
        self._recent: collections.deque[int] = collections.deque(maxlen=self.RECENT)
        self._turn = 0           # the next of _recent the thread makes a frame of
        # the classes of the requests taken since: each is made again first (a frame taken is
        # replaced by one of its class, so the ready mix follows the requests' mix)
        self._wanted: collections.deque[int] = collections.deque(maxlen=2 * self.RECENT)
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._ok = _madvise is not None and self.ahead > 0

    @staticmethod
    def _fits(n: int, size: int) -> bool:
        return size <= n <= size + size // 8 + PREFILL_CLASS or n >= 2 * size

    def take(self, size: int) -> bytearray | None:
        """A faulted-in frame of ``size`` bytes, or None (none ready that fits)."""
        if not self._ok:
            return None
        buf = None
        cls = size_class(size)
        with self._lock:
            self._recent.append(cls)
            self._wanted.append(cls)
            ready = self._ready
            best = -1               # the smallest that fits: larger ones stay for larger requests
            for i, b in enumerate(ready):
                n = len(b)
                if self._fits(n, size) and (best < 0 or n < len(ready[best])):
                    best = i
            if best >= 0:
                buf = ready[best]
                del ready[best]
            else:
                if ready and self._ready_bytes + cls > self.ahead:
                    b = ready.popleft()     # none fits and no room: make room for the mix
                    self._ready_bytes -= len(b)
            if buf is not None:
                self._ready_bytes -= len(buf)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="s3kafka-frames",
                                            daemon=True)
            self._thread.start()
        self._wake.set()
        if buf is not None and len(buf) > size:
            del buf[size:]                  # in place: kept, or shrunk to the request
        return buf

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        with self._lock:
            self._ready.clear()
            self._ready_bytes = 0

    def _run(self) -> None:
        # SCHED_BATCH (nice unchanged): the thread works ahead of need, so it never preempts
        # the event loop (or anything else) when woken; it still gets its share of a busy
        # CPU. It was woken per large request and preempted whatever ran on its CPU: 100 B
        # confluent-kafka run, 8 s, loop involuntary switches 3,600-4,100 -> 1,600-1,900,
        # the client's 2,000-2,800 -> 1,000-1,400 (bench/HISTORY.md, session 19)
        lower_current_thread(0)
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            while not self._stopped:
                with self._lock:
                    wanted = self._wanted
                    if wanted:
                        cls = wanted[0]
                    elif self._recent:          # ahead of need: the recent mix in turn
                        self._turn = (self._turn + 1) % len(self._recent)
                        cls = self._recent[self._turn]
                    else:
                        break
                    if self._ready_bytes + cls > self.ahead:
                        break
                    if wanted:
                        wanted.popleft()
                buf = _alloc_frame(cls)
                if not populate(buf):
                    log.info("frame prefill off: neither storage._copycrc fault_in nor "
                             "madvise(MADV_POPULATE_WRITE) available")
                    self._ok = False
                    return
                with self._lock:
                    if not self._stopped:   # also if the class moved: it may still fit
                        self._ready.append(buf)
                        self._ready_bytes += cls


# ---- large Produce frames received in place (storage/wal/placed.py) ----------------------
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")


try:    # produce_records_at in one C call (protocol/_produce.c), answering the same
    from protocol._produce import NEED_MORE as _C_NEED_MORE, records_at as _records_at
except ImportError:  # pragma: no cover - the extension is optional (or a stale build)
    _C_NEED_MORE = _records_at = None

# produce_records_at's answer when the frame's first bytes end before its records begin (the
# C version's own object when it is there: callers test it with ``is``)
NEED_MORE: tuple[int, int] = _C_NEED_MORE if _C_NEED_MORE is not None else (-1, -1)


def _produce_records_at_py(buf, pos: int, end: int) -> tuple[int, int] | None:
    """Where the records of a Produce v3-v12 request for one topic and one partition begin in
    its frame, and their length: (offset from the frame's start, length), read from the
    frame's first bytes ``buf[pos:end]`` (``pos`` = the frame's start, after its size). None
    for anything else; NEED_MORE when those bytes end before the records do (the caller may
    read on: a frame's first read is only a header's worth, see broker/server.py HEAD_READ).
    Only a guess for the WAL's placement (storage/wal/placed.py checks that the payload
    appended is exactly this)."""
    buf = memoryview(buf)[:end]         # varints must not run into stale bytes past ``end``
    try:
        if end - pos < 10:
            return NEED_MORE
        if buf[pos] or buf[pos + 1]:                             # api key 0: Produce
            return None
        version = _I16.unpack_from(buf, pos + 2)[0]
        if not 3 <= version <= 12:
            return None
        flexible = version >= 9
        p = pos + 8
        n = _I16.unpack_from(buf, p)[0]                          # client id
        p += 2 + max(n, 0)
        if flexible:
            tags, p = read_uvarint(buf, p)                       # header tagged fields
            if tags:
                return None
            n, p = read_uvarint(buf, p)                          # transactional id
            p += max(n - 1, 0)
        else:
            n = _I16.unpack_from(buf, p)[0]
            p += 2 + max(n, 0)
        p += 6                                                   # acks, timeout
        if flexible:
            topics, p = read_uvarint(buf, p)
            n, p = read_uvarint(buf, p)                          # topic name
            p += n - 1
            parts, p = read_uvarint(buf, p)
            if topics != 2 or parts != 2 or n < 1:
                return None
            p += 4                                               # partition index
            n, p = read_uvarint(buf, p)
            n -= 1
        else:
            if _I32.unpack_from(buf, p)[0] != 1:                 # one topic
                return None
            n = _I16.unpack_from(buf, p + 4)[0]
            p += 6 + n
            if n < 0 or _I32.unpack_from(buf, p)[0] != 1:        # one partition
                return None
            n = _I32.unpack_from(buf, p + 8)[0]
            p += 12
        if n <= 0:
            return None
        if p > end:
            return NEED_MORE
        return p - pos, n
    except (IndexError, struct.error, MalformedRequestError):
        # a read past ``end`` (the slice): the bytes end early (or a varint is malformed,
        # which the caller's bound on reading on for the place ends as well)
        return NEED_MORE


# the server calls this once per large frame: the C version is one call where this Python one
# made ~10 (struct reads, varints, max); the Python one stays as the fallback and the reference
produce_records_at = _records_at if _records_at is not None else _produce_records_at_py
