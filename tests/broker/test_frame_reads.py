"""Each byte of a large request frame is copied once on its way in: socket -> its own frame.

After a large frame the connection offers the next read only HEAD_READ bytes of its read
buffer (the next frame's size and request header), so a following large frame's body is read
straight into that frame; a whole INITIAL_BUFFER read copied its first 64 KiB twice. A large
Produce whose header arrives in pieces is read on until its records' place is known, so it
is still received in place for the WAL (storage/wal/placed.py)."""
from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from types import SimpleNamespace

import pytest

from broker import server
from broker.frames import FramePool
from broker.metrics import RequestStats
from broker.server import DIRECT_FRAME, HEAD_READ, INITIAL_BUFFER, Connection

from broker_wire import Wire
from datapath.wire import metric_at
from protocol.frames import parse_response
from test_inflight_bytes import Transport
from test_placed_produce import batch, broker_with_topic, produce_v3, produce_v9

API = 9999


def _frame(size: int, fill: int) -> bytes:
    """A stand-in request frame: api key API, then ``fill`` repeated (to check the bytes)."""
    body = struct.pack(">h", API) + bytes([fill]) * (size - 2)
    return struct.pack(">i", size) + body


def _connection(monkeypatch) -> tuple[Connection, list[bytes]]:
    """A Connection over a stand-in broker whose API ``API`` records each frame it is given."""
    got: list[bytes] = []

    def parse(frame):
        got.append(bytes(frame))
        return SimpleNamespace(api_key=API, api_version=0, correlation_id=0,
                               client_id="t"), object()

    async def handler(ctx, request):
        return None                        # nothing to write

    monkeypatch.setattr(server, "parse_request", parse)
    monkeypatch.setitem(server.HANDLERS, API, handler)
    broker = SimpleNamespace(
        _connection_idle=lambda: None, hot_traffic=lambda: False, frame_pool=FramePool(),
        request_stats=RequestStats(), connections=set(),
        config=SimpleNamespace(max_inflight_requests=1000, max_inflight_bytes=1 << 30,
                               max_request_bytes=100 << 20))
    return Connection(broker), got  # type: ignore[arg-type]


def _receive(conn: Connection, bursts: list[bytes]) -> tuple[int, int]:
    """Hand ``bursts`` to the connection as libuv reads a socket they arrive on one by one:
    each read gets what the buffer offered holds (or the rest of the burst); after a read that
    filled its buffer libuv reads again, an EAGAIN read when the burst is used up (the buffer
    asked for and not filled). Returns the number of reads that brought bytes and the bytes
    read into the read buffer (not straight into a frame)."""
    reads = into_read_buffer = 0
    for data in bursts:
        while True:
            buf = conn.get_buffer(-1)
            if not data:
                break                          # EAGAIN: buffer_updated is not called
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            if conn._frame is None:
                into_read_buffer += n
            conn.buffer_updated(n)
            data = data[n:]
            reads += 1
            if n < len(buf):
                break                          # a short read: libuv waits for epoll
    return reads, into_read_buffer


async def test_back_to_back_large_frames_are_copied_once(monkeypatch):
    conn, got = _connection(monkeypatch)
    conn.transport = Transport()  # type: ignore[assignment]
    sizes = [3 * DIRECT_FRAME + 17 * i for i in range(6)]
    frames = [_frame(size, i + 1) for i, size in enumerate(sizes)]
    # all in one burst, and then each frame alone (the loop faster than the client)
    reads, into_read_buffer = _receive(conn, [b"".join(frames[:3])] + frames[3:])
    for _ in range(3):
        await asyncio.sleep(0)
    assert got == [f[4:] for f in frames]
    # (then copied into their frame): the first frame's first read is a whole read buffer,
    # every later one only its header
    assert into_read_buffer <= INITIAL_BUFFER + (len(frames) - 1) * HEAD_READ
    assert reads == 2 * len(frames)        # one head read + the rest: no read more than before


async def test_small_frames_after_a_large_one_are_all_read(monkeypatch):
    """The short read after a large frame may hold several small frames, or a part of one."""
    conn, got = _connection(monkeypatch)
    conn.transport = Transport()  # type: ignore[assignment]
    frames = [_frame(2 * DIRECT_FRAME, 1)] + [_frame(300 + i, i + 2) for i in range(40)] \
        + [_frame(2 * DIRECT_FRAME, 99), _frame(5000, 100)]
    _receive(conn, [b"".join(frames)])
    for _ in range(3):
        await asyncio.sleep(0)
    assert got == [f[4:] for f in frames]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_large_frames_over_a_socket(monkeypatch, loop_kind):
    """The same over a real socket on both event loops: every frame arrives whole."""
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    frames = [_frame(DIRECT_FRAME + 4099 * i, i + 1) for i in range(8)] + [_frame(50, 77)]
    data = b"".join(frames)

    async def main() -> list[bytes]:
        conn, got = _connection(monkeypatch)
        srv = await loop.create_server(lambda: conn, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                s.recv(1)                      # until the broker closes
        t = threading.Thread(target=send)
        t.start()
        while len(got) < len(frames):
            await asyncio.sleep(0.01)
        conn.close()
        await asyncio.to_thread(t.join)
        srv.close()
        return got

    try:
        got = loop.run_until_complete(main())
    finally:
        loop.close()
    assert got == [f[4:] for f in frames]


def _answered(w: Wire, corr: int, version: int) -> None:
    got, resp = parse_response(0, version, w.recv_frame())
    assert got == corr
    assert [p.error_code for t in resp.responses for p in t.partition_responses] == [0]


def test_a_produce_whose_header_arrives_in_pieces_is_still_placed(broker_factory):
    topic = "pieces"
    _b, w, mport = broker_with_topic(broker_factory, topic)
    frames = [produce_v3(10, topic, [(0, batch(300, 1000))]),
              produce_v9(11, topic, 0, batch(200, 1500))]
    for corr, frame in enumerate(frames, 10):
        w.send(frame[:12])                     # its size and the header's first bytes alone
        time.sleep(0.2)
        w.send(frame[12:])
        _answered(w, corr, frame[7])
    # and three back to back in one write: the last two after a large frame (short reads)
    w.send(b"".join(produce_v3(20 + i, topic, [(0, batch(100 + i, 1000))]) for i in range(3)))
    for i in range(3):
        _answered(w, 20 + i, 3)
    assert metric_at(mport, "s3kafka_wal_placed_records_total") == 5
    w.close()
