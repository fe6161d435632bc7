"""Blocks: 4 KiB-aligned runs of packed records, each written with one pwrite."""
from __future__ import annotations

import mmap

from .device import aligned_buffer, hugepage_arena
from .format import ALIGN_DOWN, ALIGN_MASK, align_up

Buffer = mmap.mmap | memoryview          # a mapping of its own, or a slice of an arena


class Block:
    """Records packed back to back in an aligned buffer; `start` is the logical offset."""

    __slots__ = ("start", "scan_from", "buf", "used", "records", "streams", "done", "sealed",
                 "pooled")

    def __init__(self, start: int, scan_from: int, buf: Buffer, pooled: bool = True) -> None:
        self.start = start
        self.scan_from = scan_from      # end of the previous block: recovery's hole starts here
        self.buf = buf
        self.used = 0
        self.records = 0                # records packed (the loop driver's yield rule)
        self.streams: set[int] = set()
        self.done = False
        self.sealed = False
        self.pooled = pooled            # False: a buffer received in place (placed.py), not ours

    @property
    def capacity(self) -> int:
        return len(self.buf)

    @property
    def end(self) -> int:
        """Logical end of the aligned write (next block starts here or later)."""
        return self.start + ((self.used + ALIGN_MASK) & ALIGN_DOWN)     # align_up, inline

    def seal(self) -> None:
        """Zero the padding so a reused buffer never writes stale bytes after the last record."""
        n = (self.used + ALIGN_MASK) & ALIGN_DOWN
        if n > self.used:
            self.buf[self.used:n] = bytes(n - self.used)
        self.sealed = True


class BufferPool:
    """Reuses aligned buffers: a fresh mmap costs ~0.5 us per KiB in page faults on first
    touch, ten times the copy itself, so the hot path must not mmap/munmap per block.

    Buffers up to ARENA_MAX_CLASS are carved from 2 MiB-aligned arenas backed by huge pages
    (see device.hugepage_arena: what the device is given to write matters as much as how);
    arenas are kept until close(), up to max_bytes of them, and their buffers always come
    back to the free list. Larger buffers, and any once the arenas are at max_bytes, are
    mappings of their own, of which up to max_bytes are kept free for reuse."""

    ARENA_BYTES = 8 << 20
    ARENA_MAX_CLASS = 2 << 20

    def __init__(self, max_bytes: int) -> None:
        self._free: dict[int, list[Buffer]] = {}
        self._max = max_bytes
        self._pooled = 0                 # bytes of own-mapping buffers kept free
        self._arenas: list[mmap.mmap] = []
        self._arena_bytes = 0

    @staticmethod
    def size_class(n: int, base: int) -> int:
        """Multiples of the block size, so one class serves every normal block."""
        return max(base, align_up(n, base))

    def get(self, n: int, base: int) -> Buffer:
        size = self.size_class(n, base)
        free = self._free.get(size)
        if free:
            buf = free.pop()
            if type(buf) is mmap.mmap:
                self._pooled -= size
            return buf
        if size <= self.ARENA_MAX_CLASS and self._arena_bytes + self.ARENA_BYTES <= self._max:
            return self._carve(size)
        return aligned_buffer(size)

    def _carve(self, size: int) -> memoryview:
        """A new arena for this size class: one buffer returned, the rest made free."""
        arena, off = hugepage_arena(self.ARENA_BYTES)
        self._arenas.append(arena)
        self._arena_bytes += self.ARENA_BYTES
        whole = memoryview(arena)
        bufs = [whole[off + i * size:off + (i + 1) * size]
                for i in range(self.ARENA_BYTES // size)]
        whole.release()
        bufs.reverse()                   # hand them out in address order
        self._free.setdefault(size, []).extend(bufs[:-1])
        return bufs[-1]

    def put(self, buf: Buffer) -> None:
        size = len(buf)
        if type(buf) is not mmap.mmap:               # an arena's: always reused
            self._free.setdefault(size, []).append(buf)
            return
        if self._pooled + size <= self._max:
            self._free.setdefault(size, []).append(buf)
            self._pooled += size
            return
        try:
            buf.close()
        except BufferError:
            pass

    def close(self) -> None:
        for free in self._free.values():
            for buf in free:
                try:
                    if type(buf) is mmap.mmap:
                        buf.close()
                    else:
                        buf.release()
                except BufferError:
                    pass
        self._free.clear()
        self._pooled = 0
        for arena in self._arenas:
            try:
                arena.close()
            except BufferError:          # a buffer still held (a block never completed)
                pass
        self._arenas.clear()
        self._arena_bytes = 0
