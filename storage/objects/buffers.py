"""Reusable page-aligned read buffers for cold reads (issue 20).

Fresh memory is what cold reads cost most on this VM: a 512 KiB-1 MiB block read into new
memory (``os.pread`` -> a new ``bytes``, or a new mmap) pays a page fault per 4 KiB, measured
0.4-1.1 ms of CPU per MiB, against 0.11 ms per MiB for the read itself into a buffer used
before (bench/HISTORY.md, session 12). So block buffers come from this pool and go back to it
when the BlockCache drops the block and nothing else still sees it.

A buffer is an anonymous mapping (storage._copycrc.map_buffer, else an mmap; page aligned, as
O_DIRECT wants; no zero-fill with the GIL held), of huge pages from 2 MiB (see HUGE). Views of
it (a block's records, a Fetch answer being written) keep a reference to the mapping through
their managed buffer, so a buffer whose reference count is back to the pool's own is seen by
no one and may be written again.

A fresh buffer is faulted in by ``take`` itself, on the cold-read thread, before the read
(storage._copycrc.fault_in: a write per 4 KiB page, the GIL released). Left to the O_DIRECT
read, the kernel faults the pages in while pinning them for the device (GUP), holding the
process's mmap_lock (read) across the read's range; fresh memory costs ~2 ms of CPU per MiB
on the test VM (the host faults it in too), so a span read held it up to 15-21 ms, and any
mmap/munmap meanwhile (the event loop's allocator among them) waited for the write lock
behind it. A page fault takes only the buffer's own VMA lock; the read then pins pages
already there without the lock. The cold pass after a restart (~230 MiB of fresh buffers):
the loop waited on mmap_lock up to 15.7-23.9 ms (6-11 waits > 5 ms per pass), now at most
0.07 ms, at the same MB/s and CPU (bench/HISTORY.md, session 36 coldfault). MAP_POPULATE
and madvise(MADV_POPULATE_WRITE) would fault the pages under mmap_lock just the same.
"""
from __future__ import annotations

import mmap
import sys
import threading

PAGE = 4096
# sizes are rounded up to this, so buffers of neighbouring block sizes are interchangeable
GRANULE = 64 << 10
# buffers this large ask for transparent huge pages (madvise; the kernel default here): an
# O_DIRECT read is one device request per physically contiguous run of the buffer, at most
# max_segments (254 on the test VM's virtio disk) runs per request, so a 4 MiB read into
# 4 KiB pages went to the device as 5 requests of <= 1016 KiB, into 2 MiB pages as one.
# Cold raw Fetch pass 598-680 -> 884-973 MB/s alternating on the shared VM (bench/HISTORY.md,
# session 15); pinning the pages for the read also costs a third of the CPU.
HUGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
# Fresh buffers are mapped by storage._copycrc's map_buffer when built: mmap and madvise with
# the interpreter lock released. Both take the process's mmap lock for writing, which waits
# behind every page fault in progress in other threads: in a cold pass after a restart the
# cold threads' O_DIRECT reads fault in fresh huge pages (~200-300 MiB of them), and a cold
# thread in Python's mmap()/madvise() waited there holding the interpreter lock, so the event
# loop waited for it (bench/HISTORY.md, session 24: perf sched of one pass, the loop blocked
# ~150 ms on the lock while a cold thread sat in mmap/madvise, stalls of 20-85 ms in the
# pass's first 400 ms). Python's mmap module is the fallback.
from ..copycrc import MappedBuffer as _MappedBuffer, fault_in as _fault_in, \
    map_buffer as _map_buffer
_POOL_TYPES = (mmap.mmap,) if _MappedBuffer is None else (mmap.mmap, _MappedBuffer)


