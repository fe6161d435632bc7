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
    """Reuses aligned buffers so the hot path does not mmap/munmap (and page-fault) per block."""

    def __init__(self, keep_per_size: int, max_pooled_size: int = 8 << 20) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._keep = keep_per_size
        self._max = max_pooled_size

    @staticmethod
    def size_class(n: int, base: int) -> int:
        size = max(base, 4096)
        while size < n:
            size *= 2
        return size

    def get(self, n: int, base: int) -> mmap.mmap:
        size = self.size_class(n, base)
        free = self._free.get(size)
        if free:
            return free.pop()
        return aligned_buffer(size)

    def put(self, buf: mmap.mmap) -> None:
        size = len(buf)
        free = self._free.setdefault(size, [])
        if size <= self._max and len(free) < self._keep:
            free.append(buf)
        else:
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
