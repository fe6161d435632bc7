"""The upload's per-object chain (prepare the metadata row, encode, put) keeps the puts busy:
while appends wait on the upload the next object's row is prepared while this one is encoded,
and a put that ends frees its slot for the next object whichever put started first (real files, a real SQLite metastore)."""
from __future__ import annotations

import threading
import time

from storage.engine import open_engine

from storage_helpers import fill, read_all, small_config

MIB = 1 << 20


def _config(tmp_path, log_cache_bytes: int = 64 << 20):
    # large records (encoded on an IO thread), a background upload of several 1 MiB objects
    return small_config(tmp_path, wal_capacity=64 << 20, log_cache_bytes=log_cache_bytes,
                        upload_threshold_bytes=6 << 20, upload_interval_s=3600,
                        object_block_bytes=64 << 10)


class _Spans:
    """Start and end of each call of the wrapped functions, by name (any thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, float, float]] = []

    def wrap(self, name, fn, delay=0.0, first_delay=None):
        calls = []

        def run(*args, **kw):
            with self.lock:
                calls.append(None)
                n = len(calls)
            t0 = time.monotonic()
            out = fn(*args, **kw)
            time.sleep(first_delay if n == 1 and first_delay is not None else delay)
            with self.lock:
                self.spans.append((name, t0, time.monotonic()))
            return out
        return run

    def of(self, name):
        return sorted((a, b) for n, a, b in self.spans if n == name)


async def _upload_some(eng) -> None:
    s = await eng.create_stream()
    await fill(s, 8, count=1, size=MIB - 4096)       # 8 objects of one record each
    await eng.flush()
    assert len(await read_all(s, max_bytes=2 * MIB)) == s.confirmed_offset


async def test_the_next_row_is_prepared_while_an_object_is_encoded(tmp_path,
                                                                   monkeypatch) -> None:
    """... while appends wait on the upload: its 7 MiB taken fill over half of a 12 MiB
    LogCache (Engine._upload_urgent)."""
    import storage.engine as engine_mod
    monkeypatch.setattr(engine_mod, "OBJECT_SPLIT_BYTES", 1 << 20)
    eng = open_engine(_config(tmp_path, log_cache_bytes=12 << 20))
    await eng.start()
    try:
        spans = _Spans()
        eng.meta.prepare_object = spans.wrap("prepare", eng.meta.prepare_object, 0.05)
        monkeypatch.setattr(engine_mod, "encode_object_into",
                            spans.wrap("encode", engine_mod.encode_object_into, 0.05))
        # a file:// put of a StreamEncoder encodes the object while it writes it
        eng.store.put = spans.wrap("encode", eng.store.put, 0.05)
        await _upload_some(eng)
        prepares, encodes = spans.of("prepare"), spans.of("encode")
        assert len(encodes) >= 6
        # some prepare ran while an encode did (one chain: never, without the look-ahead)
        assert any(a < e1 and e0 < b for a, b in prepares for e0, e1 in encodes)
    finally:
        await eng.close()


async def test_a_slow_put_does_not_hold_the_slots_of_later_ones(tmp_path, monkeypatch) -> None:
    import storage.engine as engine_mod
    monkeypatch.setattr(engine_mod, "OBJECT_SPLIT_BYTES", 1 << 20)
    eng = open_engine(_config(tmp_path))
    await eng.start()
    try:
        spans = _Spans()
        eng.store.put = spans.wrap("put", eng.store.put, 0.0, first_delay=1.0)
        await _upload_some(eng)
        puts = spans.of("put")
        assert len(puts) >= 6
        first = puts[0]
        # with two slots, the later objects went through the other slot meanwhile (waiting
        # for the oldest put first: one at most)
        assert sum(1 for a, b in puts[1:] if b < first[1]) >= 3
    finally:
        await eng.close()