class BufferPool:
    """Free buffers (by capacity) plus buffers handed back that may still be seen by readers
    (returned), at most ``max_returned`` bytes of those (default twice ``max_bytes``), and at
    most ``max_bytes + max_returned`` bytes of both together. ``take`` runs on the cold-read
    threads, ``give_back`` on the event loop.

    A returned buffer still seen is memory in use anyway (its blocks in the BlockCache, an
    answer being written): it is not given up to make room for free ones, nor when more are
    returned. Giving it up freed nothing then and forfeited its reuse: with both in one
    budget, a cold pass handed ~40 % of its buffers to the collector (an 8 MiB span is
    returned when its first block is dropped, with the other blocks still cached), and every
    one was replaced by a fresh buffer, ~0.9 ms of CPU per MiB against ~0.05 for a read into
    a buffer used before (bench/HISTORY.md, session 17).

    Free buffers may use the room the returned ones leave (the pool's bound is the same, the
    sum of both budgets). A paced catch-up reader (bench.catchup: a 64 MiB BlockCache, so 32
    MiB of free buffers) needs ~90 MiB of buffers besides those under its cached blocks while
    its prefetches are in flight, and each pause of the reader landed them in the free list,
    where a 32 MiB free budget let go of two thirds of them: every 4 s window of reading then
    mapped 25-40 MiB of fresh buffers, faulted in again (the hot appends beside them stalled,
    issue 20 item 5; bench/HISTORY.md session 35 pool)."""

    def __init__(self, max_bytes: int = 128 << 20, max_returned: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_returned = max_returned
        self._lock = threading.Lock()
        self._free: list = []
        self._free_bytes = 0
        # by id: a buffer holding several blocks is handed back once per block
        self._returned: dict[int, object] = {}
        self._returned_bytes = 0
        self.reused = 0
        self.fresh = 0                    # buffers mapped (take found no free one that fits)
        self.fresh_bytes = 0
        self.dropped = 0                  # buffers let go instead of kept (budgets full)
        self.dropped_bytes = 0
        # free buffers let go on the event loop (give_back), unmapped by the next take on a
        # cold-read thread: unmapping 8 MiB costs the loop ~0.1-0.2 ms (see store.get_ranges)
        self._doomed: list = []

    @property
    def bytes(self) -> int:
        """Capacity held by the pool: free buffers plus returned ones."""
        return self._free_bytes + self._returned_bytes

    @property
    def returned_limit(self) -> int:
        """Most bytes of returned buffers held."""
        return self.max_returned if self.max_returned is not None else 2 * self.max_bytes

    @property
    def limit(self) -> int:
        """Most bytes of free and returned buffers held together."""
        return self.max_bytes + self.returned_limit

    def take(self, size: int, unlocked: bool = True) -> mmap.mmap | _MappedBuffer:
        """A page-aligned buffer of at least ``size`` bytes (contents undefined). A fresh one
        is mapped by map_buffer (without the interpreter lock) when ``unlocked``, else by
        Python's mmap module: the file store's reads while producers append (the paced
        catch-up path, issue 20 item 5) keep the buffers they were measured with; either is
        faulted in here (fault_in, when built) before it is handed out."""
        cap = -(-max(size, 1) // GRANULE) * GRANULE
        with self._lock:
            doomed, self._doomed = self._doomed, []
            self._collect()
            free = self._free
            best = -1
            for i in range(len(free) - 1, -1, -1):
                n = len(free[i])
                if cap <= n and (best < 0 or n < len(free[best])):
                    best = i
                    if n == cap:
                        break
            if best >= 0:
                # the smallest that fits: a larger one too (idle memory either way; the
                # read spans of a ramping readahead come in 1-8 MiB, and with only buffers of
                # about the same size taken, a pass kept fresh mapping beside a full free list).
                # The smallest of all: the first within twice the size (as before session 35)
                # had a ramp's 1 MiB read take its 2 MiB buffer, its 2 MiB read the 4 MiB one
                # and so on up, and its last 7.5 MiB span map a fresh buffer
                buf = free.pop(best)
                self._free_bytes -= len(buf)
                self.reused += 1
                return buf
            self.fresh += 1
            self.fresh_bytes += cap
        buf = fresh_buffer(cap, unlocked)
        if _fault_in is not None:
            # here, on the cold thread, not by the O_DIRECT read under the process's
            # mmap_lock (see the module docstring): same CPU, out from under the lock
            _fault_in(buf)
        return buf

    def _collect(self) -> None:
        """Move returned buffers nobody sees any more to the free list while the pool has
        room (lock held, see _keep)."""
        returned = self._returned
        for key in list(returned):
            buf = returned[key]
            # 3 = the dict's value, this name and getrefcount's argument
            if sys.getrefcount(buf) == 3:
                del returned[key]
                self._returned_bytes -= len(buf)
                self._keep(buf)
            del buf

    def _keep(self, buf: object) -> None:
        """Put an unseen buffer on the free list; when the pool is full, smaller free buffers
        are let go to make room for it (smallest first), and it is let go itself only when
        they would not make enough room (lock held).

        Larger buffers are worth more: a larger free buffer serves a smaller read, a smaller
        one not a larger. Letting go of the one that did not fit kept a catch-up reader's
        free list full of its readahead ramp's small buffers (1, 2, 4 MiB) and dropped the
        7.6 MiB span buffers it read into next, each then mapped afresh (session 35 pool)."""
        n = len(buf)
        if self._shed(self.bytes + n - self.limit, n):
            self._free.append(buf)
            self._free_bytes += n
        else:
            self._let_go(n)

    def _shed(self, need: int, smaller_than: int | None = None) -> bool:
        """Let go of free buffers (only those smaller than ``smaller_than`` when given),
        smallest first, until ``need`` bytes are let go; False, and none let go, when they
        hold less (lock held)."""
        if need <= 0:
            return True
        some = sorted((b for b in self._free if smaller_than is None or len(b) < smaller_than),
                      key=len)
        if sum(len(b) for b in some) < need:
            return False
        gone: set[int] = set()
        for b in some:
            if need <= 0:
                break
            gone.add(id(b))
            need -= len(b)
            self._free_bytes -= len(b)
            self._let_go(len(b))
            self._doomed.append(b)
        self._free = [b for b in self._free if id(b) not in gone]
        return True

    def _let_go(self, n: int) -> None:
        self.dropped += 1
        self.dropped_bytes += n

    def give_back(self, buf: object) -> None:
        """A buffer the caller no longer uses (views of it may still live: it is reused only
        once they are gone); ignored when it is not a pool buffer."""
        if type(buf) not in _POOL_TYPES:
            return
        n = len(buf)
        limit = self.returned_limit
        with self._lock:
            returned = self._returned
            if id(buf) in returned:
                return
            if self._returned_bytes + n > limit:
                # bounded all the same: the oldest returned is given up (freed once unseen)
                self._collect()
                while returned and self._returned_bytes + n > limit:
                    old = returned.pop(next(iter(returned)))
                    self._returned_bytes -= len(old)
                    self._let_go(len(old))
                    del old
                if self._returned_bytes + n > limit:
                    self._let_go(n)
                    return
            # idle buffers make room for it (always enough: returned ones stay within
            # returned_limit, so the free ones may hold at least max_bytes)
            self._shed(self.bytes + n - self.limit)
            returned[id(buf)] = buf
            self._returned_bytes += n


def fresh_buffer(size: int, unlocked: bool = True) -> mmap.mmap | _MappedBuffer:
    """A fresh anonymous mapping of ``size`` bytes (page aligned), of huge pages from HUGE on
    where the kernel allows (advice only); mapped without the interpreter lock when
    ``unlocked`` and map_buffer is built (see above), else by Python's mmap module. Also the
    file store's streamed-put rings (store.py)."""
    if unlocked and _map_buffer is not None:
        return _map_buffer(size, size >= HUGE and _MADV_HUGEPAGE is not None)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    if size >= HUGE and _MADV_HUGEPAGE is not None:
        try:
            buf.madvise(_MADV_HUGEPAGE)
        except OSError:
            pass                          # no transparent huge pages here: 4 KiB pages
    return buf
