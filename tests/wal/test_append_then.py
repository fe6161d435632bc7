"""append_loop(then=...): a plain callback instead of a future per record (the engine's
task-less produce path, EngineStream.append_now). The same promises as the future: called
once the record and every earlier one of its stream are durable, in order per stream, with
the write's error for exactly the records a failed write held; on the loop's own AIO it runs
in the call that completes the write (no future, no done callback, no loop iteration)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from storage.wal import WALError
from wal_probes import flag_completions

from .test_loop_aio import body, reopen


async def _until(cond, turns: int = 100_000) -> None:
    """Let the loop run until cond() (no wall-clock bound: the test's own timeout is it)."""
    for _ in range(turns):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never met")


async def test_then_runs_in_the_completion_of_the_write_in_order_per_stream(make_wal,
                                                                            wal_path):
    w, _ = make_wal(capacity=16 << 20, block_soft_limit=4096)
    assert w.attach_loop()
    driver = w._driver
    completing = flag_completions(driver)
    seen: list[tuple[int, int, object, bool]] = []
    recs = [(i % 3, body(i % 3, i, 100 + (i * 7919) % 9000)) for i in range(300)]
    results = []
    for k, (s, b) in enumerate(recs):
        r = w.append_loop(b, stream_id=s,
                          then=lambda off, exc, k=k: seen.append((k, off, exc, completing[0])))
        assert r.future is None
        results.append(r)
    await _until(lambda: len(seen) == len(recs))
    assert all(exc is None for _k, _off, exc, _c in seen)
    assert all(inside for *_rest, inside in seen)        # in the completing call itself
    assert sorted(k for k, *_ in seen) == list(range(len(recs)))   # each exactly once
    for k, off, _exc, _c in seen:
        assert off == results[k].offset
    for s in range(3):                                   # in order per stream
        mine = [k for k, *_ in seen if recs[k][0] == s]
        assert mine == sorted(mine)
    w.close()
    assert [b for _o, b in reopen(wal_path, 16 << 20)] == [b for _s, b in recs]


async def test_then_runs_on_the_loop_when_io_threads_write(make_wal):
    w, _ = make_wal(io_engine="threads", block_soft_limit=4096)
    loop_thread = threading.get_ident()
    seen: list[tuple[int, int]] = []
    for i in range(50):
        w.append_loop(body(0, i), then=lambda off, exc, i=i: seen.append(
            (i, threading.get_ident())) if exc is None else None)
    await _until(lambda: len(seen) == 50)
    assert seen == [(i, loop_thread) for i in range(50)]


async def test_a_failed_write_calls_then_with_its_error_for_its_records_only(make_wal,
                                                                             wal_path):
    w, _ = make_wal()
    assert w.attach_loop()
    driver = w._driver
    got: dict[bytes, object] = {}
    w.append_loop(b"kept", then=lambda off, exc: got.__setitem__(b"kept", exc))
    await _until(lambda: b"kept" in got)

    def broken(*a, **kw):
        raise OSError(5, "injected EIO")

    driver.aio.submit_write = broken
    for name in (b"lost1", b"lost2"):
        w.append_loop(name, then=lambda off, exc, n=name: got.__setitem__(n, exc))
    await _until(lambda: len(got) == 3)
    assert got[b"kept"] is None
    assert isinstance(got[b"lost1"], WALError) and isinstance(got[b"lost2"], WALError)
    w.close()
    assert [b for _, b in reopen(wal_path)] == [b"kept"]


async def test_a_raising_then_does_not_stop_the_records_after_it(make_wal, caplog):
    w, _ = make_wal()
    assert w.attach_loop()
    seen: list[int] = []

    def bad(off, exc):
        raise RuntimeError("callback bug")

    w.append_loop(b"a", then=bad)
    for i in range(3):
        w.append_loop(b"b%d" % i, then=lambda off, exc, i=i: seen.append(i))
    await _until(lambda: len(seen) == 3)
    assert seen == [0, 1, 2]
    assert "WAL completion callback failed" in caplog.text


async def test_a_then_that_stops_the_wal_fails_the_records_behind_it(make_wal):
    """A completion callback that stops the WAL (as check_fenced does once another node took
    it over) re-enters the completion drain on the same thread: the records not yet written
    get the error from the drain already running instead of deadlocking on its lock."""
    w, _ = make_wal(flush_interval_s=30.0)     # the second block is never sealed by time
    assert w.attach_loop()
    calls: list[tuple[str, object]] = []

    def first(off, exc):
        calls.append(("first", exc))
        w._fail(OSError(5, "stopped from a callback"))

    w.append_loop(b"first", then=first)         # sealed at once (no seal before it)
    await asyncio.sleep(0)                      # the kick submits it
    w.append_loop(b"behind", then=lambda off, exc: calls.append(("behind", exc)))
    await _until(lambda: len(calls) == 2)
    assert calls[0] == ("first", None)
    assert calls[1][0] == "behind" and isinstance(calls[1][1], WALError)
    with pytest.raises(Exception):
        w.append_loop(b"refused")


async def test_completions_on_the_drivers_loop_ask_asyncio_for_no_running_loop(make_wal,
                                                                               monkeypatch):
    """The loop's own AIO completions run their callbacks directly without asking asyncio
    which loop runs (asyncio._get_running_loop() is a getpid() syscall per call in 3.11)."""
    w, _ = make_wal()
    assert w.attach_loop()
    asked: list[int] = []
    real = asyncio._get_running_loop

    def counting():
        asked.append(1)
        return real()

    done: list[int] = []
    monkeypatch.setattr(asyncio, "_get_running_loop", counting)
    w.append_loop(b"x" * 100, then=lambda off, exc: done.append(off))
    asked.clear()                               # the append itself may look it up
    await _until(lambda: bool(done))
    assert asked == []


@pytest.mark.parametrize("native", [True, False], ids=["copycrc", "python-copy"])
async def test_a_flat_engine_body_is_the_record_prepare_made_of_it(make_wal, wal_path,
                                                                    monkeypatch, native):
    """append_loop(flat=True): the engine's (header, payload) pair - bytes header, bytes or
    flat byte-view payload - placed without DeltaWAL._prepare, is the record the pair makes
    through _prepare (recovery reads the same bodies, their CRCs check); without the fused
    copy-and-CRC (pure-Python copy) flat changes nothing: _prepare computes the CRC."""
    if not native:
        monkeypatch.setattr("storage.wal.wal.COPY_CRC_NATIVE", False)
    w, _ = make_wal(capacity=16 << 20)
    assert w.attach_loop()
    pairs = []
    for i in range(40):
        payload = body(0, i, 50 + 397 * i)
        pairs.append((b"head%03d" % i, payload if i % 2 else memoryview(bytearray(payload))))
    done: list[object] = []
    for i, pair in enumerate(pairs):
        w.append_loop(pair, then=lambda off, exc: done.append(exc), flat=i % 3 != 0)
    await _until(lambda: len(done) == len(pairs))
    assert done == [None] * len(pairs)
    w.close()
    assert [b for _o, b in reopen(wal_path, 16 << 20)] == [h + bytes(p) for h, p in pairs]
