"""DeltaWAL: append records, write them in aligned blocks, recover after a crash.

Threads: appenders (usually the asyncio loop) copy a record into the current block under one
lock and return at once. Until attach_loop(), IO threads take sealed blocks themselves (merging
physically consecutive ones into one pwritev), seal the current block by time within the IOPS
budget when nothing else is queued, respect the sliding window, write, and complete futures in
order per stream. After attach_loop() (io_engine "uring" or "aio") the event loop does the
same with io_uring or native AIO (loop_driver.py) and the threads exit. Nothing here blocks
the event loop except a header write on trim or window growth (one 4 KiB write).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

import crc32c

from ..copycrc import NATIVE as COPY_CRC_NATIVE, copy_crc, copy_crc_split, copy_record, \
    place_record
from . import placed
from .block import Block, BufferPool
from .config import IO_RETRIES, IO_RETRY_DELAY_S, LOOP_ENGINES, WALConfig
from .device import BLANK_PROBE_BYTES, Device, aligned_buffer, classify
from .errors import (CapacityMismatchError, ChecksumMismatchError, FencedError, OverCapacityError,
                     RecordTooLargeError, WALClosedError, WALError, WALPathError)
from .loop_driver import LoopDriver
from .format import (ALIGN_DOWN, ALIGN_MASK, HEADER_AREA, HEADER_SLOT_SIZE, RECORD_HEADER_SIZE,
                     SHUTDOWN_CLEAN, SHUTDOWN_UNCLEAN, TAKEOVER_DONE, WALHeader, align_up,
                     body_crc, newest_header, pack_record_header)
from .recovery import scan

log = logging.getLogger(__name__)

# a record body: one buffer, or a tuple/list of buffers whose concatenation is the body
Body = Union[bytes, bytearray, memoryview, "tuple[Any, ...]", "list[Any]"]

WINDOW_SCALE_UNIT = 4 << 20


@dataclass(slots=True)
class AppendResult:
    """offset: logical offset of the record; next_offset: first offset after it."""

    offset: int
    next_offset: int
    future: "cf.Future | asyncio.Future | None"   # asyncio.Future from append_loop(); None
                                                   # from append_loop(then=...)


class DeltaWAL:
    """The durable write buffer in front of the object store (see docs/wal.md)."""

    def __init__(self, config: WALConfig) -> None:
        config.validate()
        self.config = config
        self.capacity = config.capacity
        self.ring_size = config.capacity - HEADER_AREA
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)          # appenders waiting for room
        self._io_cond = threading.Condition(self._lock)       # IO threads waiting for blocks
        self._spare_cond = threading.Condition(self._lock)    # threads beyond eager_writes
        self._header_lock = threading.Lock()
        self._resolve_lock = threading.Lock()
        self._resolver: int | None = None   # the thread draining completions (see below)
        self._completed: collections.deque = collections.deque()
        self._device: Device | None = None
        self._header: WALHeader | None = None
        self._opened = False
        self._closing = False
        self._closed = False
        self._failed: BaseException | None = None
        self._trim = 0
        self._end = 0                       # next logical offset to assign
        self._cursor = 0                    # aligned start for the next block
        self._current: Block | None = None
        self._pending: collections.deque[Block] = collections.deque()
        self._writing: list[Block] = []
        self._pending_bytes = 0             # aligned bytes of sealed blocks not yet taken
        self._backlog = config.max_write_bytes  # pending bytes that call the spare threads in
        self._writes = 0                    # group writes in flight
        self._timing = False                # an IO thread waits for the next time-based seal
        self._inflight = 0                  # bytes appended but not yet durable
        self._window_len = 0
        self._queues: dict[int, collections.deque] = {}
        self._window_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._buffer_limit = min(config.window_max, config.max_buffered_bytes)
        self._soft_limit = config.block_soft_limit
        self._block_class = align_up(config.block_soft_limit)
        self._pool = BufferPool(max_bytes=config.buffer_pool_bytes)
        self._next_seal_at = 0.0
        self._bw_next = 0.0
        self._bw_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._driver: LoopDriver | None = None   # set by attach_loop(): AIO on an event loop
        self._loop_ident = -1                    # ... and that loop's thread (get_ident())
        self._handover = False                   # IO threads exit: the loop driver takes over
        self.direct_io = True
        self.stats = {"writes": 0, "block_writes": 0, "bytes_written": 0, "header_writes": 0,
                      "placed_records": 0,   # written from their received buffer (placed.py)
                      "placed_summed": 0}    # ... whose check took the receive's sum

    # -- properties ------------------------------------------------------------------------
    @property
    def trim_offset(self) -> int:
        """Records below this logical offset are discarded."""
        return self._trim

    @property
    def end_offset(self) -> int:
        """Logical offset the next record would get (ignoring block/lap alignment)."""
        return self._end

    @property
    def confirmed_offset(self) -> int:
        """Every record below this logical offset is durable (safe upper bound for trim)."""
        with self._lock:
            starts = [b.start for b in self._writing] + [b.start for b in self._pending]
            if self._current is not None and self._current.used:
                starts.append(self._current.start)
            return min(starts) if starts else self._end

    def device_position(self, logical: int) -> int:
        """Where logical offset `logical` lives on the device (blocks never cross the end)."""
        return HEADER_AREA + logical % self.ring_size

    def _nothing_to_write(self) -> bool:
        """No sealed block waits and the current one is empty; caller holds the lock (or is
        LoopDriver.kick's early return, whose appenders on other threads kick after)."""
        return not self._pending and (self._current is None or not self._current.used)

    @property
    def window_length(self) -> int:
        """Current sliding window length recorded in the header."""
        return self._window_len

    # -- open / recover --------------------------------------------------------------------
    def open(self) -> Iterator[tuple[int, bytes]]:
        """Open (or format) the device and return the recovered (offset, body) records."""
        if self._opened:
            raise WALError("DeltaWAL.open() called twice")
        cfg = self.config
        dev = Device(cfg.path, cfg.capacity, cfg.sync_mode)
        self._device = dev
        self.direct_io = dev.direct
        try:
            probe = min(BLANK_PROBE_BYTES, cfg.capacity)
            slots = aligned_buffer(probe)
            dev.read_into(slots, 0)
            kind, hdr = classify(memoryview(slots)[:probe])
            slots.close()
            formatted = hdr is None
            if formatted:
                if kind == "foreign" and not dev.created:
                    if not cfg.allow_format:
                        raise WALPathError(
                            f"WAL {cfg.path} holds data that is not an s3kafka WAL; refusing "
                            "to overwrite it (pass --wal-format to erase and format it)")
                    log.warning("no valid WAL header on %s: formatting a new WAL (allowed "
                                "explicitly)", cfg.path)
                hdr = WALHeader(capacity=cfg.capacity, trim_offset=0,
                                window_max_length=cfg.window_initial)
            if hdr.capacity != cfg.capacity:
                raise CapacityMismatchError(
                    f"WAL on {cfg.path} was formatted with capacity {hdr.capacity}, "
                    f"configured {cfg.capacity}")
            reformat = False
            if hdr.fenced:
                reformat = self._may_reformat(hdr)
            if hdr.node_epoch > cfg.node_epoch:
                raise FencedError(
                    f"WAL on {cfg.path} belongs to node {hdr.node_id} epoch {hdr.node_epoch} "
                    f"> our epoch {cfg.node_epoch}")
            if reformat:
                # every old record lies below old trim + one lap: start a lap beyond, so the
                # scan rejects them all (their stored offsets differ from the position read)
                lap = (hdr.trim_offset // self.ring_size + 2) * self.ring_size
                log.warning("WAL %s was %s; formatting it afresh for node %d epoch %d (allowed "
                            "explicitly)", cfg.path, hdr.describe_takeover(), cfg.node_id,
                            cfg.node_epoch)
                hdr = WALHeader(capacity=cfg.capacity, trim_offset=lap,
                                window_max_length=cfg.window_initial,
                                write_counter=hdr.write_counter)
            # bound record length by the ring, not by today's max_record_size: a record written
            # under a larger setting must still be recovered
            result = scan(dev, self.ring_size, hdr.trim_offset, hdr.window_max_length,
                          self.ring_size)
            if formatted:
                log.info("WAL %s formatted: capacity %d MiB", cfg.path, cfg.capacity >> 20)
            elif hdr.shutdown_type != SHUTDOWN_CLEAN:
                log.info("WAL %s recovered %d records after unclean shutdown", cfg.path,
                         len(result.records))
            self._header = hdr
            self._trim = hdr.trim_offset
            self._cursor = max(result.end_offset, align_up(hdr.trim_offset))
            self._end = self._cursor
            # never shrink: holes left by the previous run may be that far apart
            self._window_len = max(cfg.window_initial, hdr.window_max_length)
            hdr.window_max_length = self._window_len
            hdr.shutdown_type = SHUTDOWN_UNCLEAN
            hdr.node_id = cfg.node_id
            hdr.node_epoch = cfg.node_epoch
            with self._header_lock:
                self._write_header(check=False)
        except BaseException:
            dev.close()
            raise
        sw = cfg.gil_switch_interval_s
        if sw is not None and sys.getswitchinterval() > sw:
            sys.setswitchinterval(sw)
        self._threads = [threading.Thread(target=self._io_loop, args=(i >= cfg.eager_writes,),
                                          name=f"wal-io-{i}", daemon=True)
                         for i in range(cfg.io_threads)]
        self._opened = True
        for t in self._threads:
            t.start()
        return iter(result.records)

    def _may_reformat(self, hdr: WALHeader) -> bool:
        """A WAL another node took over: True when it may be formatted afresh (takeover done,
        asked for explicitly, a newer epoch of its owner), else FencedError."""
        cfg = self.config
        if (hdr.takeover_state == TAKEOVER_DONE and cfg.reformat_taken_over
                and cfg.node_epoch > hdr.node_epoch):
            return True
        why = ("a takeover is still in progress" if hdr.takeover_state != TAKEOVER_DONE else
               f"re-register with an epoch above {hdr.node_epoch} and format it afresh"
               if cfg.node_epoch <= hdr.node_epoch or not cfg.reformat_taken_over else "")
        raise FencedError(f"WAL on {cfg.path} was {hdr.describe_takeover()}; refusing to "
                          f"write it ({why})")

    def _device_header(self) -> WALHeader | None:
        """The newest valid header on the device now (another node may have written it)."""
        assert self._device is not None
        buf = aligned_buffer(HEADER_AREA)
        try:
            self._device.read_into(buf, 0)
            return newest_header(memoryview(buf)[:HEADER_SLOT_SIZE],
                                 memoryview(buf)[HEADER_SLOT_SIZE:HEADER_AREA])
        finally:
            buf.close()

    def _check_fence(self) -> None:
        """Raise FencedError when the device's header says another node took this WAL over
        (or a newer epoch of this node owns it). Read before every header write after open
        (trim, window growth, close: never per append), so a zombie never overwrites a fence
        and stops at its next trim; caller holds _header_lock."""
        cur = self._device_header()
        ours = self._header
        assert ours is not None
        if cur is not None and (cur.fenced or cur.node_epoch > ours.node_epoch):
            raise FencedError(
                f"WAL on {self.config.path} was " + (cur.describe_takeover() if cur.fenced else
                f"claimed by node {cur.node_id} epoch {cur.node_epoch}")
                + f"; node {ours.node_id} epoch {ours.node_epoch} may no longer write it")

    def check_fenced(self) -> None:
        """Re-read the header; when another node took the WAL over, stop it (appends fail
        from now on) and raise FencedError. Cheap (an 8 KiB read): call it periodically."""
        with self._header_lock:
            try:
                self._check_fence()
            except FencedError as e:
                self._fail(e)
                raise

    def _write_header(self, check: bool = True) -> None:
        """Write the next header copy into the other slot; caller holds _header_lock. With
        ``check`` the device's header is read first and a fence raises FencedError."""
        hdr = self._header
        assert hdr is not None and self._device is not None
        if check:
            self._check_fence()
        hdr.write_counter += 1
        self.stats["header_writes"] += 1
        buf = aligned_buffer(HEADER_SLOT_SIZE)
        try:
            buf[:] = hdr.encode()
            self._device.write(buf, WALHeader.slot_position(hdr.write_counter))
        finally:
            buf.close()

    def attach_loop(self) -> bool:
        """Let the running event loop write this WAL through io_uring or native AIO
        (io_engine "uring" or "aio"): call it on the loop's thread after open(), as the engine
        does. The IO threads finish their writes and exit; from then on the loop seals,
        submits and completes. Returns False (threads keep writing) when io_engine is
        "threads", neither is available or O_DIRECT was refused."""
        loop = asyncio.get_running_loop()
        if self._driver is not None:
            return self._driver.loop is loop
        if not self._opened or self._closing or self._closed:
            raise WALClosedError("WAL is not open")
        if self.config.io_engine not in LOOP_ENGINES or not self.direct_io:
            return False
        try:
            driver = LoopDriver(self, loop)
        except OSError as e:
            log.warning("WAL: native AIO unavailable, IO threads write instead: %s", e)
            return False
        with self._cond:
            self._handover = True
            self._io_cond.notify_all()
            self._spare_cond.notify_all()
        for t in self._threads:              # idle threads leave at once, busy ones after
            t.join()                         # their write (well under a millisecond here)
        self._threads = []
        with self._cond:
            self._driver = driver
            self._loop_ident = threading.get_ident()    # the driver's thread: this one
        driver.kick()
        return True

    @property
    def writer(self) -> str:
        """What writes the blocks now: "io_uring" or "libaio" (the event loop, after
        attach_loop()) or "IO threads" (for the start-up log line)."""
        if self._driver is None:
            return "IO threads"
        return self._driver.aio.kind

    @property
    def fixed_writes(self) -> int:
        """Writes submitted as io_uring WRITE(V)_FIXED from registered frames (no per-write
        pinning of their pages); 0 with libaio or IO threads. An operator's check that the
        zero-pin path is taken (/metrics s3kafka_wal_fixed_writes_total)."""
        return getattr(self._driver.aio, "fixed_writes", 0) if self._driver is not None else 0

    @property
    def registered_frame_bytes(self) -> int:
        """Bytes of frame arena slabs the event loop's io_uring has registered (its writes
        from them skip the per-write pinning); 0 with libaio or IO threads."""
        driver = self._driver
        return getattr(driver.aio, "registered_bytes", 0) if driver is not None else 0

    def refresh_fixed_buffers(self) -> None:
        """Register new frame arena slabs with the event loop's io_uring from this thread
        (UringContext.refresh_fixed); a no-op before attach_loop(), with libaio or IO threads."""
        refresh = getattr(self._driver.aio, "refresh_fixed", None) \
            if self._driver is not None else None
        if refresh is not None:
            refresh()

    # -- append ----------------------------------------------------------------------------
    def append(self, body: Body, stream_id: int = 0) -> AppendResult:
        """Buffer one record; the future completes (with the offset) once it and every earlier
        record of stream_id are durable. In a plain thread it blocks while max_buffered_bytes
        are not yet durable; on an event loop thread it never blocks. `body` is one buffer or
        a tuple of buffers whose concatenation is the record (copied once, into the block)."""
        body, n, crc = _prepare(body)
        fut: cf.Future = cf.Future()
        size = RECORD_HEADER_SIZE + n
        deadline = None
        # never block an event loop thread: there the buffered-bytes bound is not enforced
        # (append_async enforces it by awaiting); the ring capacity still bounds everything
        on_loop = asyncio._get_running_loop() is not None
        with self._cond:
            while not on_loop and not self.has_room(size):
                if deadline is None:
                    deadline = time.monotonic() + self.config.append_timeout_s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WALError("append timed out waiting for the sliding window")
                self._cond.wait(left)
            offset = self._reserve(body, n, stream_id, fut, crc)
        if self._driver is not None:
            self._driver.kick_soon()
        return AppendResult(offset, offset + size, fut)

    def append_loop(self, body: Body, stream_id: int = 0,
                    check: tuple[int, int] | None = None,
                    then: "Callable[[int, BaseException | None], None] | None" = None,
                    flat: bool = False) -> AppendResult:
        """append() for code on a running event loop: the result's future is an asyncio.Future
        of that loop, completed in batches (one cross-thread wake-up per drained batch rather than
        one per record, and no concurrent.futures.Future to build). Never blocks; the caller
        bounds what it buffers (the ring capacity still bounds everything).

        ``check`` = (start, crc): the body's bytes from ``start`` to its end must have that
        CRC-32C, or ChecksumMismatchError is raised and nothing is appended. It is computed in
        the same pass that copies the body into its block (a produce batch's own CRC, which
        the broker would otherwise compute in a pass of its own).

        ``then``: instead of a future (the result's ``future`` is None), ``then(offset, None)``
        is called on this loop once the record and every earlier one of ``stream_id`` are
        durable, or ``then(offset, error)`` when its write failed - in the same order a future
        would complete, with the other records completed by the same write, and in the call
        that completes the write when the loop's own AIO did it (no future, no done-callback,
        no loop iteration per record). It must not raise (an exception is logged) nor complete
        WAL writes itself; it runs in the loop's completion path, so it should be short.

        ``flat``: ``body`` is a (bytes, bytes or flat byte view) pair - the engine's record
        header and payload - which ``_prepare`` would pass through unchanged when the copy
        computes the CRC (storage._copycrc): its call is skipped (the engine's every append)."""
        if flat and COPY_CRC_NATIVE:
            n, crc = len(body[0]) + len(body[1]), None
        else:
            body, n, crc = _prepare(body)
        if check is not None and crc is not None:     # no fused copy: a pass of its own
            _verify(body, check)
            check = None
        driver = self._driver
        # on the driver's thread its loop is the running one; get_running_loop() costs a
        # getpid() syscall per call
        on_loop = driver is not None and threading.get_ident() == self._loop_ident
        loop = driver.loop if on_loop else asyncio.get_running_loop()
        fut = loop.create_future() if then is None else None
        offset = self._append_on_loop(body, n, stream_id, (loop, fut if then is None else then),
                                      crc, check, on_loop)
        return AppendResult(offset, offset + RECORD_HEADER_SIZE + n, fut)

    def append_flat(self, head: bytes, payload: "bytes | memoryview", stream_id: int,
                    check: tuple[int, int] | None,
                    then: "Callable[[int, BaseException | None], None]") -> int:
        """``append_loop((head, payload), stream_id, check, then, flat=True).offset`` (the
        record ends RECORD_HEADER_SIZE + len(head) + len(payload) bytes later) in one call
        without the AppendResult: the engine's task-less append, once per Produce request."""
        driver = self._driver
        if not COPY_CRC_NATIVE or driver is None or threading.get_ident() != self._loop_ident:
            return self.append_loop((head, payload), stream_id, check, then, True).offset
        return self._append_on_loop((head, payload), len(head) + len(payload), stream_id,
                                    (driver.loop, then), None, check, True)

    def _append_on_loop(self, body, n: int, stream_id: int, waiter: tuple, crc: int | None,
                        check: tuple[int, int] | None, on_loop: bool) -> int:
        """append_loop's placing of a prepared body (received in place when it was offered,
        placed.py; else copied into the current block) and the kick of its write; its offset."""
        taken = None
        if placed._offered and crc is None and type(body) is tuple and len(body) == 2:
            taken = placed.take(body[1], RECORD_HEADER_SIZE + len(body[0]))
        with self._lock:
            offset = None if taken is None else self._reserve_placed(
                taken, body, n, stream_id, waiter, check)
            if offset is None:
                offset = self._reserve(body, n, stream_id, waiter, crc, check)
        driver = self._driver
        if driver is not None:
            if self._pending and on_loop:
                # a block sealed by size (or placed): write it now, if a write may start.
                # Else kick() would do nothing - with blocks pending it seals none - and the
                # completion that frees a slot starts it
                if driver._may_start(self):
                    driver.kick()
            else:
                driver.kick_soon()
        return offset

    async def append_async(self, body: Body, stream_id: int = 0) -> int:
        """append() for the event loop: waits for window room and durability without blocking."""
        await self.wait_for_room(RECORD_HEADER_SIZE + _length(body))
        return await self.append_loop(body, stream_id).future

    def has_room(self, size: int) -> bool:
        """True when a record of `size` bytes (header included) fits under max_buffered_bytes:
        buffered, not yet durable bytes are bounded - more does not speed up the device, it
        only adds latency and memory (and fresh buffers cost page faults)."""
        return self._inflight == 0 or self._inflight + size <= self._buffer_limit

    async def wait_for_room(self, size: int) -> None:
        """Wait (without blocking the loop) until fewer than max_buffered_bytes are waiting to
        be durable, so an event-loop appender can bound its memory like a blocking append()."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._failed is not None or self.has_room(size):
                    return
                room = loop.create_future()
                self._window_waiters.append((loop, room))
            await room

    def _reserve(self, body, n: int, stream_id: int, waiter, crc: int | None,
                 check: tuple[int, int] | None = None) -> int:
        """Place the record in the current block; caller holds the lock. The hot path of every
        append: attribute lookups and calls are kept to a minimum (CPython cost is per record)."""
        if self._failed is not None:
            if isinstance(self._failed, FencedError):
                raise FencedError(str(self._failed))
            raise WALClosedError(f"WAL stopped after an IO error: {self._failed}")
        if not self._opened or self._closing:
            raise WALClosedError("WAL is not open")
        size = RECORD_HEADER_SIZE + n
        ring = self.ring_size
        if n > self.config.max_record_size or (size + ALIGN_MASK) & ALIGN_DOWN > ring:
            raise RecordTooLargeError(f"record of {n} bytes exceeds the WAL limits")
        blk = self._current
        if blk is not None and blk.used + size > len(blk.buf):    # blk.capacity, no call
            if blk.used:
                self._seal_locked()
            else:                                   # empty leftover block, buffer too small
                self._pool.put(blk.buf)
                self._current = None
            blk = None
        if blk is None:
            blk = self._new_block(size)
        at = blk.used
        pos = blk.start + at
        in_lap = pos % ring
        # does not fit before the ring's end, or the block's records end exactly at it: then
        # pos is the next lap's start (in_lap 0) but this block began in the previous lap, and
        # one write from the block's start would run past the ring's end instead of wrapping
        jump = in_lap + size > ring or (at and not in_lap)
        if jump and in_lap:
            pos += ring - in_lap
        # the block is written in whole 4 KiB pages: its zero padding must not reach the page
        # holding the (unaligned) trim offset one lap later
        end = pos + size
        if ((end + ALIGN_MASK) & ALIGN_DOWN) - self._trim > ring:
            # before the block moves to the next lap: an empty block left there would take
            # every later record too, each then needing the trim past that lap's start plus
            # its size (session 21: beyond the last record's end, no append ever again)
            raise self._ring_full(end)
        if jump:
            if at:
                self._seal_locked()
                blk = self._new_block(size, start=pos)
            else:
                blk.start = pos
            at = 0
        buf = blk.buf
        if check is not None:   # copy, checksum and check in one pass; nothing taken yet
            try:
                crc = _copy_checked(buf, at + RECORD_HEADER_SIZE, body, check)
            except ChecksumMismatchError:
                if not blk.used:            # not left at the next lap's start (see above)
                    blk.start = blk.scan_from
                raise
            pack_record_header(buf, at, n, pos, crc)
        elif crc is None:       # storage._copycrc: copy and checksum the body in one pass
            if type(body) is not tuple:
                copy_record(buf, at, pos, b"", body)     # the record header too, one call
            elif len(body) == 2:                         # the engine's (header, payload)
                copy_record(buf, at, pos, body[0], body[1])
            else:
                o = at + RECORD_HEADER_SIZE
                crc = 0
                for part in body:
                    crc = copy_crc(buf, o, part, crc)
                    o += len(part)
                pack_record_header(buf, at, n, pos, crc)
        else:
            pack_record_header(buf, at, n, pos, crc)
            if type(body) is tuple:
                o = at + RECORD_HEADER_SIZE
                for part in body:
                    k = len(part)
                    buf[o:o + k] = part
                    o += k
            else:
                buf[at + RECORD_HEADER_SIZE:at + size] = body
        blk.used = used = at + size
        self._track(blk, pos, size, end, stream_id, waiter)
        if self._driver is not None:             # the loop writes (no IO threads to wake)
            if used >= self._soft_limit:
                self._seal_locked()
        elif used >= self._soft_limit:
            self._seal_locked()
            if self._may_start_write(False):
                self._io_cond.notify()
        elif not at and not self._timing:
            self._io_cond.notify()               # someone must seal this block by time
        return pos

    def _ring_full(self, end: int) -> OverCapacityError:
        """The error of a record whose last page (ending at ``end``) would reach the page
        holding the trim offset one lap later: _reserve's and _reserve_placed's one test."""
        return OverCapacityError(
            f"WAL ring full: {((end + ALIGN_MASK) & ALIGN_DOWN) - self._trim} bytes from the "
            f"trim to this record's last page > {self.ring_size}; upload and trim first")

    def _track(self, blk: Block, pos: int, size: int, end: int, stream_id: int, waiter) -> None:
        """Count a record placed in ``blk`` at ``pos`` (``size`` bytes, ending at ``end``)
        and queue its waiter behind its stream's earlier records; caller holds the lock."""
        blk.records += 1
        blk.streams.add(stream_id)
        self._inflight += size
        self._end = end
        q = self._queues.get(stream_id)
        if q is None:
            q = self._queues[stream_id] = collections.deque()
        q.append((blk, pos, waiter))

    def _reserve_placed(self, taken: tuple[memoryview, int, int], body: tuple, n: int,
                        stream_id: int, waiter, check: tuple[int, int] | None) -> int | None:
        """_reserve for a record whose payload (body[1]) was received in place (placed.py):
        ``taken`` is placed.take's region - the payload's own buffer from
        ``RECORD_HEADER_SIZE + len(body[0])`` bytes before it to the end of its last page -
        and the sum the receive took of the payload. The current block is sealed, the headers
        are written into the region's first bytes, its tail zeroed, and the region becomes a
        block of its own, sealed at once (written from that buffer, never pooled). One CRC
        pass over the payload (or over its bytes before the receive's sum, when that sum is
        the ``check``'s) gives the record's CRC and the ``check``. None (nothing done but
        sealing the current block) where the copy path must place it: the record would cross
        the ring's end (the copy path jumps), the cursor is not on a page, no fused check."""
        region, summed_from, summed = taken
        if self._failed is not None or not self._opened or self._closing:
            return None                              # _reserve raises the right error
        head = body[0]
        h = len(head)
        size = RECORD_HEADER_SIZE + n
        ring = self.ring_size
        if (n > self.config.max_record_size or len(region) != (size + ALIGN_MASK) & ALIGN_DOWN
                or len(region) > ring or (check is not None and check[0] < h)):
            return None
        blk = self._current
        if blk is not None:
            if blk.used:
                self._seal_locked()
            else:                                    # an empty block: back to the pool
                self._pool.put(blk.buf)
                self._current = None
        pos = self._cursor
        if pos & ALIGN_MASK or pos % ring + size > ring:
            return None
        end = pos + size
        if ((end + ALIGN_MASK) & ALIGN_DOWN) - self._trim > ring:       # as in _reserve
            raise self._ring_full(end)
        split, want = (-1, 0) if check is None else (check[0] - h, check[1])
        tail = place_record(region, head, body[1], pos, split, want, summed_from, summed)
        if tail is not None:
            raise ChecksumMismatchError(
                f"CRC-32C of the record's bytes from {check[0]} is {tail:#010x}, "
                f"expected {want:#010x}")
        blk = Block(pos, pos, region, pooled=False)
        self.stats["placed_records"] += 1
        if summed == want and summed_from == split >= 0:
            self.stats["placed_summed"] += 1
        blk.used = size
        blk.sealed = True                            # place_record zeroed its last page's tail
        self._track(blk, pos, size, end, stream_id, waiter)
        self._queue_sealed(blk)
        if self._driver is None and self._may_start_write(False):
            self._io_cond.notify()
        return pos

    def _new_block(self, size: int, start: int | None = None) -> Block:
        scan_from = self._cursor
        begin = self._cursor if start is None else start
        buf = self._pool.get(align_up(size), self._block_class)
        blk = Block(begin, scan_from, buf)
        self._current = blk
        return blk

    def _seal_locked(self) -> None:
        blk = self._current
        if blk is None or not blk.used:
            return
        blk.seal()
        self._queue_sealed(blk)

    def _queue_sealed(self, blk: Block) -> None:
        """Queue the sealed current block ``blk`` for its write; caller holds the lock."""
        self._current = None
        self._cursor = end = blk.start + ((blk.used + ALIGN_MASK) & ALIGN_DOWN)   # blk.end
        self._pending.append(blk)
        self._pending_bytes += end - blk.start
        if self._pending_bytes >= self._backlog and self._writes >= self.config.eager_writes \
                and self._spare_cond._waiters:
            self._spare_cond.notify()             # the eager writers fall behind: help

    # -- IO threads ----------------------------------------------------------------------
    def _io_loop(self, spare: bool) -> None:
        """Thread body: any unexpected error stops the WAL (fails waiters) instead of leaving
        appenders waiting forever on a dead thread."""
        try:
            self._io_loop_inner(spare)
        except BaseException as e:           # noqa: BLE001 - must never die silently
            log.exception("WAL IO thread failed")
            self._fail(e)

    def _io_loop_inner(self, spare: bool) -> None:
        """Each IO thread takes the next block (sealing the current one when the IOPS budget
        allows and nothing else is queued), writes it and completes it; no hand-off thread.

        The first eager_writes threads do this whenever a block is sealed; the spare ones
        sleep on their own condition and write only while sealed blocks back up to a full
        merged write. Every thread woken costs the event loop a GIL hand-off: with all four
        threads eager, 64 KiB records at half speed had p50 1.22-1.45 ms and p99 3.5-17 ms,
        with two eager and two spare 0.58-0.69 and 2.0-2.3 ms; full speed needs all four."""
        interval = self.config.flush_interval_s
        cond = self._spare_cond if spare else self._io_cond
        while True:
            with cond:
                while True:
                    if self._failed is not None or self._handover:
                        return
                    now = time.monotonic()
                    cur = self._current
                    if (not spare and cur is not None and cur.used and not self._pending
                            and (now >= self._next_seal_at or self._closing)):
                        self._seal_locked()
                        self._next_seal_at = now + interval
                    if (self._pending and self._may_start_write(spare)
                            and self._window_allows(self._pending[0])):
                        group = self._take_group()
                        cur = self._current
                        if self._pending_bytes >= self._backlog:
                            self._spare_cond.notify()
                        if ((self._pending and self._may_start_write(False))
                                or (cur is not None and cur.used and not self._timing)):
                            self._io_cond.notify()   # more work: wake another IO thread
                        break
                    if self._closing and self._nothing_to_write():
                        self._io_cond.notify_all()
                        self._spare_cond.notify_all()
                        return
                    if (not spare and cur is not None and cur.used and not self._pending
                            and not self._timing):
                        # one thread times the seal; the idle rest sleep until notified
                        # (each wake-up takes the GIL from the loop)
                        timeout = self._next_seal_at - now
                        if timeout <= 0:
                            continue
                        self._timing = True
                        try:
                            cond.wait(timeout)
                        finally:
                            self._timing = False
                    else:
                        cond.wait()
            self._write_group(group)

    def _may_start_write(self, spare: bool) -> bool:
        """Up to eager_writes writes start at once; more only while sealed blocks back up to
        one full merged write (or on close). Caller holds the lock."""
        return ((not spare and self._writes < self.config.eager_writes)
                or self._pending_bytes >= self._backlog or self._closing)

    def _take_group(self) -> list[Block]:
        """Pop the first pending block plus the ones physically right behind it (up to
        max_write_bytes, or backlog_write_bytes under a deep backlog): one pwritev for several
        blocks halves the GIL round trips per byte and gives the device larger writes when
        appenders outpace it. Caller holds the lock."""
        first = self._pending.popleft()
        self._writing.append(first)
        self._writes += 1
        group = [first]
        total = (first.used + ALIGN_MASK) & ALIGN_DOWN
        cfg = self.config
        limit = cfg.backlog_write_bytes if self._pending_bytes >= 2 * cfg.backlog_write_bytes \
            else cfg.max_write_bytes
        ring = self.ring_size
        while self._pending and len(group) < 64:
            nxt = self._pending[0]
            last = group[-1]
            n = (nxt.used + ALIGN_MASK) & ALIGN_DOWN
            if (nxt.start != last.end or nxt.start // ring != first.start // ring
                    or total + n > limit or not self._window_allows(nxt)):
                break
            self._pending.popleft()
            self._writing.append(nxt)
            group.append(nxt)
            total += n
        self._pending_bytes -= total
        return group

    def _window_allows(self, blk: Block) -> bool:
        """Every block lies within window_len of the oldest unfinished write (or of the gap
        before it), so recovery can cross holes by scanning window_len past an invalid one.
        Grows the window (header flushed before the write) up to window_max."""
        # _writing is in take order, which is logical order (sealed blocks are taken in
        # order): its first block's scan_from is the smallest
        writing = self._writing
        start = blk.scan_from if not writing or writing[0].scan_from > blk.scan_from \
            else writing[0].scan_from
        need = blk.start + ((blk.used + ALIGN_MASK) & ALIGN_DOWN) - start     # blk.end - start
        if need <= self._window_len:
            return True
        if self._writing and need > self.config.window_max:
            return False
        new_len = min(max(need, self._window_len + WINDOW_SCALE_UNIT),
                      max(self.config.window_max, need))
        with self._header_lock:
            assert self._header is not None
            try:
                self._check_fence()
            except FencedError as e:      # a zombie: write nothing more; fail off the lock
                if self._failed is None:
                    self._failed = e
                    threading.Thread(target=self._fail, args=(e,), daemon=True).start()
                return False
            self._header.window_max_length = new_len
            self._write_header(check=False)
        self._window_len = new_len
        return True

    def _throttle(self, n: int) -> None:
        limit = self.config.bandwidth_limit
        if not limit:
            return
        with self._bw_lock:
            now = time.monotonic()
            start = max(now, self._bw_next)
            self._bw_next = start + n / limit
        if start > now:
            time.sleep(start - now)

    def _write_group(self, group: list[Block]) -> None:
        assert self._device is not None
        first = group[0]
        phys = self.device_position(first.start)
        views = [memoryview(b.buf)[:align_up(b.used)] for b in group]
        n = sum(len(v) for v in views)
        err: BaseException | None = None
        try:
            for attempt in range(IO_RETRIES):
                try:
                    self._throttle(n)
                    self._device.writev(views, phys)
                    err = None
                    break
                except OSError as e:
                    err = e
                    log.warning("WAL write at %d failed (attempt %d): %s", phys, attempt + 1, e)
                    time.sleep(IO_RETRY_DELAY_S)
        finally:
            for v in views:
                v.release()
        if err is not None:
            self._fail(err)
            return
        self._complete(group)

    def _release_writes(self, n: int) -> None:
        """Free the queue slots of n finished writes ahead of their _complete(released=True),
        so a caller completing many groups at once can start the next writes first."""
        with self._lock:
            self._writes -= n

    def _complete(self, group: list[Block], released: bool = False) -> None:
        """Mark a written group durable and pop, per stream, every record whose predecessors
        are all durable; one lock acquisition per group. ``released``: its queue slot was
        already freed by _release_writes()."""
        self._complete_groups((group,), released)

    def _complete_groups(self, groups: "list[list[Block]] | tuple[list[Block], ...]",
                         released: bool = False) -> None:
        """_complete for several written groups at once (the loop driver's writes reaped
        together): one lock acquisition, one pass over the streams' queues and one drain of
        their waiters for all of them, instead of one each per write. Each stream's records
        still complete in order (its queue is popped in order)."""
        with self._lock:                 # the conditions' lock (a C context manager)
            stats = self.stats
            stats["writes"] += len(groups)
            if not released:
                self._writes -= len(groups)
            done = self._completed
            streams: set[int] = set()
            written = 0
            nblocks = 0
            writing = self._writing
            for group in groups:
                nblocks += len(group)
                for blk in group:
                    blk.done = True
                    written += (blk.used + ALIGN_MASK) & ALIGN_DOWN
                    writing.remove(blk)
                    self._inflight -= blk.used
                    streams |= blk.streams
            stats["block_writes"] += nblocks
            stats["bytes_written"] += written
            queues = self._queues
            for sid in streams:
                q = queues.get(sid)
                if q is None:
                    continue
                popleft = q.popleft
                append = done.append
                while q and q[0][0].done:
                    _b, offset, waiter = popleft()
                    append((offset, waiter, None))
                if not q:
                    del queues[sid]
            for group in groups:
                for blk in group:
                    if blk.pooled:
                        self._pool.put(blk.buf)
                    blk.buf = None  # type: ignore[assignment]
            waiters = self._window_waiters
            if waiters:                  # else no new list per write
                self._window_waiters = []
            else:
                waiters = ()
            # only when a thread waits (_waiters: checked under the lock, which a waiter holds
            # when it registers): Condition.notify's own checks are a Python call and a lock
            # probe per call, per completed write of the loop's AIO, where nobody waits
            if self._cond._waiters:
                self._cond.notify_all()
            if self._pending and self._io_cond._waiters:
                self._io_cond.notify()
        self._drain_completed()
        for loop, fut in waiters:
            self._call_soon(loop, _set_many, [(fut, None, None)])

    def _fail(self, err: BaseException) -> None:
        log.error("WAL IO failed permanently, refusing further appends: %s", err)
        exc = WALError(f"WAL write failed: {err}")
        with self._cond:
            if self._failed is None:
                self._failed = err
            for q in self._queues.values():
                self._completed.extend((off, waiter, exc) for _b, off, waiter in q)
            self._queues.clear()
            waiters = self._window_waiters
            self._window_waiters = []
            self._cond.notify_all()
            self._io_cond.notify_all()
            self._spare_cond.notify_all()
        self._drain_completed()
        for loop, fut in waiters:
            self._call_soon(loop, _set_many, [(fut, None, None)])

    def _drain_completed(self) -> None:
        """Complete waiters outside the main lock, in the order they were popped (so callers
        see acknowledgements of one stream in order even when IO threads race); one loop
        wake-up per event loop per batch."""
        me = threading.get_ident()
        if self._resolver == me:
            return      # called from a completion callback: the drain below takes these too
        with self._resolve_lock:
            self._resolver = me
            try:
                self._drain_locked(me)
            finally:
                self._resolver = None

    def _drain_locked(self, me: int) -> None:
        """_drain_completed's work on thread ``me``; caller holds _resolve_lock. The waiters of the loop that
        runs this (its own AIO completions) are completed in one _set_many call, in order,
        with no per-loop grouping; other loops get theirs through _call_soon."""
        q = self._completed
        driver = self._driver
        here = driver.loop if driver is not None and me == self._loop_ident else None
        while q:
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            mine: list = []
            items = None
            last_loop = None
            popleft = q.popleft
            while q:
                offset, waiter, exc = popleft()
                if type(waiter) is tuple:
                    loop = waiter[0]
                    if loop is here:
                        mine.append((waiter[1], offset, exc))
                        continue
                    if loop is not last_loop:
                        items = by_loop.get(loop)
                        if items is None:
                            items = by_loop[loop] = []
                        last_loop = loop
                    items.append((waiter[1], offset, exc))
                elif not waiter.done():
                    try:
                        if exc is None:
                            waiter.set_result(offset)
                        else:
                            waiter.set_exception(exc)
                    except cf.InvalidStateError:
                        pass
            if mine:
                _set_many(mine)
            for loop, batch in by_loop.items():
                self._call_soon(loop, _set_many, batch)

    def _call_soon(self, loop: asyncio.AbstractEventLoop, fn, arg) -> None:
        driver = self._driver
        # on that loop already (AIO completions): no wake-up. The driver knows its thread;
        # asyncio._get_running_loop() costs a getpid() syscall per call (CPython 3.11)
        if (driver is not None and driver.loop is loop
                and threading.get_ident() == self._loop_ident) \
                or asyncio._get_running_loop() is loop:
            fn(arg)
            return
        try:
            loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            pass                      # loop closed: nobody is waiting any more

    # -- trim / close ----------------------------------------------------------------------
    def trim(self, offset: int) -> None:
        """Discard records below offset; the header is durable before the space is reused."""
        with self._lock:
            if not self._opened or self._closed:
                raise WALClosedError("WAL is not open")
            if offset <= self._trim:
                return
            if offset > self._end:
                raise ValueError(f"trim offset {offset} beyond end offset {self._end}")
        with self._header_lock:
            assert self._header is not None
            if offset > self._header.trim_offset:
                try:
                    self._check_fence()
                except FencedError as e:
                    self._fail(e)
                    raise
                self._header.trim_offset = offset
                self._write_header(check=False)
        with self._lock:
            self._trim = max(self._trim, offset)

    def flush(self) -> None:
        """Seal the current block now (tests, shutdown); does not wait."""
        with self._cond:
            self._seal_locked()
            self._io_cond.notify()
        if self._driver is not None:
            self._driver.kick_soon()

    def close(self) -> None:
        """Wait for in-flight writes, then write a clean-shutdown header."""
        with self._cond:
            if self._closed:
                return
            if not self._opened:
                self._closed = True
                return
            self._closing = True
            self._seal_locked()
            self._io_cond.notify_all()
            self._spare_cond.notify_all()
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        if self._driver is not None:
            self._close_driver(self._driver)
        with self._cond:
            self._closed = True
        try:
            if self._failed is None:
                with self._header_lock:
                    assert self._header is not None
                    try:
                        self._check_fence()
                    except FencedError as e:   # taken over: leave its header alone
                        log.warning("WAL close: %s", e)
                    else:
                        self._header.shutdown_type = SHUTDOWN_CLEAN
                        self._write_header(check=False)
        finally:
            with self._cond:
                self._pool.close()
            assert self._device is not None
            self._device.close()

    def _close_driver(self, driver: LoopDriver) -> None:
        """Finish every write before the clean-shutdown header: the loop does it while it
        runs on another thread; otherwise (closing on the loop itself, or the loop stopped)
        this thread submits and reaps until nothing is left."""
        deadline = time.monotonic() + max(30.0, self.config.append_timeout_s)
        try:
            if not driver.on_loop() and driver.loop.is_running():
                driver.kick_soon()
                with self._cond:
                    while self._failed is None and (self._writing
                                                    or not self._nothing_to_write()):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(min(left, 0.05))
                        driver.kick_soon()
            driver.detach_from_thread()
            driver.drain_sync(deadline)
        finally:
            driver.close()

    def __enter__(self) -> "DeltaWAL":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prepare(body) -> tuple:
    """(body, length, crc): flat byte views, parts kept as a tuple, CRC-32C computed here, on
    the appender's thread outside the WAL lock (crc32c drops the GIL for bytes). With the
    compiled storage._copycrc the CRC is None: _reserve computes it while it copies the body
    into the block (one pass over the bytes instead of two)."""
    if COPY_CRC_NATIVE:
        if type(body) is bytes:
            return body, len(body), None
        if type(body) is tuple and len(body) == 2:    # (header, payload): the engine's
            a, b = body
            if type(a) is not bytes:
                a = as_bytes_view(a)
            if type(b) is not bytes and (type(b) is not memoryview or b.ndim != 1
                                         or b.format != "B"):     # the engine's is flat
                b = as_bytes_view(b)
            return body if a is body[0] and b is body[1] else (a, b), len(a) + len(b), None
        if isinstance(body, (tuple, list)):
            parts = tuple(p if type(p) is bytes else as_bytes_view(p) for p in body)
            return parts, sum(len(p) for p in parts), None
        body = as_bytes_view(body)
        return body, len(body), None
    if type(body) is bytes:
        return body, len(body), body_crc(body)
    if isinstance(body, (tuple, list)):
        parts = tuple(p if type(p) is bytes else as_bytes_view(p) for p in body)
        crc = 0
        for p in parts:
            crc = crc32c.crc32c(p, crc)
        return parts, sum(len(p) for p in parts), crc
    body = as_bytes_view(body)
    return body, len(body), body_crc(body)


def _copy_checked(buf, o: int, body, check: tuple[int, int]) -> int:
    """Copy the body's parts into ``buf`` at ``o``; its CRC-32C. Raises ChecksumMismatchError
    when the bytes from ``check[0]`` to the end do not have the CRC ``check[1]``: the caller
    (_reserve) has then modified nothing but bytes past the block's used end."""
    start, want = check
    parts = body if type(body) is tuple else (body,)
    crc = 0
    seen = 0           # body bytes before this part
    tail = 0           # CRC of the checked range so far
    for part in parts:
        k = len(part)
        if seen + k <= start:
            crc = copy_crc(buf, o, part, crc)
        elif seen >= start:
            tail = crc32c.crc32c(part, tail)   # only in bodies checked across several parts
            crc = copy_crc(buf, o, part, crc)
        else:
            crc, tail = copy_crc_split(buf, o, part, crc, start - seen)
        o += k
        seen += k
    if tail != want or start > seen:
        raise ChecksumMismatchError(
            f"CRC-32C of the record's bytes from {start} is {tail:#010x}, expected {want:#010x}")
    return crc


def _verify(body, check: tuple[int, int]) -> None:
    """The check of _copy_checked as a pass of its own (the copy computes no CRC)."""
    start, want = check
    parts = body if type(body) is tuple else (body,)
    tail, seen = 0, 0
    for part in parts:
        k = len(part)
        if seen + k > start:
            tail = crc32c.crc32c(memoryview(part)[max(start - seen, 0):], tail)
        seen += k
    if tail != want or start > seen:
        raise ChecksumMismatchError(
            f"CRC-32C of the record's bytes from {start} is {tail:#010x}, expected {want:#010x}")


def _length(body) -> int:
    """Body length in bytes, without checksumming it."""
    if type(body) is bytes:
        return len(body)
    if isinstance(body, (tuple, list)):
        return sum(len(p) if type(p) is bytes else len(as_bytes_view(p)) for p in body)
    return len(as_bytes_view(body))


def as_bytes_view(body) -> memoryview:
    """A flat byte view, so len() counts bytes even for typed or multi-dimensional buffers."""
    view = memoryview(body)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _set_many(items: list) -> None:
    """Runs on the waiters' loop: resolve a batch of asyncio futures, and call the callbacks
    of append_loop(then=...) (callable; a future is not), in order."""
    for fut, value, exc in items:
        if callable(fut):
            try:
                fut(value, exc)
            except Exception:  # noqa: BLE001 - the records after it are still completed
                log.exception("WAL completion callback failed")
        elif exc is None:
            if not fut.done():
                fut.set_result(value)
        elif not fut.done():
            fut.set_exception(exc)
