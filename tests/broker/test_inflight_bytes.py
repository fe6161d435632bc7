"""A connection stops reading while the large request frames it has not answered yet hold
``max_inflight_bytes`` (besides ``max_inflight_requests``), and reads again once answers free
them: a producer of ~1 MiB requests then waits in its own queue, not in the broker's
(bench/HISTORY.md, session 18). Driven through a Connection with a recording transport and a
stand-in API whose answers the test releases."""
from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace

from broker import server
from broker.frames import FramePool
from broker.metrics import RequestStats
from broker.server import DIRECT_FRAME, Connection

API = 9999


class Transport:
    def __init__(self) -> None:
        self.paused = False
        self.pauses = 0

    def is_closing(self) -> bool:
        return False

    def writelines(self, bufs) -> None:
        pass

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False


def _connection(monkeypatch, max_bytes: int) -> tuple[Connection, Transport, list]:
    answers: list[asyncio.Future] = []

    async def handler(ctx, request):
        fut = asyncio.get_running_loop().create_future()
        answers.append(fut)
        await fut
        return None                        # nothing to write (as acks=0)

    def parse(frame):
        return SimpleNamespace(api_key=API, api_version=0, correlation_id=0,
                               client_id="t"), object()

    monkeypatch.setattr(server, "parse_request", parse)
    monkeypatch.setitem(server.HANDLERS, API, handler)
    broker = SimpleNamespace(
        _connection_idle=lambda: None, hot_traffic=lambda: False, frame_pool=FramePool(),
        request_stats=RequestStats(),
        config=SimpleNamespace(max_inflight_requests=100, max_inflight_bytes=max_bytes,
                               max_request_bytes=100 << 20))
    conn = Connection(broker)  # type: ignore[arg-type]
    t = Transport()
    conn.transport = t  # type: ignore[assignment]
    return conn, t, answers


def _receive(conn: Connection, data: bytes) -> None:
    """Hand ``data`` to the connection as the event loop would, in the buffers it asks for."""
    while data:
        buf = conn.get_buffer(len(data))
        n = min(len(buf), len(data))
        buf[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


def _frame(size: int) -> bytes:
    return struct.pack(">i", size) + bytes(size)


async def test_reading_pauses_at_the_bytes_of_unanswered_large_frames(monkeypatch):
    size = DIRECT_FRAME * 2                          # received into frames of their own
    conn, t, answers = _connection(monkeypatch, max_bytes=int(size * 2.5))
    _receive(conn, _frame(size))
    _receive(conn, _frame(size))
    assert not t.paused                              # 2 x size < the bound
    _receive(conn, _frame(size))
    assert t.paused                                  # 3 x size >= the bound: 3 requests of 100
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(answers) == 3
    answers[0].set_result(None)                      # the first answered: 2 x size left
    for _ in range(3):
        await asyncio.sleep(0)
    assert not t.paused
    assert conn._frame_bytes == 2 * size
    answers[1].set_result(None)
    answers[2].set_result(None)
    for _ in range(3):
        await asyncio.sleep(0)
    assert conn._frame_bytes == 0 and conn.idle and t.pauses == 1


async def test_small_frames_do_not_count(monkeypatch):
    """Frames below DIRECT_FRAME (copied out of the read buffer) are bounded by
    max_inflight_requests alone."""
    conn, t, answers = _connection(monkeypatch, max_bytes=1)
    _receive(conn, _frame(1000) * 5)
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(answers) == 5 and not t.paused and conn._frame_bytes == 0
    for fut in answers:
        fut.set_result(None)
    for _ in range(3):
        await asyncio.sleep(0)
    assert conn.idle


async def test_large_frames_answered_without_a_task_count_too(monkeypatch):
    """A large frame of an API with a task-less path (a 1 MiB Produce: NOW_HANDLERS) is
    handed to it alone, with its frame counted until its answer is written."""
    conn, t, _answers = _connection(monkeypatch, max_bytes=int(DIRECT_FRAME * 2 * 2.5))
    taken: list[tuple[list, list]] = []

    async def run(ctxs, reqs):   # never called: every request is taken task-less
        raise AssertionError("run handler called")

    def now(items, futs, c):
        assert len(items) == 1 and c is conn     # a pooled frame: alone
        taken.append((items, futs))
        return True

    monkeypatch.setitem(server.RUN_HANDLERS, API, (lambda req: ("k", object()), run))
    monkeypatch.setitem(server.NOW_HANDLERS, API, now)
    size = DIRECT_FRAME * 2
    for _ in range(3):
        _receive(conn, _frame(size))
    assert len(taken) == 3 and t.paused and conn._frame_bytes == 3 * size
    taken[0][1][0].set_result(None)                  # answered (nothing to write)
    conn.answered()
    for _ in range(3):
        await asyncio.sleep(0)
    assert not t.paused and conn._frame_bytes == 2 * size
    for _items, futs in taken[1:]:
        futs[0].set_result(None)
    conn.answered()
    for _ in range(3):
        await asyncio.sleep(0)
    assert conn._frame_bytes == 0 and conn.idle
