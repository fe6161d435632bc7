"""The broker process: state (config, metadata, storage, topics, groups) and the TCP listener.

Per connection, frames are split as bytes arrive; each request runs as its own task (so a
long-polling Fetch does not hold up a Heartbeat behind it), but responses are written strictly
in request order, as Kafka clients pipeline and match responses by order. Responses that become
ready in the same loop iteration go out in one ``writelines`` call.

Consecutive requests of one read that a handler module can take together (``RUN_HANDLERS``:
small Produce requests for one partition, which a linger-0 client pipelines faster than they
are answered) start as one task through that module's run handler, which answers each: the
cost per request then falls as a backlog builds instead of the backlog growing.

Every request frame handed to the parser is an owned ``bytearray`` that nothing else reuses:
handlers may write into it (Produce assigns offsets in the batch headers in place). Large
frames are received straight into their own buffer (no copy out of the read buffer at all);
small ones are copied out of the shared read buffer once.
"""
from __future__ import annotations

import asyncio
import collections
import faulthandler
import logging
import os
import signal
import struct
import sys
import time
from typing import Any

import protocol
from protocol import (MalformedRequestError, UnknownApiError, UnsupportedVersionError,
                      api_name, parse_request)

from storage import sqldb
from storage.copycrc import crc as crc32c
from storage.engine import WAL_RECORD
from storage.wal import placed
from storage.wal.format import RECORD_HEADER_SIZE
from storage.waits import wait_event

from .config import BrokerConfig
from .failures import failure_answer, log_failure
from .frames import NEED_MORE, PRETOUCH_YIELD_RATE, FramePool, RateWatch, produce_records_at
from .gc_tuning import FULL_PASS_S, SurvivorFreezer
from .loop_watch import LoopWatch
from .handlers import HANDLERS
from .handlers.registry import NOW_HANDLERS, RUN_HANDLERS, Framed, RequestContext
from .metrics import RequestStats, start_metrics, timed
from .sender import OFFLOAD_MIN, byte_views, send_some, sender_pool
from .metastore import MetadataStore, open_metadata_store
from .cluster import ClusterError, ClusterRoom
from .topics import Topic, TopicManager

log = logging.getLogger(__name__)

_SIZE = struct.Struct(">i")
_CLOSE = object()          # marker in the response queue: close the connection here
WRITE_HIGH_WATER = 8 << 20
# responses are handed to the transport at most this many bytes per loop turn: the transport's
# first write copies into the socket with the GIL held and the loop busy (measured on loopback:
# 256 KiB 0.03-0.2 ms, 4 MiB 0.5-2.3 ms), so one catch-up consumer's multi-MiB Fetch answer
# would hold every hot request and every WAL completion for milliseconds. Only while producers
# append (Broker.hot_traffic): with nothing to protect, an answer goes to the transport whole -
# 8 MiB hot Fetch answers in 256 KiB slices cost 0.38-0.42 ms of broker CPU per MiB, whole
# 0.24-0.25 (one writev, libuv writes the rest as the socket drains; bench/HISTORY.md session 14)
WRITE_SLICE = 256 << 10
INITIAL_BUFFER = 64 << 10
# a drained read buffer up to this size is kept: 1 MiB produce requests would otherwise regrow
# it from 64 KiB (5 doublings, each copying) on every request
KEEP_BUFFER = 2 << 20
# frames from this size on are received straight into a buffer of their own (zero copy)...
DIRECT_FRAME = 64 << 10
# ...allocated at once up to this size; larger declared frames grow the read buffer step by
# step, so a client announcing a huge frame and sending nothing pins little memory
DIRECT_FRAME_MAX = 16 << 20
# after a large frame the next read is only this long: the next frame's size and request
# header (up to where its records begin, for placed.place) go through the read buffer, the
# rest is read into its frame. A whole INITIAL_BUFFER read copied the next frame's first
# 64 KiB twice (socket -> read buffer -> frame: 6 % of a 1 MiB frame). It costs no extra
# read: libuv reads again at once after a read that filled what it was offered.
HEAD_READ = 1 << 10
# a large Produce frame whose records' place is not in its first bytes yet is read on into the
# read buffer (placed, not copied by the WAL) while it has fewer than this many bytes there
PLACE_WITHIN = INITIAL_BUFFER // 2
# a large Produce frame of one partition is received so that its records sit where the WAL
# writes them (storage/wal/placed.py): the WAL's and the engine's record headers before them
PLACED_HEAD = RECORD_HEADER_SIZE + WAL_RECORD.size
# its frame's extra bytes: the room to move the records onto their place in a page, the
# headers before them and the rest of the records' last page after the frame
PLACED_PAD = 3 * 4096
# at most this many requests in one run (RUN_HANDLERS): a Produce run is one LogCache entry,
# and a Fetch whose first entry is larger than its max bytes still gets all of it
RUN_MAX_REQUESTS = 32
try:  # the zero-copy Fetch encoder, when the protocol package offers it
    from protocol.frames import encode_response_buffers as _encode_buffers
except ImportError:  # pragma: no cover - older protocol package
    _encode_buffers = None


class EncodedBody(bytes):
    """A handler may return a response body it already encoded (e.g. a cached one); any
    ``bytes``/``bytearray`` body is taken as encoded."""


def _encode(header: Any, response: Any) -> list[Any]:
    if type(response) is Framed:       # framed by its handler already
        return response
    if isinstance(response, (bytes, bytearray)):
        return protocol.encode_response_parts(header, [response])
    if _encode_buffers is not None:
        return list(_encode_buffers(header, response))
    return [protocol.encode_response(header, response)]


