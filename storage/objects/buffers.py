"""Reusable page-aligned read buffers for cold reads (issue 20).

Fresh memory is what cold reads cost most on this VM: a 512 KiB-1 MiB block read into new
memory (``os.pread`` -> a new ``bytes``, or a new mmap) pays a page fault per 4 KiB, measured
0.4-1.1 ms of CPU per MiB, against 0.11 ms per MiB for the read itself into a buffer used
before (bench/HISTORY.md, session 12). So block buffers come from this pool and go back to it
when the BlockCache drops the block and nothing else still sees it.

A buffer is an anonymous mmap (page aligned, as O_DIRECT wants; no zero-fill with the GIL
held: the kernel fills pages inside the read call), of huge pages from 2 MiB (see HUGE). Views of it (a block's records, a Fetch
answer being written) keep a reference to the mmap through their managed buffer, so a buffer
whose reference count is back to the pool's own is seen by no one and may be written again.
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


class BufferPool:
    """Free buffers (by capacity) plus buffers handed back that may still be seen by readers;
    both bounded by ``max_bytes``. ``take`` runs on the cold-read threads, ``give_back`` on
    the event loop."""

    def __init__(self, max_bytes: int = 128 << 20) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        # by id: a buffer holding several blocks is handed back once per block
        self._returned: dict[int, mmap.mmap] = {}
        self.bytes = 0                    # capacity held in _free + _returned
        self.reused = 0
        self.fresh = 0

    def take(self, size: int) -> mmap.mmap:
        """A page-aligned buffer of at least ``size`` bytes (contents undefined)."""
        cap = -(-max(size, 1) // GRANULE) * GRANULE
        with self._lock:
            self._collect()
            free = self._free
            for i in range(len(free) - 1, -1, -1):
                buf = free[i]
                if cap <= len(buf) <= 2 * cap:
                    del free[i]
                    self.bytes -= len(buf)
                    self.reused += 1
                    return buf
        self.fresh += 1
        buf = mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE)
        if cap >= HUGE and _MADV_HUGEPAGE is not None:
            try:
                buf.madvise(_MADV_HUGEPAGE)
            except OSError:
                pass                      # no transparent huge pages here: 4 KiB pages
        return buf

    def _collect(self) -> None:
        """Move returned buffers nobody sees any more to the free list (lock held)."""
        returned = self._returned
        for key in list(returned):
            buf = returned[key]
            # 3 = the dict's value, this name and getrefcount's argument
            if sys.getrefcount(buf) == 3:
                del returned[key]
                self._free.append(buf)
            del buf

    def give_back(self, buf: object) -> None:
        """A buffer the caller no longer uses (views of it may still live: it is reused only
        once they are gone); ignored when it is not a pool buffer or the pool is full."""
        if type(buf) is not mmap.mmap:
            return
        n = len(buf)
        with self._lock:
            returned = self._returned
            if id(buf) in returned:
                return
            if self.bytes + n > self.max_bytes:
                # full of buffers still seen: drop the oldest returned (freed when its views go)
                if not returned:
                    return
                old = returned.pop(next(iter(returned)))
                self.bytes -= len(old)
                del old
                if self.bytes + n > self.max_bytes:
                    return
            returned[id(buf)] = buf
            self.bytes += n
