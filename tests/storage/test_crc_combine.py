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
