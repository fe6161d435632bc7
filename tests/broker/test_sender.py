"""Large answers are written to their socket by a sender thread (broker/sender.py), in order.

The kernel's send of a multi-MiB Fetch answer was ~87 % of the broker's CPU under hot raw
Fetch, all on the event loop; a sender thread runs it beside the loop. These tests use real
sockets: the bytes the peer reads are the answers, whole and in request order, whether the
socket takes them at once, stalls (the peer stops reading), or the connection goes away."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from broker.sender import OFFLOAD_MIN, byte_views, send_some, sender_pool
from broker.server import Connection


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    return a, b


def test_send_some_writes_every_view_in_order_empty_ones_included() -> None:
    """An empty view (an answer's empty records) is passed over: writev returns 0 for it
    alone, which once left the thread looping on it forever."""
    a, b = _pair()
    with a, b:
        rest = send_some(a.fileno(), byte_views([b"", b"abc", memoryview(b""), bytearray(b"de"),
                                                 b""]))
        assert rest == []
        assert b.recv(16) == b"abcde"


def test_send_some_hands_back_what_a_stalled_socket_did_not_take() -> None:
    a, b = _pair()
    with a, b:
        data = bytes(range(256)) * (32 << 12)         # 8 MiB: more than the socket holds
        rest = send_some(a.fileno(), byte_views([b"head", data]))
        left = b"".join(bytes(v) for v in rest)
        assert 0 < len(left) < len(data)
        b.setblocking(False)
        got = bytearray()
        while True:
            try:
                chunk = b.recv(1 << 20)
            except BlockingIOError:
                break
            got += chunk
        assert bytes(got) + left == b"head" + data


def test_send_some_raises_when_the_peer_is_gone() -> None:
    a, b = _pair()
    with a:
        b.close()
        with pytest.raises(OSError):
            send_some(a.fileno(), byte_views([b"x" * 1024]))


def test_no_sender_threads_on_one_cpu() -> None:
    assert sender_pool(1) is None
    pool = sender_pool(2)
    assert pool is not None
    pool.shutdown()


class CountingPool(ThreadPoolExecutor):
    """The broker's sender pool, counting what it was given."""

    def __init__(self) -> None:
        super().__init__(max_workers=2, thread_name_prefix="test-send")
        self.sends = 0

    def submit(self, fn, /, *args, **kwargs):
        self.sends += 1
        return super().submit(fn, *args, **kwargs)


async def _connection(pool: CountingPool | None) -> tuple[Connection, socket.socket]:
    """A Connection on one end of a real socket pair (the loop's transport), a stand-in
    broker with ``pool`` as its sender threads; the other end for the test to read."""
    ours, peer = socket.socketpair()
    broker = SimpleNamespace(_connection_idle=lambda: None, hot_traffic=lambda: True,
                             sender=pool, connections=set(),
                             request_stats=SimpleNamespace(connections_opened=0),
                             config=SimpleNamespace(max_inflight_requests=100))
    conn = Connection(broker)  # type: ignore[arg-type]
    await asyncio.get_running_loop().connect_accepted_socket(lambda: conn, ours)
    return conn, peer


@contextlib.asynccontextmanager
async def _counted_connection():
    """``_connection`` with a CountingPool, closed and shut down afterwards."""
    pool = CountingPool()
    conn, peer = await _connection(pool)
    try:
        yield conn, peer, pool
    finally:
        conn.close()
        peer.close()
        pool.shutdown()


async def _read(peer: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    peer.setblocking(False)
    got = bytearray()
    while len(got) < n:
        got += await loop.sock_recv(peer, n - len(got))
    return bytes(got)


async def _until_idle(conn: Connection) -> None:
    while not conn.idle:
        await asyncio.sleep(0.01)


async def test_a_large_answer_goes_out_on_a_sender_thread_and_the_next_waits_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer starts reading only after the three writes: on a loaded machine that can take
    longer than the 10 ms after which a thread gives a stalled socket back to the transport
    (then one send, not two: CI saw it), so here a stall is 5 s."""
    monkeypatch.setattr("broker.sender.STALL_S", 5.0)
    big = bytes(range(256)) * (OFFLOAD_MIN // 128)          # 2 MiB
    async with _counted_connection() as (conn, peer, pool):
        conn._write([b"head", memoryview(big)])
        conn._write([b"small answer"])                      # queued behind the big one
        conn._write([memoryview(big), b"tail"])             # and a second large one
        want = b"head" + big + b"small answer" + big + b"tail"
        assert await _read(peer, len(want)) == want
        await _until_idle(conn)
        assert pool.sends == 2


async def test_what_a_stalled_peer_did_not_take_goes_through_the_transport_in_order() -> None:
    """A consumer that stops reading does not hold a sender thread: the rest of its answer
    (and what queued behind it) goes to the transport, which waits for room on the loop."""
    big = bytes(range(256)) * (32 << 12)                    # 8 MiB: more than the socket holds
    async with _counted_connection() as (conn, peer, pool):
        conn._write([memoryview(big)])
        conn._write([b"after"])
        while conn._sending:
            await asyncio.sleep(0.01)                       # the thread gave up on the socket
        assert conn.transport.get_write_buffer_size() > 0   # the rest is the transport's
        assert await _read(peer, len(big) + 5) == big + b"after"
        await _until_idle(conn)
        assert pool.sends == 1


async def test_a_connection_lost_during_a_send_closes_the_thread_s_descriptor_after_it() -> None:
    pool = CountingPool()
    conn, peer = await _connection(pool)
    try:
        conn._write([b"z" * (8 << 20)])
        fd = conn._send_fd
        assert conn._sending and fd >= 0
        conn.transport.abort()
        peer.close()
        while conn._sending or not conn._lost:
            await asyncio.sleep(0.01)
        assert conn._send_fd == -1
        with pytest.raises(OSError):
            os.fstat(fd)
    finally:
        pool.shutdown()


async def test_without_a_pool_large_answers_go_to_the_transport() -> None:
    conn, peer = await _connection(None)
    big = b"q" * (2 * OFFLOAD_MIN)
    try:
        conn._write([big])
        assert not conn._sending and conn._send_fd == -1
        assert await _read(peer, len(big)) == big
    finally:
        conn.close()
        peer.close()
