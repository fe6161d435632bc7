"""Blocks: 4 KiB-aligned runs of packed records, each written with one pwrite."""
from __future__ import annotations

import mmap

from .device import aligned_buffer
from .format import align_up


class Block:
    """Records packed back to back in an aligned buffer; `start` is the logical offset."""

    __slots__ = ("start", "scan_from", "buf", "used", "streams", "done", "sealed")

    def __init__(self, start: int, scan_from: int, buf: mmap.mmap) -> None:
        self.start = start
        self.scan_from = scan_from      # end of the previous block: recovery's hole starts here
        self.buf = buf
        self.used = 0
        self.streams: set[int] = set()
        self.done = False
        self.sealed = False

    @property
    def capacity(self) -> int:
        return len(self.buf)

    @property
    def end(self) -> int:
        """Logical end of the aligned write (next block starts here or later)."""
        return self.start + align_up(self.used)

    def seal(self) -> None:
        """Zero the padding so a reused buffer never writes stale bytes after the last record."""
        n = align_up(self.used)
        if n > self.used:
            self.buf[self.used:n] = bytes(n - self.used)
        self.sealed = True


class BufferPool:
    """Reuses aligned buffers: a fresh mmap costs ~0.5 us per KiB in page faults on first
    touch, ten times the copy itself, so the hot path must not mmap/munmap per block."""

    def __init__(self, max_bytes: int) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._max = max_bytes
        self._pooled = 0

    @staticmethod
    def size_class(n: int, base: int) -> int:
        """Multiples of the block size, so one class serves every normal block."""
        return max(base, align_up(n, base))

    def get(self, n: int, base: int) -> mmap.mmap:
        size = self.size_class(n, base)
        free = self._free.get(size)
        if free:
            self._pooled -= size
            return free.pop()
        return aligned_buffer(size)

    def put(self, buf: mmap.mmap) -> None:
        size = len(buf)
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
                    buf.close()
                except BufferError:
                    pass
        self._free.clear()
        self._pooled = 0
