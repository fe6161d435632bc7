"""storage/crc.py: a CRC-32C combined from its parts' CRCs equals the CRC of the bytes, and an
object encoded from known payload CRCs is byte-identical to one that read every payload."""
from __future__ import annotations

import random

import crc32c
from hypothesis import given, settings, strategies as st

from storage.crc import combine
from storage.objects.format import ObjectEncoder, Record, decode_object


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=3000))
def test_combine_equals_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_combine_over_large_and_odd_lengths() -> None:
    rnd = random.Random(7)
    for n in (1 << 20, (1 << 20) - 61, 3 << 20, 65_537):
        a, b = rnd.randbytes(rnd.randrange(1, 100)), rnd.randbytes(n)
        assert combine(crc32c.crc32c(a), crc32c.crc32c(b), n) == crc32c.crc32c(a + b)


def _encode(records: list[Record], crcs: list[int | None] | None) -> bytes:
    enc = ObjectEncoder(records, 4096, crcs=crcs)
    enc.encode()
    data, _index, _ranges = enc.finish()
    return bytes(data)


def test_object_from_known_crcs_is_byte_identical() -> None:
    rnd = random.Random(3)
    records = []
    for sid in (1, 4):
        off = 0
        for _ in range(40):
            n = rnd.choice([0, 1, 100, 3000, 9000])
            records.append(Record(sid, off, 2, rnd.randbytes(n)))
            off += 2
    plain = _encode(records, None)
    every = [crc32c.crc32c(r.payload) for r in records]
    some = [c if i % 3 else None for i, c in enumerate(every)]   # blocks mixing both
    assert _encode(records, every) == plain
    assert _encode(records, some) == plain
    assert [tuple(r) for r in decode_object(plain)] == [tuple(r) for r in records]


async def test_appends_with_a_known_crc_survive_a_crash_and_upload(tmp_path) -> None:
    """The WAL record CRC combined from the caller's payload CRC is the one recovery checks:
    a crash right after the appends must bring every one back, and their objects read back
    (the block CRCs combined too)."""
    from storage.engine import open_engine
    from storage_helpers import payload, read_all, small_config
    cfg = small_config(tmp_path, upload_threshold_bytes=1 << 30, upload_interval_s=3600,
                       log_cache_bytes=8 << 20)
    eng = open_engine(cfg)
    await eng.start()
    s = await eng.create_stream()
    for i in range(6):
        data = payload(s.stream_id, s.end_offset, 100_000 + i)
        await s.append(data, s.end_offset, 5, crc=crc32c.crc32c(data))
    for t in eng._tasks:                 # a crash: no final upload, WAL not cleanly closed
        t.cancel()
    eng.closing = True
    eng.wal.close()
    eng.meta.close()
    eng2 = open_engine(cfg)
    await eng2.start()
    try:
        s2 = await eng2.open_stream(s.stream_id)
        assert s2.confirmed_offset == 30
        assert len(await read_all(s2, max_bytes=1 << 20)) == 6
        data = payload(s2.stream_id, 30, 200_000)
        await s2.append(data, 30, 5, crc=crc32c.crc32c(data))
        await eng2.flush()
        eng2.drop_caches()
        assert len(await read_all(s2, max_bytes=1 << 20)) == 7     # from objects now
    finally:
        await eng2.close()
