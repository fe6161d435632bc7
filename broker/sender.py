"""Large responses written to their socket by a sender thread, off the event loop.

Why: a raw Fetch of 8 MiB answers spent ~87 % of the broker's CPU in the kernel's send path
(``writev``: the copy into the socket's buffers and loopback TCP, `perf record`, session 28),
all of it on the event loop thread. The broker was bound by that one core (0.94 core busy,
the reader 0.47) while the machine had two. ``os.writev`` releases the interpreter lock, so a
send on another thread runs beside the loop's Python (its parsing, reads, WAL completions),
and the loop no longer holds hot requests behind a multi-MiB socket copy.

How: a connection hands an answer of at least OFFLOAD_MIN bytes to ``send_some`` on the
broker's sender pool when nothing else is queued on its socket (the transport's own buffer is
empty); until the thread is done, later answers of that connection queue behind it, so the
order on the wire is the order of the requests. The thread writes to a ``dup`` of the
socket's descriptor: if the transport closes its own descriptor meanwhile, the number cannot
be reused under the thread for another socket or file. A socket that takes nothing for
STALL_S (a consumer that stopped reading) gives the rest back to the transport, which waits
for room on the loop without holding a sender thread.
"""
from __future__ import annotations

import os
import select
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from storage.wal.wal import as_bytes_view

# answers from this size on are sent by a sender thread (a thread hop costs ~20-50 us; the
# kernel's send of 1 MiB on loopback ~0.2 ms)
OFFLOAD_MIN = 1 << 20
STALL_S = 0.01
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
MAX_THREADS = 4


def sender_pool(cpus: int | None = None) -> ThreadPoolExecutor | None:
    """The broker's sender threads, or None on one CPU (a thread would only add hops)."""
    n = min(MAX_THREADS, cpus if cpus is not None else (os.cpu_count() or 1))
    if n < 2:
        return None
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="s3kafka-send")


def byte_views(buffers: Sequence[Any]) -> list[memoryview]:
    """Flat byte views of ``buffers`` (the encoders' bytes, bytearrays and memoryviews)."""
    return [as_bytes_view(b) for b in buffers]


def send_some(fd: int, views: list[memoryview]) -> list[memoryview]:
    """On a sender thread: write ``views`` to non-blocking socket ``fd`` in order, waiting
    for room while the socket takes bytes; returns what is left unsent (empty when all went
    out, the rest when the socket took nothing for STALL_S). Raises OSError when the
    connection is broken."""
    i = 0
    poller: Any = None
    while i < len(views):
        try:
            n = os.writev(fd, views[i:i + IOV_MAX])
        except BlockingIOError:
            if poller is None:
                poller = select.poll()
                poller.register(fd, select.POLLOUT)
            if not poller.poll(STALL_S * 1000):
                break
            continue
        # past what went out (empty views included: writev takes them and writes nothing)
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
    return views[i:]
