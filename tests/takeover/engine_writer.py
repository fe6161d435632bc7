"""Child process: an engine (node 1) appending to several streams with frequent uploads and a
small WAL (it wraps), until killed. Prints `S <sid>` per stream, then `A <sid> <base> <count>`
only after an append's future completed (acknowledged).
Usage: engine_writer.py <data dir> <meta url> <store url> <wal capacity> <streams> <seed>"""
from __future__ import annotations

import asyncio
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from storage.engine import EngineConfig, open_engine  # noqa: E402
from takeover_helpers import payload  # noqa: E402


async def main() -> None:
    data_dir, meta_url, store_url, cap, nstreams, seed = sys.argv[1:7]
    eng = open_engine(EngineConfig(
        data_dir=data_dir, metadata_url=meta_url, object_store=store_url, node_id=1,
        node_epoch=3, wal_capacity=int(cap), log_cache_bytes=8 << 20,
        upload_threshold_bytes=48 << 10, upload_interval_s=0.05, object_block_bytes=16 << 10,
        compaction_interval_s=3600, cleanup_interval_s=3600, wal_sync_mode="fdatasync",
        backpressure_timeout_s=5))
    await eng.start()
    rng = random.Random(int(seed))
    streams = [await eng.create_stream() for _ in range(int(nstreams))]
    for s in streams:
        os.write(1, f"S {s.stream_id}\n".encode())

    async def writer(s) -> None:
        while True:
            base, count = s.end_offset, rng.randrange(1, 4)
            fut = s.append(payload(s.stream_id, base), base, count)
            await fut
            os.write(1, f"A {s.stream_id} {base} {count}\n".encode())
            if rng.random() < 0.3:
                await asyncio.sleep(0.001)

    await asyncio.gather(*(writer(s) for s in streams))


asyncio.run(main())
