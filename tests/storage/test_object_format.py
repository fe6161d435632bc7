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
