"""CPU-bound storage work run on the event loop in short slices, not in a worker thread.

Encoding an object is Python code over every record plus a copy of every payload. In a worker
thread it holds the GIL for the whole object, and the event loop then waits for the GIL each
time it wakes up (a socket read, a WAL completion): measured here, a 10 ms encode in a thread
held cross-thread wake-ups of the loop up to 6 ms, and in the catch-up benchmark every upload
(every 5 s) showed as a 3-26 ms event-loop lag and a cluster of slow produce acknowledgements.
On the loop itself the same work runs in slices of SLICE_S with a yield in between, so hot
requests wait at most about one slice; the CPU spent is the same. Objects of large records
(at least NOGIL_COPY_FROM bytes each on average) are the exception: their copies and CRCs
release the GIL, so they are encoded on an IO thread at once (``encode_object_into``), which
takes that copy off the loop. With the C encoder built (storage._copycrc.encode_blocks) that
holds for objects of small records too: the thread holds the GIL only to gather one block's
records and releases it for the block's copy and CRC. The sliced encode on the loop is the
fallback without the extension: measured in-process (bench/HISTORY.md, session 18), its slices
of a 64 MiB upload of ~1.2 KB records took 150-250 ms of loop time in steps of up to 9 ms (one
call encodes a whole 512 KiB block, and a fresh encode buffer's pages fault in on the loop).

The same holds for the upload's other passes over its entries (grouping them into records
per stream, sizing the object): with small produce requests a 64 MiB upload is ~45,000
entries, and one unsliced pass over them was a 50 ms event-loop stall (a burst of slow
acknowledgements at every upload, the latency benchmark's spikes; bench/HISTORY.md,
session 14).
"""
from __future__ import annotations

import asyncio
import time

from typing import Any, Callable, Iterable

from .copycrc import encode_blocks as _native_encode_blocks
from .objects.format import (DEFAULT_BLOCK_SIZE, Buffer, IndexEntry, ObjectEncoder, Record,
                             StreamRange, object_size_steps)

# the C object encoder (storage._copycrc.encode_blocks) is built: objects of small records are
# encoded on a worker thread too (encode_object_into), not in slices on the loop
NATIVE_ENCODE = _native_encode_blocks is not None

SLICE_S = 0.0005
# items handled between two clock reads in the sliced passes (each item costs ~1 us)
CHECK_EVERY = 256


def no_pause() -> float:
    """The ``pause`` of a pass nothing should slow down: yield to the loop, wait for nothing."""
    return 0.0


async def for_each_in_slices(items: Iterable[Any], fn: Callable[[Any], Any],
                             slice_s: float = SLICE_S) -> None:
    """``fn(item)`` for every item, on the running loop, yielding to other callbacks every
    ``slice_s``: a pass over tens of thousands of items without one long stall."""
    clock = time.perf_counter
    until = clock() + slice_s
    n = 0
    for item in items:
        fn(item)
        n += 1
        if n >= CHECK_EVERY:
            n = 0
            if clock() >= until:
                await asyncio.sleep(0)
                until = clock() + slice_s


async def object_size_in_slices(records: list[Record], block_size: int,
                                slice_s: float = SLICE_S,
                                pause: Callable[[], float] = no_pause) -> int:
    """format.object_size() on the running loop, in slices (format.object_size_steps;
    ``pause()``: seconds to wait after each slice, as in encode_object_in_slices)."""
    clock = time.perf_counter
    until = clock() + slice_s
    steps = object_size_steps(records, block_size, CHECK_EVERY)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        if clock() >= until:
            await asyncio.sleep(pause())
            until = clock() + slice_s


async def encode_object_in_slices(records: list[Record], block_size: int = DEFAULT_BLOCK_SIZE,
                                  slice_s: float = SLICE_S, into: Buffer | None = None,
                                  size: int | None = None,
                                  pause: Callable[[], float] = no_pause
                                  ) -> tuple[Buffer | memoryview, list[IndexEntry],
                                             list[StreamRange]]:
    """encode_object() on the running loop, yielding to other callbacks every ``slice_s``
    (``into``: a reusable buffer, ``size``: the object's size if known, see ObjectEncoder;
    ``pause()``: seconds to wait after each slice, asked each time: a background upload
    leaves the loop to hot requests most of the time)."""
    enc = ObjectEncoder(records, block_size, into, size)
    while not enc.encode(until=time.perf_counter() + slice_s):
        await asyncio.sleep(pause())
    return enc.finish()


def encode_object_into(records: list[Record], block_size: int = DEFAULT_BLOCK_SIZE,
                       into: Buffer | None = None, size: int | None = None
                       ) -> tuple[Buffer | memoryview, list[IndexEntry], list[StreamRange]]:
    """encode_object() at once, for a worker thread: for large records, whose copies
    (ObjectEncoder, from NOGIL_COPY_FROM bytes) and block CRCs release the GIL, so the thread
    holds it for a few microseconds per record rather than for the whole object; and for
    small records when the C encoder is built (``NATIVE_ENCODE``): it holds the GIL only
    while it gathers one data block's records (~0.2 us each, ~0.1 ms per 512 KiB block of
    ~1 KB records) and copies and checksums the block with it released. ``size``: the
    object's size when the caller computed it (else a sizing pass here, GIL held)."""
    enc = ObjectEncoder(records, block_size, into, size, release_gil=True)
    enc.encode()
    return enc.finish()
