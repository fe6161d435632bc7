"""Shared helpers for the storage tests: small engine configs and payload checks."""
from __future__ import annotations

import pathlib

from storage.engine import EngineConfig
from storage.stream import Stream


def small_config(data_dir: pathlib.Path, **kw) -> EngineConfig:
    """An engine config with tiny thresholds so uploads/compaction happen within a test."""
    base = dict(data_dir=str(data_dir), wal_capacity=8 << 20, log_cache_bytes=4 << 20,
                block_cache_bytes=1 << 20, upload_threshold_bytes=64 << 10,
                upload_interval_s=0.2, stream_object_threshold_bytes=256 << 10,
                object_block_bytes=16 << 10, compaction_interval_s=3600,
                cleanup_interval_s=3600, backpressure_timeout_s=0.5,
                wal_sync_mode="fdatasync")
    base.update(kw)
    return EngineConfig(**base)


def payload(stream_id: int, base: int, size: int = 300) -> bytes:
    """Deterministic bytes for (stream, offset) so reads can be checked exactly."""
    head = f"s{stream_id}o{base}:".encode()
    return (head * (size // len(head) + 1))[:size]


async def fill(stream: Stream, n: int, count: int = 5, size: int = 300) -> None:
    """Append n payloads of ``count`` offsets each."""
    for _ in range(n):
        await stream.append(payload(stream.stream_id, stream.end_offset, size),
                            stream.end_offset, count)


async def read_all(stream: Stream, start: int = 0, max_bytes: int = 64 << 10) -> list:
    """Every batch from start to the confirmed offset, checking contiguity and contents."""
    out = []
    off = start
    while off < stream.confirmed_offset:
        batches = await stream.read(off, max_bytes)
        assert batches, f"no data at {off}"
        for b in batches:
            assert b.base_offset <= off < b.next_offset or b.base_offset == off
            assert bytes(b.payload) == payload(stream.stream_id, b.base_offset, len(b.payload))
            off = b.next_offset
            out.append(b)
    return out
