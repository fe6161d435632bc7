"""How many writes the WAL keeps in flight: eager_writes at once, spare IO threads only when
sealed blocks back up (every woken thread costs the event loop a GIL hand-off)."""
from __future__ import annotations

import threading
import time

import pytest

from storage.wal import WALConfig


class SlowWrites:
    """Wraps Device.writev: each write takes `delay` seconds; records the most in flight."""

    def __init__(self, dev, delay: float) -> None:
        self._writev = dev.writev
        self.delay = delay
        self.inflight = 0
        self.most = 0
        self.lock = threading.Lock()

    def __call__(self, bufs, position):
        with self.lock:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        try:
            time.sleep(self.delay)
            return self._writev(bufs, position)
        finally:
            with self.lock:
                self.inflight -= 1


def test_light_load_keeps_eager_writes_and_a_backlog_calls_the_spares(make_wal):
    w, _ = make_wal(io_threads=4, eager_writes=2, block_soft_limit=4096,
                    max_write_bytes=64 << 10, capacity=8 << 20)
    slow = SlowWrites(w._device, 0.05)
    w._device.writev = slow
    body = bytes(range(256)) * 16                 # one record fills one 4 KiB-class block
    # light load: three blocks, each sealed and taken before the next (10 ms apart, writes
    # take 50 ms, so nothing merges); only two writes may run at once
    light = []
    for i in range(3):
        light.append(w.append(body[:4000], stream_id=i))
        time.sleep(0.01)
    for r in light:
        r.future.result(10)
    assert slow.most == 2
    # a backlog of more than max_write_bytes while both eager writes run: spares join in
    slow.most = 0
    heavy = [w.append(body[:4000], stream_id=i % 5) for i in range(80)]
    for r in heavy:
        r.future.result(10)
    assert slow.most > 2
    w.close()
    _, recs = make_wal(io_threads=4, capacity=8 << 20)
    assert [o for o, _ in recs] == [r.offset for r in light + heavy]
    assert all(b == body[:4000] for _, b in recs)


def test_one_thread_per_write_when_all_are_eager(make_wal):
    w, _ = make_wal(io_threads=3, eager_writes=3, block_soft_limit=4096, capacity=8 << 20)
    slow = SlowWrites(w._device, 0.05)
    w._device.writev = slow
    rs = []
    for i in range(3):                            # 10 ms apart: three separate writes
        rs.append(w.append(bytes(4000), stream_id=i))
        time.sleep(0.01)
    for r in rs:
        r.future.result(10)
    assert slow.most == 3


def test_eager_writes_must_be_positive(wal_path):
    with pytest.raises(ValueError, match="eager_writes"):
        WALConfig(path=wal_path, eager_writes=0).validate()
