"""A stream deleted while an upload holds its entries (issue 20's streamed puts read each
object's payloads while they write it): the upload in flight must not see them released."""
from __future__ import annotations

import asyncio
import threading

from storage.engine import open_engine

from storage_helpers import fill, read_all, small_config


async def test_a_stream_deleted_during_its_put_does_not_fail_the_upload(tmp_path) -> None:
    eng = open_engine(small_config(tmp_path, wal_capacity=64 << 20, log_cache_bytes=32 << 20,
                                   upload_threshold_bytes=64 << 20, upload_interval_s=3600,
                                   stream_object_threshold_bytes=1 << 30))
    await eng.start()
    release = threading.Event()
    real_put = eng.store.put
    started: list[str] = []

    def put(key, data):            # the first put waits until the delete was asked for
        started.append(key)
        release.wait(30)
        real_put(key, data)
    eng.store.put = put
    # as the broker's frame pool does: an evicted entry's payload is released at once
    eng.cache.recycle = lambda box: box.pop()
    try:
        a = await eng.create_stream()
        b = await eng.create_stream()
        await fill(a, 50, size=3000)
        await fill(b, 50, size=3000)
        flush = asyncio.ensure_future(eng.flush())
        for _ in range(500):
            if started:
                break
            await asyncio.sleep(0.01)
        assert started, "the upload never reached its put"
        delete = asyncio.ensure_future(eng.delete_stream(a.stream_id))
        await asyncio.sleep(0.1)                 # the delete runs while the put waits
        release.set()
        await asyncio.wait_for(asyncio.gather(flush, delete), 30)
        assert eng.upload_errors == 0            # the put encoded a's payloads intact
        assert eng.stats.uploads >= 1
        eng.drop_caches()
        assert len(await read_all(b)) == 50
    finally:
        release.set()
        await eng.close()
