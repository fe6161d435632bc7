"""Background uploads of small records write their objects gently: small device pieces, one
put at a time (the WAL writes of latency-sensitive small appends queue behind less object
data); uploads of large records and uploads something waits for keep full pieces and two
puts in flight."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from storage.engine import open_engine

from storage_helpers import fill, read_all, small_config


def _watch_puts(eng, monkeypatch, delay: float = 0.05):
    """(sizes of the object-store file writes, most puts seen in flight at once); each put
    takes ``delay`` longer (a slower store: the next put starts meanwhile)."""
    from storage.objects import store as store_mod
    writes: list[int] = []
    real_write = store_mod.os.write

    def write(fd, data):
        n = real_write(fd, data)
        writes.append(n)
        return n
    monkeypatch.setattr(store_mod.os, "write", write)
    real_pieces = store_mod._write_pieces
    if real_pieces is not None:     # the native O_DIRECT writes: full pieces, then the rest

        def pieces(fd, data, chunk, align):
            n = real_pieces(fd, data, chunk, align)
            writes.extend([chunk] * (n // chunk) + ([n % chunk] if n % chunk else []))
            return n
        monkeypatch.setattr(store_mod, "_write_pieces", pieces)
    lock = threading.Lock()
    state = {"now": 0, "most": 0}
    real_put = eng.store.put

    def put(key, data):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        try:
            real_put(key, data)
            time.sleep(delay)
        finally:
            with lock:
                state["now"] -= 1
    eng.store.put = put
    return writes, state


@pytest.mark.parametrize("case", ["small-background", "large-background", "small-forced"])
async def test_background_uploads_of_small_records_write_gently(tmp_path, monkeypatch,
                                                                case) -> None:
    import storage.engine as engine_mod
    from storage.objects import store as store_mod
    monkeypatch.setattr(engine_mod, "OBJECT_SPLIT_BYTES", 1 << 20)   # several objects
    size = 16 << 10 if case.startswith("small") else 128 << 10   # NOGIL_COPY_FROM 64 KiB
    cfg = small_config(tmp_path, wal_capacity=64 << 20, log_cache_bytes=64 << 20,
                       upload_threshold_bytes=3 << 20, upload_interval_s=3600,
                       object_block_bytes=64 << 10)
    eng = open_engine(cfg)
    await eng.start()
    try:
        for _ in range(300):                 # start-up's forced (recovery) round is over
            if not eng._force_upload:
                break
            await asyncio.sleep(0.01)
        writes, puts = _watch_puts(eng, monkeypatch)
        s = await eng.create_stream()
        n = (3 << 20) // size + 64          # just past the threshold: a background upload
        if case == "small-forced":
            await fill(s, n // 2, count=1, size=size)
            await eng.flush()                # a drain: something waits for it
        else:
            await fill(s, n, count=1, size=size)
            for _ in range(500):
                if eng.stats.uploaded_bytes >= 2 << 20:
                    break
                await asyncio.sleep(0.01)
        assert eng.stats.uploaded_bytes >= (2 << 20 if case != "small-forced" else 1 << 20)
        big = [w for w in writes if w > 4096]
        if case == "small-background":
            assert max(big) == store_mod.GENTLE_WRITE_CHUNK < store_mod.FILE_WRITE_CHUNK
            assert puts["most"] == 1
        else:
            assert max(big) == store_mod.FILE_WRITE_CHUNK
            assert puts["most"] == 2
        assert len(await read_all(s, max_bytes=1 << 20)) == s.confirmed_offset
    finally:
        await eng.close()


async def test_uploads_that_appends_wait_on_write_more_puts_at_once(tmp_path,
                                                                     monkeypatch) -> None:
    """Appends waiting for cache room (producers back-pressured): the upload is what they wait
    on, so it keeps URGENT_PUTS_IN_FLIGHT puts in flight, not PUTS_IN_FLIGHT."""
    import storage.engine as engine_mod
    monkeypatch.setattr(engine_mod, "OBJECT_SPLIT_BYTES", 1 << 20)   # several objects
    assert engine_mod.URGENT_PUTS_IN_FLIGHT > engine_mod.PUTS_IN_FLIGHT
    cfg = small_config(tmp_path, wal_capacity=128 << 20, log_cache_bytes=16 << 20,
                       upload_threshold_bytes=64 << 20, upload_interval_s=3600,
                       object_block_bytes=64 << 10, backpressure_timeout_s=30)
    eng = open_engine(cfg)
    await eng.start()
    try:
        writes, puts = _watch_puts(eng, monkeypatch, delay=0.2)   # appends outrun uploads
        s = await eng.create_stream()
        await fill(s, 192, count=1, size=128 << 10)    # 24 MiB through a 16 MiB cache
        assert eng.stats.backpressure_waits["cache_full"] > 0
        await eng.flush()
        assert puts["most"] == engine_mod.URGENT_PUTS_IN_FLIGHT
        assert len(await read_all(s, max_bytes=1 << 20)) == s.confirmed_offset
    finally:
        await eng.close()
