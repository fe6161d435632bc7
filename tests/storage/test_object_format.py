"""Object format: round trip, index lookups, and corruption always detected as such."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from storage.objects.format import (FOOTER, CorruptObjectError, Record, decode_block,
                                    decode_footer, decode_index, decode_object, encode_object)


def _records() -> list[Record]:
    out = []
    for sid in (1, 2, 7):
        off = 100 * sid
        for i in range(50):
            out.append(Record(sid, off, 3, bytes([sid, i]) * (50 + i)))
            off += 3
    return out


def test_round_trip_and_index() -> None:
    recs = _records()
    data, index, ranges = encode_object(recs, block_size=1024)
    assert [tuple(r) for r in decode_object(data)] == [tuple(r) for r in recs]
    assert {(r.stream_id, r.start_offset, r.end_offset) for r in ranges} == \
        {(1, 100, 250), (2, 200, 350), (7, 700, 850)}
    pos, length, crc = decode_footer(data[-FOOTER.size:], len(data))
    assert decode_index(data[pos:pos + length], crc) == index
    # each index entry points at a block holding exactly that stream run
    for e in index:
        got = [r for r in decode_block(data[e.position:e.position + e.size])
               if r.stream_id == e.stream_id]
        assert got[0].base_offset == e.start_offset and got[-1].end_offset == e.end_offset
        assert len(got) == e.record_count


def test_unsorted_input_rejected() -> None:
    with pytest.raises(ValueError):
        encode_object([Record(2, 0, 1, b"a"), Record(1, 0, 1, b"b")])


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_any_flipped_byte_is_detected(where: int, value: int) -> None:
    data, _, _ = encode_object(_records(), block_size=2048)
    pos = where % len(data)
    if data[pos] == value:
        return
    bad = bytearray(data)
    bad[pos] = value
    with pytest.raises(CorruptObjectError):
        list(decode_object(bytes(bad)))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_garbage_never_crashes(blob: bytes) -> None:
    for fn in (lambda: list(decode_object(blob)), lambda: decode_block(blob)):
        try:
            fn()
        except CorruptObjectError:
            pass


def _golden_records() -> list[Record]:
    out = []
    for sid in (1, 2, 7):
        off = 100 * sid
        for i in range(60):
            out.append(Record(sid, off, 1 + i % 4, bytes([sid, i]) * (1 + 997 * (i % 7))))
            off += 1 + i % 4
    return out


@pytest.mark.parametrize("block_size,size,digest", [
    (1, 1056216, "62d4ce382d07c69184cd48ed1af2d22c448a80050219196071f6479feac7c513"),
    (1024, 1054866, "e5ba62121a5d9c21274646ecd6db20e19b02a866ef3409ebf2c8185e9917592d"),
    (65536, 1047966, "fec9f0d89ff78775888929d0bdacbed7b7a947141572259df147e49d6289d2d6"),
])
@pytest.mark.parametrize("encoder", ["as built", "python"])
def test_encoding_is_byte_identical_to_the_format_objects_were_written_in(
        block_size: int, size: int, digest: str, encoder: str, monkeypatch) -> None:
    """Pins the on-disk bytes (digests taken from the encoder that wrote the objects stored
    so far): a faster encoder must not change one byte of what readers and old objects know.
    Sizes on both sides of the 1 MiB line cover the mmap- and the bytearray-backed buffer.
    Both the C encoder (when built) and the Python one (the fallback)."""
    import hashlib
    from storage import copycrc
    if encoder == "python":
        monkeypatch.setattr(copycrc, "encode_blocks", None)
        monkeypatch.setattr(copycrc, "object_size_steps", None)
    data, index, _ = encode_object(_golden_records(), block_size=block_size)
    assert len(data) == size
    assert hashlib.sha256(data).hexdigest() == digest
    assert [tuple(r) for r in decode_object(data)] == [tuple(r) for r in _golden_records()]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 3000)),
                max_size=40),
       st.sampled_from([1, 64, 1024, 4096, 1 << 20]))
def test_precomputed_size_matches_any_input(shape, block_size: int) -> None:
    """The encoder sizes its buffer before copying (no growth, no realloc): the size pass must
    agree with the encoding for every mix of streams, record sizes and block sizes (finish()
    raises if it does not), and the object must read back."""
    recs, offs = [], {}
    for sid, count, n in sorted(shape, key=lambda t: t[0]):
        off = offs.get(sid, 0)
        recs.append(Record(sid, off, count, bytes([sid]) * n))
        offs[sid] = off + count
    data, _, _ = encode_object(recs, block_size=block_size)
    assert [tuple(r) for r in decode_object(data)] == [tuple(r) for r in recs]


def test_checks_use_the_compiled_crc_when_built(monkeypatch) -> None:
    """Block, index and footer CRCs (encode and every cold read's check) run storage._copycrc's
    folded CRC-32C (~2x the crc32c package on 1 MiB), not the package: with the package's
    function made to fail, an object still encodes and reads back, and the values are the
    package's (the golden digests above pin the bytes)."""
    import crc32c
    from storage import copycrc
    if not copycrc.NATIVE:
        pytest.skip("storage._copycrc not built")
    big = [Record(1, i, 1, bytes([i]) * (300_000 + i)) for i in range(4)]
    data, index, _ = encode_object(big + [Record(2, 0, 1, b"x" * 10)], block_size=1 << 20)
    for e in index:
        block = memoryview(data)[e.position:e.position + e.size]
        assert crc32c.crc32c(block[14:]) == int.from_bytes(block[10:14], "big")

    def refuse(*_a, **_k):
        raise AssertionError("crc32c package called on the object path")
    monkeypatch.setattr(crc32c, "crc32c", refuse)
    data2, _, _ = encode_object(big + [Record(2, 0, 1, b"x" * 10)], block_size=1 << 20)
    assert bytes(data2) == bytes(data)
    assert [r.payload.tobytes() for r in decode_object(data2)] == \
        [r.payload for r in big] + [b"x" * 10]
