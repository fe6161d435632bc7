"""Record batches for datapath tests, built and read with kafka-python's record module.

Tests only: the broker itself never imports kafka.* (it goes through protocol/).
"""
from __future__ import annotations

import types

import cramjam
import kafka.codec
from kafka.record.memory_records import MemoryRecords, MemoryRecordsBuilder

if kafka.codec.snappy is None:
    # kafka-python wants python-snappy; cramjam (already a dependency) has the same raw codec
    kafka.codec.snappy = types.SimpleNamespace(
        compress=lambda b: bytes(cramjam.snappy.compress_raw(bytes(b))),
        decompress=lambda b: bytes(cramjam.snappy.decompress_raw(bytes(b))))

CODECS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def make_batch(values: list[bytes], *, timestamps: list[int] | None = None, codec: str = "none",
               producer_id: int = -1, epoch: int = -1, base_sequence: int = -1,
               magic: int = 2) -> bytes:
    """One batch holding ``values`` (keys None), optionally idempotent."""
    b = MemoryRecordsBuilder(magic, CODECS[codec], 1 << 30, offset=0, producer_id=producer_id,
                             producer_epoch=epoch, base_sequence=base_sequence)
    for i, v in enumerate(values):
        ts = timestamps[i] if timestamps is not None else 1_700_000_000_000 + i
        b.append(timestamp=ts, key=None, value=v)
    b.close()
    return bytes(b.buffer())


def read_records(payload: bytes) -> list[tuple[int, int, bytes | None]]:
    """(offset, timestamp, value) of every record in ``payload`` (concatenated batches)."""
    out = []
    recs = MemoryRecords(bytes(payload))
    while recs.has_next():
        batch = recs.next_batch()
        for r in batch:
            out.append((r.offset, r.timestamp, r.value))
    return out


def batch_headers(payload: bytes) -> list:
    """kafka-python batch objects (header fields) of ``payload``."""
    out = []
    recs = MemoryRecords(bytes(payload))
    while recs.has_next():
        out.append(recs.next_batch())
    return out
