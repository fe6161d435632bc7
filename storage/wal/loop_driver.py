"""Driving the WAL's writes from the event loop with native AIO instead of IO threads.

The thread engine costs the loop a GIL hand-off per write started (an IO thread wakes) and
per write finished (the thread wakes, takes the GIL, then wakes the loop). Here the loop
itself seals blocks at the end of its current turn, submits them with io_submit (up to the
same queue depth), and reaps completions when the AIO eventfd turns readable in its own epoll
set. The time-based seal and the bandwidth limit wait on a timerfd (uvloop's own timers fire in
whole milliseconds). Measured against the thread engine on this VM, alternating processes:
see docs/wal.md.

Every method here runs on the loop thread, except kick_soon() (any thread), detach_from_thread()
and drain_sync(), which runs once the loop no longer drives this WAL. Blocks, ordering, the
window and recovery are the WAL's own and unchanged: only who writes and who completes differs.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time
from typing import TYPE_CHECKING

from .aio import TimerFD, open_context, yield_cpu
from .config import IO_RETRIES, IO_RETRY_DELAY_S
from .format import ALIGN_DOWN, ALIGN_MASK, align_up

# writes at least this large, of records this large on average, yield the CPU after their
# submit (see LoopDriver._submit). The record size is above the largest record a produce run
# makes (broker/server.py RUN_MAX_REQUESTS x produce.RUN_MAX_RECORDS_BYTES = 512 KiB: small
# linger-0 requests merged after the loop fell behind), so only large requests yield
YIELD_FROM_BYTES = 256 << 10
YIELD_FROM_RECORD_BYTES = 768 << 10

if TYPE_CHECKING:
    from .block import Block
    from .wal import DeltaWAL

log = logging.getLogger(__name__)

class LoopDriver:
    """Submits sealed blocks and completes them, on one event loop."""

    def __init__(self, wal: "DeltaWAL", loop: asyncio.AbstractEventLoop) -> None:
        cfg = wal.config
        self.wal = wal
        self.loop = loop
        self.depth = cfg.io_threads
        self.dsync = cfg.sync_mode != "none"
        self.aio = open_context(max(8, 2 * cfg.io_threads), cfg.io_engine)
        try:
            self.timer = TimerFD()
        except BaseException:
            self.aio.close()
            raise
        # token -> (blocks, what must outlive the request, bytes, attempt)
        self._inflight: dict[int, tuple[list["Block"], list, int, int]] = {}
        self._token = 0
        self._delayed: dict[int, tuple[list["Block"], int]] = {}   # (blocks, attempt) to retry
        self._kick_scheduled = False
        self._attached = True                  # the loop watches our fds and runs kick()
        self._sync = False                     # a closing thread drives the writes instead
        self._thread_id = threading.get_ident()
        # the yield after large writes is for a loop device's kernel worker (see _submit)
        self.yield_after_large = bool(wal._device is not None and wal._device.on_loop_device)
        loop.add_reader(self.aio.eventfd, self.on_completion)
        loop.add_reader(self.timer.fd, self.on_timer)

    # -- scheduling ------------------------------------------------------------------------
    def on_loop(self) -> bool:
        return threading.get_ident() == self._thread_id

    def kick_soon(self) -> None:
        """Submit what is sealed at the end of this loop turn (appends of the turn share a
        block). From another thread (a blocking append()) the loop is woken for it."""
        if self._kick_scheduled or not self._attached:
            return
        self._kick_scheduled = True
        if self.on_loop():
            self.loop.call_soon(self.kick)
        else:
            try:
                self.loop.call_soon_threadsafe(self.kick)
            except RuntimeError:            # loop closed: close() drains synchronously
                self._kick_scheduled = False

    def on_timer(self) -> None:
        self.timer.consume()
        self.kick()

    def kick(self) -> None:
        """Seal the current block when the IOPS budget allows and start every write the
        queue depth and the window allow; arm the timer for what has to wait. With nothing to
        seal or start (``_nothing_to_write``, read here without the lock: an append on another
        thread kicks on its own after it) it returns before the lock and the clock: a
        completion whose blocks were the last ones, a timer or a scheduled kick that an
        earlier one already served."""
        self._kick_scheduled = False
        wal = self.wal
        if not (self._attached or self._sync) or wal._nothing_to_write():
            return
        started: list[list["Block"]] = []
        with wal._lock:
            if wal._failed is not None:
                return
            now = time.monotonic()
            cur = wal._current
            if (cur is not None and cur.used and not wal._pending
                    and wal._writes < wal.config.eager_writes):
                if now >= wal._next_seal_at or wal._closing:
                    wal._seal_locked()
                    wal._next_seal_at = now + wal.config.flush_interval_s
                else:
                    self.timer.arm(wal._next_seal_at)
            limit = wal.config.bandwidth_limit
            while (wal._pending and self._may_start(wal)
                   and wal._window_allows(wal._pending[0])):
                if limit and wal._bw_next > now and not wal._closing:
                    self.timer.arm(wal._bw_next)
                    break
                group = wal._take_group()
                if limit:
                    n = sum(align_up(b.used) for b in group)
                    wal._bw_next = max(now, wal._bw_next) + n / limit
                started.append(group)
        for group in started:
            self._submit(group, 0)

    def _may_start(self, wal: "DeltaWAL") -> bool:
        """As with threads: eager_writes at once, the full depth while sealed blocks back up."""
        if wal._writes < wal.config.eager_writes:
            return True
        return wal._writes < self.depth and (wal._pending_bytes >= wal._backlog
                                             or wal._closing)

    # -- writes ----------------------------------------------------------------------------
    def _submit(self, group: list["Block"], attempt: int) -> None:
        wal = self.wal
        assert wal._device is not None
        exports = [ctypes.c_char.from_buffer(b.buf) for b in group]
        pieces = [(ctypes.addressof(c), (b.used + ALIGN_MASK) & ALIGN_DOWN)
                  for c, b in zip(exports, group)]
        self._token += 1
        token = self._token
        try:
            keep = self.aio.submit_write(wal._device.fd, pieces, wal.device_position(
                group[0].start), token, self.dsync)
        except OSError as e:
            del exports
            self._retry(group, attempt, e)
            return
        size = sum(n for _, n in pieces)
        self._inflight[token] = (group, [exports, keep], size, attempt)
        # A device served by a kernel worker (a loop device's, the writes to its backing file)
        # gets it woken on this CPU by io_submit: on these VMs the scheduler packs it here and
        # lets it wait while the loop goes on appending (~0.3 ms per 4 MiB copied), so the
        # device idled. Yielding lets it start the write now: loop device, alternating runs,
        # 1 MiB records 0.75 -> 0.85 of raw, 256 KiB 0.70 -> 0.83 (bench/HISTORY.md). Only
        # after large writes: with other runnable work on the CPU each yield hands it the CPU
        # and a small acks=all request waits a scheduler slice (100 B at 1000 msgs/s under
        # load, p50 76-237 ms with a yield per write against 30-33 ms without, session 11).
        # Nor after a large write of small records: that is a backlog of small requests
        # (the loop fell behind, e.g. the 100 B latency benchmark after a stall), and handing
        # the CPU to the producer then makes the loop later still (session 14); nor of the
        # records of produce runs (up to 512 KiB: the same backlog, merged; session 15).
        # Nor on any other device (a file on a disk's file system, a disk): io_submit starts
        # those writes itself, and the yield only handed the loop's CPU to whatever else was
        # runnable - a co-located producer, under a confluent-kafka 1 KiB producer 593-627 ->
        # 704-807 MB/s without it, WAL append->durable 8.9-12.4 -> 3.2-4.0 ms (session 19).
        if self.yield_after_large and size >= YIELD_FROM_BYTES and \
                size >= YIELD_FROM_RECORD_BYTES * sum(b.records for b in group):
            yield_cpu()

    def on_completion(self) -> None:
        self.aio.clear_signal()
        self._finish(self.aio.reap())
        self.kick()

    def _finish(self, events: list[tuple[int, int]]) -> None:
        """Complete reaped writes. The next writes start before the finished ones are
        completed: a device that finishes several writes at once (a loop device completes
        every DSYNC write behind one flush of its backing file, so its queue runs 4 -> 0 -> 4)
        would otherwise sit idle while the loop resolves their futures (wake-up -> first new
        submit 0.14 ms before, 0.075 ms after)."""
        wal = self.wal
        written: list[list["Block"]] = []
        for token, res in events:
            item = self._inflight.pop(token, None)
            if item is None:
                continue
            group, keep, n, attempt = item
            keep.clear()                      # release the buffers before the pool reuses them
            if res != n:
                err = OSError(-res, f"WAL write failed: {res}") if res < 0 else \
                    OSError(f"short WAL write: {res} of {n} bytes")
                self._retry(group, attempt, err)
                continue
            written.append(group)
        if not written:
            return
        wal._release_writes(len(written))
        try:
            self.kick()
        finally:                              # durable writes are acknowledged whatever kick() hit
            wal._complete_groups(written, released=True)     # one pass for the batch reaped

    def _retry(self, group: list["Block"], attempt: int, err: BaseException) -> None:
        """Rewrite the whole group (same bytes, same place) a few times, then fail the WAL."""
        log.warning("WAL write at %d failed (attempt %d): %s",
                    self.wal.device_position(group[0].start), attempt + 1, err)
        if attempt + 1 >= IO_RETRIES or not (self._attached or self._sync):
            self.wal._fail(err)
            return
        if self._sync:
            time.sleep(IO_RETRY_DELAY_S)
            self._submit(group, attempt + 1)
            return
        self._token += 1
        self._delayed[self._token] = (group, attempt + 1)
        self.loop.call_later(IO_RETRY_DELAY_S, self._resubmit, self._token)

    def _resubmit(self, key: int) -> None:
        item = self._delayed.pop(key, None)
        if item is not None and self._attached:
            self._submit(*item)
        elif item is not None:
            self._delayed[key] = item          # drain_sync() rewrites it

    # -- shutdown --------------------------------------------------------------------------
    def detach(self) -> None:
        """Stop watching the fds (loop thread, or the loop is not running)."""
        if not self._attached:
            return
        self._attached = False
        for fd in (self.aio.eventfd, self.timer.fd):
            try:
                self.loop.remove_reader(fd)
            except (RuntimeError, ValueError, OSError):
                pass                           # loop already closed

    def detach_from_thread(self, timeout: float = 10.0) -> None:
        """Detach via the loop when it is running on another thread, else directly."""
        if self.on_loop() or not self.loop.is_running():
            self.detach()
            return
        done = threading.Event()

        def go() -> None:
            self.detach()
            done.set()
        try:
            self.loop.call_soon_threadsafe(go)
        except RuntimeError:
            self.detach()
            return
        if not done.wait(timeout):
            log.warning("WAL: event loop did not release the AIO fds within %.0f s", timeout)

    def drain_sync(self, deadline: float) -> None:
        """Write and complete everything left, blocking the caller: close() once the loop
        no longer watches our fds (detached, or not running)."""
        wal = self.wal
        self._sync = True
        try:
            while self._delayed:
                _key, item = self._delayed.popitem()
                self._submit(*item)
            while True:
                with wal._lock:
                    idle = not self._inflight and wal._nothing_to_write()
                    failed = wal._failed is not None
                if idle or failed:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError("WAL writes did not finish in time")
                self.kick()
                if self._inflight:
                    self._finish(self.aio.reap(0.1))
        finally:
            self._sync = False

    def close(self) -> None:
        self.aio.close()
        self.timer.close()
