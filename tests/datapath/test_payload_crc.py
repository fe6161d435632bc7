"""Partition.append hands an engine-like stream the CRC-32C of each large payload, combined
from the batches' own CRCs (storage/crc.py): it must equal the CRC of the bytes as appended
after every in-place rewrite (offsets, leader epoch, LogAppendTime, a filled-in max
timestamp, legacy conversion), since the WAL record and object block checksums are built
from it and a wrong one would make recovery refuse a durable record."""
from __future__ import annotations

import random
import struct

import crc32c
import pytest

from broker.partition import CRC_COMBINE_FROM
from protocol import ErrorCode, batches
from storage.memory import MemoryStream

from .batches import make_batch
from .test_partition import open_partition, read_all

BIG = b"v" * 40_000          # two of these per batch: over CRC_COMBINE_FROM


class CrcStream(MemoryStream):
    """A MemoryStream that takes a payload CRC like the engine's streams, and records it."""

    takes_crc = True

    def __init__(self, stream_id: int = 1) -> None:
        super().__init__(stream_id)
        self.seen: list[tuple[bytes, int | None]] = []

    async def append(self, payload, base_offset, count, crc=None):
        self.seen.append((bytes(payload), crc))
        await super().append(payload, base_offset, count)


def _no_max_timestamp(batch: bytes) -> bytes:
    """The batch with max timestamp -1 (as some producers send it), CRC fixed."""
    buf = bytearray(batch)
    struct.pack_into(">q", buf, 35, -1)
    batches.rewrite_crc(buf, 0)
    return bytes(buf)


@pytest.mark.parametrize("case", ["one", "several", "log_append_time", "max_ts_unset",
                                  "gzip", "legacy"])
async def test_payload_crc_matches_the_appended_bytes(tmp_path, case):
    configs = {"message.timestamp.type": "LogAppendTime"} if case == "log_append_time" else {}
    stream = CrcStream()
    p, *_ = await open_partition(tmp_path, stream=stream, configs=configs)
    if case == "several":
        payload = make_batch([BIG]) + make_batch([BIG, b"x"]) + make_batch([BIG])
    elif case == "max_ts_unset":
        payload = _no_max_timestamp(make_batch([BIG, BIG]))
    elif case == "gzip":
        payload = make_batch([random.Random(1).randbytes(80_000)], codec="gzip")
    elif case == "legacy":
        payload = make_batch([BIG, BIG], magic=1)
    else:
        payload = make_batch([BIG, BIG])
    for _ in range(2):             # the second one at a non-zero base offset
        r = await p.append(payload, api_version=9 if case != "legacy" else 2)
        assert r.error == ErrorCode.NONE, r
    assert len(stream.seen) == 2
    for data, crc in stream.seen:
        assert len(data) >= CRC_COMBINE_FROM
        assert crc == crc32c.crc32c(data)
    assert len(await read_all(p)) >= 2


async def test_small_payloads_are_checksummed_by_the_stream(tmp_path):
    stream = CrcStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    r = await p.append(make_batch([b"small"]))
    assert r.error == ErrorCode.NONE
    assert stream.seen[0][1] is None
