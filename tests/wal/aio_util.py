"""What the native-AIO and io_uring tests share: a buffer's address and a blocking reap."""
from __future__ import annotations

import ctypes
import mmap
import select

from storage.wal.aio import AioContext, UringContext


def address_of(m: mmap.mmap) -> tuple[ctypes.c_char, int]:
    """(a ctypes handle that keeps the export alive, the address of ``m``'s first byte)."""
    c = ctypes.c_char.from_buffer(m)
    return c, ctypes.addressof(c)


def wait_reap(ctx: AioContext | UringContext, want: int) -> list[tuple[int, int]]:
    """At least ``want`` completions of ``ctx``, waiting on its eventfd (10 s per wait)."""
    got: list[tuple[int, int]] = []
    while len(got) < want:
        assert select.select([ctx.eventfd], [], [], 10)[0], "no completion signalled"
        ctx.clear_signal()
        got += ctx.reap()
    return got