class Connection(asyncio.BufferedProtocol):
    """One client connection: framing, concurrent handling, in-order responses."""

    def __init__(self, broker: "Broker", listener: str = "PLAINTEXT") -> None:
        self.broker = broker
        self.listener = listener       # the named listener it came in on (broker/listeners.py)
        self.transport: asyncio.Transport | None = None
        # the loop, looked up once: asyncio.get_running_loop() makes a getpid() syscall on
        # every call (7 % of the event loop under small produce requests)
        self._loop = asyncio.get_running_loop()
        self.peer: str = "?"
        self._buf = bytearray(INITIAL_BUFFER)
        self._start = 0          # first unconsumed byte
        self._end = 0            # end of received bytes
        # (handler task or ready future, request header or None when the result is
        # pre-encoded, the frame when it came from the frame pool's size class, else None)
        self._queue: collections.deque[tuple[asyncio.Future, Any, bytearray | None]] = \
            collections.deque()
        self._frame: bytearray | None = None  # large frame being received in place
        self._frame_fill = 0
        self._frame_at = 0       # the frame's start in it (records received in place)
        self._frame_end = 0      # and its end
        # a frame received in place: its batch's checked bytes (from protocol.CRC_START) are
        # summed read by read while the receive has just left them in the cache, and the sum
        # goes with the offer to the WAL, whose check then reads only the batch's first bytes
        # (the same pass over the whole frame later ran at the memory's speed)
        self._crc_at = 0         # the next byte to sum
        self._crc_end = 0        # the batch's end (0: no frame being summed)
        self._crc = 0
        self._offer_at = 0       # the payload's place in the frame
        self._head = False       # the next read is HEAD_READ bytes (a large frame just ended)
        self._flush_scheduled = False
        self._closing = False
        self._paused_reading = False
        self._write_paused = False
        self._reading_stopped = False  # shutdown or bad frame: no new requests
        self._eof = False              # the client half-closed its side
        # response bytes not yet handed to the transport (large answers go out in slices)
        self._unsent: collections.deque[memoryview] = collections.deque()
        self._slice_scheduled = False
        self._close_when_sent = False
        # large answers go out on a sender thread (broker/sender.py): while one does, later
        # answers wait in _unsent; the thread writes to this dup of the socket's descriptor
        self._sending = False
        self._send_fd = -1
        self._lost = False
        # requests of the current read that may be handled as one run (RUN_HANDLERS): their
        # run key and (context, request, time received), not queued yet
        self._run_key: Any = None
        self._run: list[tuple[RequestContext, Any, float]] = []
        # handler tasks of api keys that also have a task-less path (NOW_HANDLERS) whose
        # first step has not run yet: meanwhile later requests take the task path too, so
        # first steps (where a Produce takes its offsets) keep request order
        self._slow = 0
        # bytes of the large (pooled) frames of requests not answered yet: reading pauses at
        # max_inflight_bytes. A confluent-kafka producer on one partition (~1 MiB requests,
        # unlimited in flight) otherwise had up to max_inflight_requests (256) in here while the
        # broker was the slower side: 190-200 ms per request instead of 20-30 at the same rate,
        # and both processes paying for that memory (bench/HISTORY.md, session 18)
        self._frame_bytes = 0
        self._max_frame_bytes = getattr(broker.config, "max_inflight_bytes", 32 << 20)

    # ---- asyncio callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)  # type: ignore[attr-defined]
        self.broker.connections.add(self)
        self.broker.request_stats.connections_opened += 1
        log.debug("connection open peer=%s", self.peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._lost = True
        self.broker.connections.discard(self)
        # handler tasks run to completion (an append in flight must finish its bookkeeping);
        # their answers are dropped
        for _fut, _header, frame in self._queue:
            if frame is not None:
                placed.withdraw(frame)
        if self._frame is not None:
            placed.withdraw(self._frame)
        self._queue.clear()
        self._unsent.clear()
        if not self._sending:
            self._close_send_fd()
        log.debug("connection closed peer=%s error=%s", self.peer, exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._frame is not None:
            return memoryview(self._frame)[self._frame_fill:self._frame_end]
        if self._head:      # until a read brings bytes (libuv's next read is often EAGAIN)
            return memoryview(self._buf)[self._end:self._end + HEAD_READ]
        free = len(self._buf) - self._end
        if free < 4096:
            # Never resize in place: the loop may still hold a view of the old buffer.
            pending = self._end - self._start
            size = len(self._buf) if pending < len(self._buf) // 2 else 2 * len(self._buf)
            new = bytearray(size)
            new[:pending] = self._buf[self._start:self._end]
            self._buf = new
            self._start, self._end = 0, pending
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._frame is not None:
                fill = self._frame_fill = self._frame_fill + nbytes
                if self._crc_end:
                    self._crc_to(fill)
                if fill < self._frame_end:
                    return
                frame, self._frame = self._frame, None
                if self._crc_end:
                    self._offer(frame)
                self._head = True
                if not self._closing:
                    self._dispatch(frame, pooled=True, at=self._frame_at,
                                   end=self._frame_end)
                self._split_frames(True)
                return
            self._end += nbytes
            self._head = False
            self._split_frames()
        except Exception:  # noqa: BLE001 - never let a bug here take the loop down
            log.exception("framing failed peer=%s", self.peer)
            self.close()

    def _crc_to(self, fill: int) -> None:
        """Sum the batch's checked bytes that arrived, up to ``fill``, while in the cache."""
        at = self._crc_at
        end = fill if fill < self._crc_end else self._crc_end
        if end > at:
            self._crc = crc32c(memoryview(self._frame)[at:end], self._crc)
            self._crc_at = end

    def _offer(self, frame: Any) -> None:
        """Offer a frame received in place to the WAL (storage/wal/placed.py) with its sum."""
        end, self._crc_end = self._crc_end, 0
        placed.offer(frame, self._offer_at, end - self._offer_at,
                     protocol.CRC_START if self._crc_at == end else -1, self._crc)

    def eof_received(self) -> bool | None:
        """The client half-closed: answer what it sent, then close (keeps ``printf | nc`` and
        scripted clients working)."""
        self._eof = True
        self._reading_stopped = True
        if not self._queue:
            return False
        return True

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._unsent and not self._slice_scheduled:
            self._write_slice()
        self._update_reading()

    # ---- framing -----------------------------------------------------------------------
    def _split_frames(self, dispatched: bool = False) -> None:
        """Dispatch every whole frame in the read buffer, start receiving a large one in place;
        then pause or resume reading (``_update_reading``) if a request was dispatched (here
        or just before: ``dispatched``). Nothing else it does moves what reading depends on
        (requests queued, frame bytes held; the other inputs update it themselves), so a read
        that only brings the next large frame's first bytes - one per 1 MiB request - makes no
        call for it."""
        buf = self._buf
        limit = self.broker.config.max_request_bytes
        while not self._closing and not self._reading_stopped:
            avail = self._end - self._start
            if avail < 4:
                break
            (size,) = _SIZE.unpack_from(buf, self._start)
            if size < 0 or size > limit:
                log.warning("request too large or negative size peer=%s size=%d limit=%d; "
                            "closing connection", self.peer, size, limit)
                self._enqueue_close()
                return
            if avail < 4 + size:
                need = 4 + size
                if DIRECT_FRAME <= size <= DIRECT_FRAME_MAX:
                    # the rest of this frame is read into its own buffer: no copy later
                    have = avail - 4
                    at = produce_records_at(buf, self._start + 4, self._end)
                    if at is NEED_MORE and avail < PLACE_WITHIN:
                        break           # its records' place is still arriving: read on
                    if at is not None and at[1] >= DIRECT_FRAME and sum(at) <= size:
                        # the records where the WAL writes them: no copy into its block;
                        # offered to it (_offer) once received and summed
                        frame = self.broker.frame_pool.take(size + PLACED_PAD)
                        start = placed.place(frame, at[0], PLACED_HEAD) - at[0]
                        self._offer_at = start + at[0]
                        self._crc_at = self._offer_at + protocol.CRC_START
                        self._crc_end = self._offer_at + at[1]
                        self._crc = 0
                    else:
                        frame = self.broker.frame_pool.take(size)
                        start = 0
                    # through a view: an arena frame is a buffer, not a bytearray
                    memoryview(frame)[start:start + have] = memoryview(buf)[self._start + 4:
                                                                            self._end]
                    self._frame, self._frame_fill = frame, start + have
                    self._frame_at, self._frame_end = start, start + size
                    self._start = self._end = 0
                    if self._crc_end:
                        self._crc_to(start + have)
                    break
                if len(buf) - self._start < need:
                    # Grow step by step (doubling) instead of trusting the declared size at
                    # once, so idle clients announcing huge frames cannot pin much memory.
                    pending = bytes(buf[self._start:self._end])
                    new = bytearray(min(need, max(2 * len(buf), INITIAL_BUFFER)))
                    new[:len(pending)] = pending
                    self._buf = buf = new
                    self._start, self._end = 0, len(pending)
                break
            # one copy into an owned frame; the read buffer is reused
            frame = buf[self._start + 4:self._start + 4 + size]
            self._start += 4 + size
            self._dispatch(frame)
            dispatched = True
        self._start_run()
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > KEEP_BUFFER:
                self._buf = bytearray(INITIAL_BUFFER)
        if dispatched:
            self._update_reading()

    def _dispatch(self, frame: bytearray, pooled: bool = False, at: int = 0,
                  end: int = -1) -> None:
        """Decode one frame, start its handler and queue the pending response in order.
        ``frame[at:end]``: the request of a pooled frame received in place (records placed
        for the WAL: storage/wal/placed.py)."""
        received = time.perf_counter()
        stats = self.broker.request_stats
        try:
            header, request = parse_request(frame if end < 0 or (at == 0 and end == len(frame))
                                            else memoryview(frame)[at:end])
        except UnsupportedVersionError as exc:
            h = exc.header
            stats.error(h.api_key, h.api_version, "UNSUPPORTED_VERSION")
            if h.api_key == 18:  # KIP-511: answer in v0 so the client can pick a version
                self._enqueue_ready([protocol.api_versions_fallback(h)])
                log.debug("unsupported ApiVersions v%d peer=%s", h.api_version, self.peer)
                return
            answer = protocol.unsupported_version_response(h)
            if answer is not None:   # the client reads UNSUPPORTED_VERSION, not a closed socket
                log.info("unsupported version api=%s version=%d peer=%s; answered "
                         "UNSUPPORTED_VERSION", api_name(h.api_key), h.api_version, self.peer)
                self._enqueue_ready([answer])
                return
            log.info("unsupported version api=%s version=%d peer=%s; closing connection",
                     api_name(h.api_key), h.api_version, self.peer)
            self._enqueue_close()
            return
        except UnknownApiError as exc:
            stats.error(exc.header.api_key, exc.header.api_version, "UNKNOWN_API")
            log.info("unknown api key=%d peer=%s; closing connection", exc.header.api_key,
                     self.peer)
            self._enqueue_close()
            return
        except MalformedRequestError as exc:
            stats.error(-1, -1, "MALFORMED_REQUEST")
            log.info("malformed request peer=%s error=%s; closing connection", self.peer, exc)
            self._enqueue_close()
            return
        except Exception as exc:  # noqa: BLE001 - a codec bug is still only this connection
            stats.error(-1, -1, "UNDECODABLE_REQUEST")
            log.warning("undecodable request peer=%s error=%r; closing connection", self.peer,
                        exc)
            self._enqueue_close()
            return
        fn = HANDLERS.get(header.api_key)
        if fn is None:
            log.warning("no handler api=%s peer=%s; closing connection",
                        api_name(header.api_key), self.peer)
            self._enqueue_close()
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request api=%s version=%d correlation_id=%d client_id=%s peer=%s",
                      api_name(header.api_key), header.api_version, header.correlation_id,
                      header.client_id, self.peer)
        run = RUN_HANDLERS.get(header.api_key)
        if run is not None:
            try:
                key = run[0](request)
            except Exception:  # noqa: BLE001 - an odd request is simply handled alone
                key = None
            if key is not None:
                if pooled:
                    # a large frame of its own (never merged: that would copy it): alone,
                    # through the task-less path when it takes it
                    self._start_run()
                    self._start_items([(RequestContext(self.broker, header, self), request,
                                        received)], frame)
                    return
                if key != self._run_key or len(self._run) >= RUN_MAX_REQUESTS:
                    if self._run:
                        self._start_run()
                    self._run_key = key
                # queued when the run starts: nothing else is queued before that
                self._run.append((RequestContext(self.broker, header, self), request, received))
                return
        self._start_run()
        # the handler coroutine (inside its timing wrapper) is the task itself: the queue
        # keeps (task, header) and the response is encoded when it is written
        task = self._loop.create_task(
            timed(fn, RequestContext(self.broker, header, self), request, stats, received))
        self._queue.append((task, header, frame if pooled else None))
        task.add_done_callback(self._handler_done)
        if pooled:
            self._frame_bytes += len(frame)
        if header.api_key in NOW_HANDLERS:
            self.track_slow(task)

    def _start_run(self) -> None:
        """Start the requests collected for a run (before anything after them is queued):
        one alone as usual, several through their run handler in one task, each with its own
        place in the response queue."""
        items = self._run
        if not items:
            return
        self._run = []
        self._run_key = None
        self._start_items(items, None)

    def _start_items(self, items: list[tuple[RequestContext, Any, float]],
                     frame: bytearray | None) -> None:
        """``_start_run`` of ``items``; ``frame``: the pooled frame of a lone request (counted
        in ``_frame_bytes`` and given back to the pool once answered, as on the task path)."""
        api_key = items[0][0].header.api_key
        if frame is not None:           # queued below on either path, with the request
            self._frame_bytes += len(frame)
        now = NOW_HANDLERS.get(api_key)
        if now is not None and not self._slow:
            loop = self._loop
            futs = [loop.create_future()] if len(items) == 1 else \
                [loop.create_future() for _ in items]    # (a comprehension is a call)
            try:
                taken = now(items, futs, self)
            except Exception:  # noqa: BLE001 - the task path answers them instead
                log.exception("task-less handler failed api=%s peer=%s", api_name(api_key),
                              self.peer)
                taken = False
            if taken:
                for (ctx, _request, _received), fut in zip(items, futs):
                    self._queue.append((fut, ctx.header, frame))
                return
        if len(items) == 1:
            ctx, request, received = items[0]
            task = self._loop.create_task(timed(HANDLERS[api_key], ctx, request,
                                                self.broker.request_stats, received))
            self._queue.append((task, ctx.header, frame))
            task.add_done_callback(self._handler_done)
        else:
            futs = []
            for ctx, _request, _received in items:
                fut = self._loop.create_future()
                futs.append(fut)
                self._queue.append((fut, ctx.header, None))
            task = self._loop.create_task(self._run_task(items, futs))
            task.add_done_callback(self._handler_done)
        if now is not None:
            self.track_slow(task)

    def track_slow(self, task: asyncio.Future) -> None:
        """A handler task of an api key with a task-less path, just created: until its first
        step ran, requests of that key take the task path (see ``_slow``). A new task's first
        step is the next entry of the loop's ready queue: this callback runs right after."""
        self._slow += 1
        self._loop.call_soon(self._slow_started)

    def _slow_started(self) -> None:
        self._slow -= 1

    def answered(self) -> None:
        """A task-less handler answered requests of the queue: write them out."""
        if not self._closing:
            self._schedule_flush()

    async def _run_task(self, items: list[tuple[RequestContext, Any, float]],
                        futs: list[asyncio.Future]) -> None:
        """One run handler call for ``items``; each future gets its own answer."""
        fn = RUN_HANDLERS[items[0][0].header.api_key][1]
        stats = self.broker.request_stats
        start = time.perf_counter()
        try:
            bodies = await fn([it[0] for it in items], [it[1] for it in items])
            if len(bodies) != len(items):
                raise RuntimeError(f"run handler answered {len(bodies)} of {len(items)}")
        except BaseException as exc:
            end = time.perf_counter()
            answered = 0
            for (ctx, req, received), fut in zip(items, futs):
                h = ctx.header
                stats.error(h.api_key, h.api_version, "EXCEPTION")
                stats.observe(h.api_key, h.api_version, start - received, end - start)
                # as timed(): answered like Kafka does (an error response), else closed
                answer = failure_answer(ctx, req, exc) if isinstance(exc, Exception) else None
                if fut.done():
                    continue
                if answer is not None:
                    fut.set_result(answer)
                    answered += 1
                elif self._closing:
                    fut.cancel()
                else:
                    fut.set_exception(exc if isinstance(exc, Exception)
                                      else RuntimeError("handler cancelled"))
            if answered < len(items):
                raise
            log.warning("run handler failed peer=%s error=%r; answered with errors", self.peer,
                        exc)
            return
        end = time.perf_counter()
        stats.runs += 1
        stats.run_requests += len(items)
        for (ctx, _req, received), fut, body in zip(items, futs, bodies):
            h = ctx.header
            stats.observe(h.api_key, h.api_version, start - received, end - start)
            if not fut.done():
                fut.set_result(body)

    def _handler_done(self, task: asyncio.Task) -> None:
        if not task.cancelled():
            exc = task.exception()  # always retrieved, even after the connection went away
            if exc is not None:
                log.error("handler failed peer=%s error=%r; closing connection", self.peer,
                          exc, exc_info=exc)
        if not self._closing:
            self._schedule_flush()

    def _enqueue_ready(self, buffers: Any) -> None:
        self._start_run()                  # answers stay in request order
        fut = self._loop.create_future()
        fut.set_result(buffers)
        self._queue.append((fut, None, None))
        self._schedule_flush()

    def _enqueue_close(self) -> None:
        self._enqueue_ready(_CLOSE)
        self._reading_stopped = True  # nothing after a bad frame can be trusted

    # ---- writing -----------------------------------------------------------------------
    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write every response that is ready at the head of the queue, in one call."""
        self._flush_scheduled = False
        out: list[Any] = []
        close = False
        queue = self._queue
        while queue and queue[0][0].done():
            fut, header, frame = queue.popleft()
            if frame is not None:
                self._frame_bytes -= len(frame)
                placed.withdraw(frame)
            # refcount 2 (this name + the call's argument): the request is gone
            if frame is not None and sys.getrefcount(frame) == 2:
                self.broker.frame_pool.give(frame)
            frame = None
            try:
                result = fut.result()
            except BaseException:  # noqa: BLE001 - cancelled or failed (retrieved here)
                close = True  # a failed handler: the client cannot be answered in order
                break
            if header is None:  # pre-encoded answer or the close marker
                if result is _CLOSE:
                    close = True
                    break
                out.extend(result)
            elif type(result) is Framed:  # framed by its handler already (_encode's first case)
                out.extend(result)
            elif result is not None:  # None: acks=0 produce, nothing to write
                try:
                    out.extend(_encode(header, result))
                except Exception as exc:  # noqa: BLE001 - an encoder bug closes this connection
                    log.error("response encoding failed api=%s peer=%s error=%r; closing "
                              "connection", api_name(header.api_key), self.peer, exc)
                    close = True
                    break
        if self.transport is not None and not self.transport.is_closing():
            if out:
                self._write(out)
            if close or (self._eof and not queue):
                if self._unsent or self._sending:
                    self._close_when_sent = True      # after the answers already queued
                else:
                    self.close()
        self._update_reading()
        if not queue:
            self.broker._connection_idle()

    def _write(self, out: list[Any]) -> None:
        """Hand responses to the socket in order: large ones to a sender thread, else to the
        transport, at once when small, else WRITE_SLICE bytes per loop turn (hot requests
        and WAL completions run in between)."""
        if not self._unsent and not self._sending:
            size = sum(map(len, out))
            if size >= OFFLOAD_MIN and self._offload(out):
                return
            if size <= WRITE_SLICE or not self.broker.hot_traffic():
                self.transport.writelines(out)  # type: ignore[union-attr]
                return
        self._unsent.extend(byte_views(out))
        if not self._slice_scheduled and not self._sending:
            self._write_slice()

    def _offload(self, out: list[Any]) -> bool:
        """Start writing ``out`` on a sender thread (broker/sender.py); False when this
        connection cannot: no pool, TLS, or bytes still buffered in the transport."""
        pool = getattr(self.broker, "sender", None)    # stand-in brokers of tests have none
        t = self.transport
        if pool is None or t is None or t.is_closing() or t.get_write_buffer_size():
            return False
        if self._send_fd < 0:
            sock = t.get_extra_info("socket")
            if sock is None or t.get_extra_info("sslcontext") is not None:
                return False
            try:
                self._send_fd = os.dup(sock.fileno())
            except (OSError, ValueError):
                return False
        self._sending = True
        fut = self._loop.run_in_executor(pool, send_some, self._send_fd, byte_views(out))
        fut.add_done_callback(self._sent)
        return True

    def _sent(self, fut: asyncio.Future) -> None:
        """A sender thread is done: the answers queued meanwhile go out next; what a
        stalled socket did not take goes to the transport (it waits for room on the loop)."""
        self._sending = False
        t = self.transport
        if self._lost:
            self._close_send_fd()
            return
        if self._closing or t is None or t.is_closing():
            return              # connection_lost closes the descriptor
        exc = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or exc is not None:
            log.debug("send failed peer=%s error=%r", self.peer, exc)
            self.close()
            return
        rest = fut.result()
        stalled = bool(rest)
        pending = [*rest, *self._unsent]
        rest.clear()          # the executor's future keeps the list: no views of frames in it
        self._unsent.clear()
        if stalled:
            t.writelines(pending)
        elif pending:
            self._write(pending)
        if self._close_when_sent and not self._unsent and not self._sending:
            self.close()
        elif self.idle:
            self.broker._connection_idle()

    def _close_send_fd(self) -> None:
        if self._send_fd >= 0:
            fd, self._send_fd = self._send_fd, -1
            os.close(fd)

    def _write_slice(self, held: bool = False) -> None:
        """Write the next WRITE_SLICE bytes of unsent response data; reschedule while more is
        left (not while the transport is over its high-water mark: resume_writing goes on).
        A slice waits for hot appends in flight (the store's ``hold_bulk``, once per slice:
        ``held``), so their WAL completions are not handled after a whole answer's slices."""
        self._slice_scheduled = False
        t = self.transport
        if t is None or t.is_closing():
            self._unsent.clear()
            return
        if self._write_paused or self._sending:
            return
        hold = getattr(self.broker, "hold_bulk", None)     # (test doubles lack it)
        if not held and hold is not None and hold(self._write_held):
            self._slice_scheduled = True
            return
        unsent = self._unsent
        chunk: list[memoryview] = []
        room = WRITE_SLICE
        while unsent and room > 0:
            mv = unsent.popleft()
            if len(mv) > room:
                unsent.appendleft(mv[room:])
                mv = mv[:room]
            chunk.append(mv)
            room -= len(mv)
        t.writelines(chunk)
        if unsent:
            self._slice_scheduled = True
            self._loop.call_soon(self._write_slice)
        elif self._close_when_sent:
            self.close()
        elif not self._queue:
            self.broker._connection_idle()

    def _write_held(self) -> None:
        self._write_slice(True)

    def _update_reading(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        want_pause = (self._write_paused or self._reading_stopped
                      or len(self._queue) >= self.broker.config.max_inflight_requests
                      or self._frame_bytes >= self._max_frame_bytes)
        if want_pause and not self._paused_reading:
            self._paused_reading = True
            self.transport.pause_reading()
        elif not want_pause and self._paused_reading:
            self._paused_reading = False
            self.transport.resume_reading()
            if self._end - self._start >= 4:  # frames already buffered
                self._loop.call_soon(self._split_frames)

    def close(self) -> None:
        self._closing = True
        self._queue.clear()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # ---- shutdown ----------------------------------------------------------------------
    def stop_reading(self) -> None:
        self._reading_stopped = True
        self._update_reading()

    @property
    def idle(self) -> bool:
        return not self._queue and not self._unsent and not self._sending


class Broker:
    """Everything one s3kafka process owns; handlers reach it as ``ctx.broker``."""

    def __init__(self, config: BrokerConfig, startup: Any = None) -> None:
        self.config = config
        self.startup = startup            # startup_checks.Startup: locks held, store state
        self._store_watch: asyncio.Task | None = None
        self._gc: SurvivorFreezer | None = None
        self.loop_watch: LoopWatch | None = None
        # the store's wait for hot appends before a large answer's next slice (Connection.
        # _write_slice; the engine's cold-read pacer), None for stores without it
        self.hold_bulk: Any = None
        self._watch_seen = 0              # request_stats.answered at the loop watch's last tick
        self._gc_pass: asyncio.TimerHandle | None = None
        self.meta: MetadataStore | None = None
        self.store: Any = None
        self.groups: Any = None
        self.topic_manager: TopicManager | None = None
        self.cluster: Any = None           # broker.cluster.ClusterRoom
        self.cluster_id = ""
        self.connections: set[Connection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._idle = asyncio.Event()
        self._idle_waiting = False        # a shutdown waits in _wait_idle
        self.started_at = time.time()
        # frames from 4 KiB-page arena slabs that the WAL's io_uring registers (pinned once)
        self.frame_pool = FramePool(arena=config.wal_io_engine == "uring")
        self.sender = sender_pool()          # large answers' sender threads (None: 1 CPU)
        self.request_stats = RequestStats()   # read by broker.metrics at scrape time
        self.metrics_server: Any = None
        # name -> Topic: the topic manager's own dict once it is loaded (start()), which it
        # only ever changes in place; an attribute, not a property, as every Produce and Fetch
        # reads it (find_topic): a Python call less per request
        self.topics: dict[str, Topic] = {}

    # ---- state the handlers read -------------------------------------------------------
    @property
    def partitions(self) -> dict[tuple[str, int], Any]:
        """(topic, index) -> Partition, a snapshot of every open partition."""
        return {(t.name, i): p for t in self.topics.values() for i, p in enumerate(t.partitions)
                if p is not None}

    @property
    def node_id(self) -> int:
        return self.config.node_id

    async def auto_create_topic(self, name: str) -> Topic | None:
        """Produce/Metadata auto-creation (auto.create.topics.enable); None when disabled."""
        assert self.topic_manager is not None
        return await self.topic_manager.auto_create(name)

    # ---- life cycle --------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        # PostgreSQL calls fail within about a lease when the route drops (storage/sqldb.py)
        sqldb.configure_timeouts(cfg.cluster_lease_ms)
        self.meta = await asyncio.to_thread(open_metadata_store, cfg.metadata_url)
        self.cluster_id = await asyncio.to_thread(self.meta.cluster_id)
        if cfg.storage == "engine":
            await asyncio.to_thread(self.meta.bind_object_store, cfg.object_store_url)
        if cfg.storage == "engine":     # the node epoch (and a taken-over WAL) from the room
            from .cluster.room import prepare_node_epoch  # noqa: PLC0415
            await prepare_node_epoch(cfg, self.startup)
        self.store = self._open_store()
        cache = getattr(self.store, "cache", None)
        frames_for = 0                                # LogCache bytes the frames serve
        if cache is not None and hasattr(cache, "recycle"):
            cache.recycle = self.frame_pool.recycle   # evicted produce frames are reused
            self.frame_pool.fit_cache(cache.capacity)
            frames_for = cache.capacity
        await self.store.start()
        # new frame slabs are registered with the WAL's io_uring on the frames' own thread
        self.frame_pool.on_grown = getattr(self.store, "refresh_fixed_buffers", None)
        self.hold_bulk = getattr(getattr(self.store, "cold_pacer", None), "hold_bulk", None)
        self.cluster = ClusterRoom(self)
        await self.cluster.start()
        self.topic_manager = TopicManager(self, self.meta)
        self.topics = self.topic_manager.topics
        await self.topic_manager.load()
        self.groups = await self._start_groups()
        if self.groups is not None:      # only the groups placed on this broker (see cluster)
            await self.groups.placement_changed(self.cluster.is_coordinator)
        self.cluster.run()
        loop = asyncio.get_running_loop()
        for lst in cfg.listener_list():       # one socket per named listener, first = default
            srv = await loop.create_server(
                lambda name=lst.name: Connection(self, name), lst.host, lst.port,
                reuse_address=True, backlog=1024)
            self._servers.append(srv)
            if len(cfg.listener_list()) > 1:
                log.info("listener %s on %s:%d advertised as %s:%d", lst.name,
                         *srv.sockets[0].getsockname()[:2], lst.adv_host, lst.adv_port)
        self._server = self._servers[0]
        self._gc = SurvivorFreezer()
        self._gc.install()
        self.loop_watch = LoopWatch(loop, self._requests_flowing)
        self.loop_watch.start()
        self._gc_pass = loop.call_later(FULL_PASS_S, self._gc_full_pass)
        sock = self._server.sockets[0].getsockname()
        from .startup_checks import redact_url, watch_degraded_store  # noqa: PLC0415

        engine = cfg.storage == "engine"
        ec = cfg.engine_config() if engine else None
        log.info("broker started listen=%s:%d advertised=%s:%d node_id=%d cluster_id=%s "
                 "data_dir=%s storage=%s wal=%s wal_capacity=%s object_store=%s metadata=%s",
                 sock[0], sock[1], cfg.advertised_host, cfg.advertised_port, cfg.node_id,
                 self.cluster_id, cfg.data_path, cfg.storage, ec.wal_path if ec else "-",
                 ec.wal_capacity if ec else "-",
                 redact_url(cfg.object_store_url) if engine else "-", cfg.metadata_url)
        if engine:   # one line when payload copies run without storage._copycrc
            from storage.copycrc import warn_if_missing  # noqa: PLC0415
            warn_if_missing()
        if cfg.frame_pretouch:          # after the listeners are up: it delays nothing
            self.frame_pool.pretouch(frames_for, self._catchup_reads_running())
        if self.startup is not None:
            self.startup.started = True
        if engine and self.startup is not None and self.startup.store_error:
            self._store_watch = asyncio.create_task(watch_degraded_store(
                cfg.object_store_url, self.startup.store_error, self.startup.degraded_reason),
                name="s3kafka-store-watch")

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def _catchup_reads_running(self) -> RateWatch | None:
        """The frame pre-touch's ``defer``: True while the engine serves catch-up reads (its
        ColdReadPacer's bytes) at PRETOUCH_YIELD_RATE or more. A restarted broker's catch-up
        readers then get the CPU and memory bandwidth; the pre-touch goes on after them (it
        cost them 15-30 % of their MB/s, bench/HISTORY.md session 53). None: no engine."""
        pacer = getattr(self.store, "cold_pacer", None)
        if pacer is None:
            return None
        return RateWatch(lambda: pacer.bytes, PRETOUCH_YIELD_RATE)

    def _open_store(self) -> Any:
        if self.config.storage == "engine":
            from storage.engine import open_engine  # noqa: PLC0415 - never fall back silently

            return open_engine(self.config.engine_config())
        from storage.memory import MemoryStreamStore  # noqa: PLC0415

        log.warning("storage=memory: records are kept in RAM only and lost on restart")
        return MemoryStreamStore()

    async def _start_groups(self) -> Any:
        try:
            from .groups import GroupCoordinator  # noqa: PLC0415
        except ImportError:
            log.warning("group coordinator not available")
            return None
        cfg = self.config
        groups = GroupCoordinator(
            cfg.metadata_url, cfg.node_id, cfg.advertised_host, cfg.advertised_port,
            min_session_timeout_ms=cfg.group_min_session_timeout_ms,
            max_session_timeout_ms=cfg.group_max_session_timeout_ms,
            initial_rebalance_delay_ms=cfg.group_initial_rebalance_delay_ms,
            max_metadata_bytes=cfg.offset_metadata_max_bytes)
        await groups.start()
        return groups

    def hot_traffic(self) -> bool:
        """Producers appended within the last second (the engine's cold-read pacer tracks it):
        large answers are then written in WRITE_SLICE pieces so appends and their WAL
        completions do not wait behind a multi-MiB socket copy. Stores without the signal
        (memory) always count as hot."""
        pacer = getattr(self.store, "cold_pacer", None)
        return pacer is None or pacer.hot_active()

    def _connection_idle(self) -> None:
        """A connection's answers are all out: wake a shutdown waiting for every connection to
        be idle (``_wait_idle``). Only while one waits: a client with one request in flight
        drains its queue after every answer, and each time this went over every connection."""
        if self._idle_waiting and all(c.idle for c in self.connections):
            self._idle.set()

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish, close partitions, flush storage."""
        log.info("broker stopping connections=%d", len(self.connections))
        if self._store_watch is not None:
            self._store_watch.cancel()
        if self._gc_pass is not None:
            self._gc_pass.cancel()
        if self._gc is not None:
            self._gc.uninstall()
        if self.loop_watch is not None:
            self.loop_watch.stop()
            self._gc = None
        if self.cluster is not None:
            try:
                await self.cluster.drain()     # controlled shutdown: partitions move first
            except Exception as exc:  # noqa: BLE001 - a store outage: its one-line episode
                log_failure(log, exc, "controlled shutdown failed")
            await self.cluster.stop()
        for srv in self._servers:
            srv.close()
        for c in list(self.connections):
            c.stop_reading()
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        # Long-polling fetches end at their max_wait; closing partitions releases them early.
        await self._wait_idle(min(2.0, self.config.shutdown_timeout_s))
        if self.topic_manager is not None:
            await self.topic_manager.close()
        await self._wait_idle(max(0.0, deadline - time.monotonic()))
        for c in list(self.connections):
            c.close()
        retention = getattr(self, "_datapath_retention", None)
        if retention is not None:
            try:
                await retention.stop()
            except Exception:  # noqa: BLE001
                log.exception("retention stop failed")
        try:
            from .transactions import stop_transactions  # noqa: PLC0415

            await stop_transactions(self)
        except Exception:  # noqa: BLE001
            log.exception("transaction coordinator stop failed")
        if self.groups is not None:
            try:
                await self.groups.close()
            except Exception:  # noqa: BLE001
                log.exception("group coordinator close failed")
        if self.store is not None:
            try:
                await self.store.close()  # flushes the WAL and uploads per the engine's rules
            except Exception:  # noqa: BLE001
                log.exception("storage close failed")
        pstore = getattr(self, "_datapath_producer_store", None)
        if pstore is not None and hasattr(pstore, "close"):
            try:
                pstore.close()
            except Exception:  # noqa: BLE001
                log.exception("producer store close failed")
        if self.meta is not None:
            self.meta.close()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        self.frame_pool.close()
        if self.sender is not None:
            self.sender.shutdown(wait=False)
        log.info("broker stopped")

    def _requests_flowing(self) -> bool:
        """The loop watch's ``active``: a request was answered since its last tick. Connected
        but idle clients (a consumer group between heartbeats, a producer with nothing to
        send: every client keeps its connections open) wait behind no stall, and with
        ``bool(self.connections)`` they kept the 5 ms timer's 200 wake-ups a second going."""
        n = self.request_stats.answered
        flowing = n != self._watch_seen
        self._watch_seen = n
        return flowing

    def _gc_full_pass(self) -> None:
        """The collector's periodic full pass (broker/gc_tuning.py)."""
        if self._gc is not None:
            self._gc.full_pass()
            self._gc_pass = asyncio.get_running_loop().call_later(FULL_PASS_S,
                                                                   self._gc_full_pass)

    async def _wait_idle(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        self._idle_waiting = True
        try:
            while any(not c.idle for c in self.connections):
                left = end - time.monotonic()
                if left <= 0:
                    log.warning("shutdown: requests still in flight; closing their connections")
                    return
                self._idle.clear()
                await wait_event(self._idle, min(left, 0.1))
        finally:
            self._idle_waiting = False


async def serve(config: BrokerConfig, startup: Any = None) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    broker = Broker(config, startup)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # /metrics first: a taken --metrics-listen address stops the start before anything is
    # opened or written (one line, from run())
    broker.metrics_server = await start_metrics(broker)
    try:
        await broker.start()
    except BaseException:
        log.error("start-up failed; releasing what was opened")
        try:
            await broker.stop()
        except Exception:  # noqa: BLE001 - report the original error
            log.exception("cleanup after failed start-up failed")
        raise
    await stop.wait()
    await broker.stop()


def run(config: BrokerConfig, startup: Any = None) -> int:
    """Process entry: uvloop when available; exit code 0 after a clean shutdown, 1 (with one
    line, no traceback) when start-up meets a known environment error."""
    from storage.objects.store import ObjectStoreError  # noqa: PLC0415
    from storage.wal.errors import WALError  # noqa: PLC0415

    # `kill -USR2 <pid>` writes every thread's stack to stderr: the evidence when a broker
    # hangs (a test's SIGTERM that does not end it sends this before SIGKILL)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    try:
        import uvloop  # noqa: PLC0415

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    try:
        runner(serve(config, startup))
    except (OSError, ValueError, WALError, ObjectStoreError) as exc:
        log.error("cannot start: %s", " ".join(str(exc).split()))
        return 1
    except ClusterError as exc:
        log.error("cannot start: %s", exc)
        return 2
    return 0
