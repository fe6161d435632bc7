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
takes that copy off the loop.
"""
from __future__ import annotations

import asyncio
import time

from .objects.format import (DEFAULT_BLOCK_SIZE, Buffer, IndexEntry, ObjectEncoder, Record,
                             StreamRange)

SLICE_S = 0.0005


async def encode_object_in_slices(records: list[Record], block_size: int = DEFAULT_BLOCK_SIZE,
                                  slice_s: float = SLICE_S, into: Buffer | None = None
                                  ) -> tuple[Buffer | memoryview, list[IndexEntry],
                                             list[StreamRange]]:
    """encode_object() on the running loop, yielding to other callbacks every ``slice_s``
    (``into``: a reusable buffer, see ObjectEncoder)."""
    enc = ObjectEncoder(records, block_size, into)
    while not enc.encode(until=time.perf_counter() + slice_s):
        await asyncio.sleep(0)
    return enc.finish()


def encode_object_into(records: list[Record], block_size: int = DEFAULT_BLOCK_SIZE,
                       into: Buffer | None = None) -> tuple[Buffer | memoryview, list[IndexEntry],
                                                            list[StreamRange]]:
    """encode_object() at once, for a worker thread: only for large records, whose copies
    (ObjectEncoder, from NOGIL_COPY_FROM bytes) and block CRCs release the GIL, so the thread
    holds it for a few microseconds per record rather than for the whole object."""
    enc = ObjectEncoder(records, block_size, into)
    enc.encode()
    return enc.finish()
