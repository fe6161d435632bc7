"""How many writes the WAL keeps in flight: eager_writes at once, spare IO threads only when
sealed blocks back up (every woken thread costs the event loop a GIL hand-off).

The device's writes wait at a gate the test opens, so what is in flight at each step is decided
by the test, not by how fast a loaded machine runs it: with writes of a fixed 50 ms and appends
10 ms apart, a descheduled test thread let the first write end before the third began, or two
blocks merged into one write (a suite run at load 8 saw ``most == 3`` fail, session 33)."""
from __future__ import annotations

import threading
import time

import pytest

from storage.wal import WALConfig

WAIT_S = 30.0           # generous: for a state a correct WAL reaches at once
SETTLE_S = 0.1          # time given to a wrong extra write to show itself (never to a right one)


class GatedWrites:
    """Replaces the WAL's Device.writev: each write waits until `gate` is set (at most WAIT_S);
    records how many are in flight and the most at once. A context manager that opens the
    gate on the way out, so a failing test closes its WAL at once."""

    def __init__(self, wal) -> None:
        self._writev = wal._device.writev
        wal._device.writev = self
        self.gate = threading.Event()
        self.inflight = 0
        self.most = 0
        self._cond = threading.Condition()

    def __enter__(self) -> "GatedWrites":
        return self

    def __exit__(self, *exc) -> None:
        self.gate.set()

    def __call__(self, bufs, position):
        with self._cond:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            self._cond.notify_all()
        try:
            self.gate.wait(WAIT_S)
            return self._writev(bufs, position)
        finally:
            with self._cond:
                self.inflight -= 1

    def reached(self, n: int) -> bool:
        """Wait (up to WAIT_S) until n writes are in flight at once; False if they never are."""
        with self._cond:
            return self._cond.wait_for(lambda: self.inflight >= n, WAIT_S)


def append_one_write_each(w, gated: GatedWrites, bodies: list[bytes]) -> list:
    """Append each body once the one before is in its own write (nothing merges)."""
    results = []
    for i, body in enumerate(bodies):
        results.append(w.append(body, stream_id=i))
        assert gated.reached(i + 1), f"append {i + 1} did not get a write of its own"
    return results


def test_light_load_keeps_eager_writes_and_a_backlog_calls_the_spares(make_wal):
    w, _ = make_wal(io_threads=4, eager_writes=2, block_soft_limit=4096,
                    max_write_bytes=64 << 10, capacity=8 << 20)
    body = bytes(range(256)) * 16                 # one record fills one 4 KiB-class block
    with GatedWrites(w) as gated:
        # light load: two blocks, each in its own write, both writes held; a third block must
        # wait for one of them: only two writes may run at once
        light = append_one_write_each(w, gated, [body[:4000]] * 2)
        light.append(w.append(body[:4000], stream_id=2))
        time.sleep(SETTLE_S)
        assert gated.inflight == 2
        gated.gate.set()
        for r in light:
            r.future.result(WAIT_S)
        assert gated.most == 2
        # a backlog of more than max_write_bytes while both eager writes run: spares join in
        gated.gate.clear()
        gated.most = 0
        heavy = [w.append(body[:4000], stream_id=i % 5) for i in range(80)]
        assert gated.reached(3), "no spare IO thread joined the two eager writes"
        gated.gate.set()
        for r in heavy:
            r.future.result(WAIT_S)
        assert gated.most > 2
    w.close()
    _, recs = make_wal(io_threads=4, capacity=8 << 20)
    assert [o for o, _ in recs] == [r.offset for r in light + heavy]
    assert all(b == body[:4000] for _, b in recs)


def test_one_thread_per_write_when_all_are_eager(make_wal):
    w, _ = make_wal(io_threads=3, eager_writes=3, block_soft_limit=4096, capacity=8 << 20)
    with GatedWrites(w) as gated:
        rs = append_one_write_each(w, gated, [bytes(4000)] * 3)     # three writes at once
        gated.gate.set()
        for r in rs:
            r.future.result(WAIT_S)
    assert gated.most == 3


def test_eager_writes_must_be_positive(wal_path):
    with pytest.raises(ValueError, match="eager_writes"):
        WALConfig(path=wal_path, eager_writes=0).validate()
