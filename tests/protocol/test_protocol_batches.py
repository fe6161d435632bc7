"""Record batches, records, compression and legacy message sets, cross-checked against
kafka-python's own record encoders/decoders (what real kafka-python clients produce)."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder
from kafka.record.legacy_records import LegacyRecordBatchBuilder
from kafka.record.memory_records import MemoryRecords

import protocol
from protocol import (
    BatchView, CorruptRecordError, Record, build_batch, convert_legacy, decode_batches,
    decode_records, down_convert, fill_max_timestamp, iter_batches, record_timestamps,
    set_base_offset, set_log_append_time, validate_batch,
)
from protocol import compression as codecs

KP_CODECS = [0, 1, 3, 4]  # kafka-python here lacks python-snappy; snappy is checked on our side


def kp_batch(codec: int, n: int = 5, ts: int | None = 2000, pid: int = -1) -> bytes:
    b = DefaultRecordBatchBuilder(magic=2, compression_type=codec, is_transactional=False,
                                  producer_id=pid, producer_epoch=0 if pid >= 0 else -1,
                                  base_sequence=0 if pid >= 0 else -1, batch_size=1 << 20)
    for i in range(n):
        b.append(i, timestamp=None if ts is None else ts + i, key=b"k%d" % i,
                 value=b"v" * (i * 50), headers=[("h", b"x")])
    return bytes(b.build())


@pytest.mark.parametrize("codec", KP_CODECS)
def test_view_and_validate_client_batches(codec: int) -> None:
    raw = kp_batch(codec, pid=42)
    (view,) = list(iter_batches(raw))
    validate_batch(view)
    assert (view.magic, view.compression, view.record_count, view.last_offset_delta) == (
        2, codec, 5, 4)
    assert view.size == len(raw) and view.producer_id == 42 and view.base_sequence == 0
    assert view.max_timestamp == 2004 and view.timestamp_type == 0
    assert not view.is_transactional and not view.is_control
    recs = decode_records(view)
    assert [(r.offset, r.timestamp, r.key, r.headers) for r in recs][1] == (
        1, 2001, b"k1", [("h", b"x")])


def test_crc_size_and_magic_errors() -> None:
    raw = bytearray(kp_batch(0))
    raw[-1] ^= 1
    with pytest.raises(CorruptRecordError):
        validate_batch(next(iter_batches(raw)))
    good = kp_batch(0)
    with pytest.raises(CorruptRecordError):
        list(iter_batches(good[:-1]))  # partial batch
    with pytest.raises(CorruptRecordError):
        list(iter_batches(good + good[:30]))  # trailing garbage
    bad_magic = bytearray(good)
    bad_magic[16] = 3
    with pytest.raises(CorruptRecordError):
        list(iter_batches(bad_magic))
    bad_len = bytearray(good)
    struct.pack_into(">i", bad_len, 8, 10)
    with pytest.raises(CorruptRecordError):
        list(iter_batches(bad_len))


def test_set_base_offset_keeps_crc_and_kafka_python_sees_offsets() -> None:
    buf = bytearray(kp_batch(1) + kp_batch(0))
    pos = 0
    next_offset = 1000
    for view in list(iter_batches(buf)):
        set_base_offset(buf, view.pos, next_offset)
        next_offset += view.last_offset_delta + 1
        validate_batch(BatchView(buf, view.pos))
        pos += view.size
    offsets = [r.offset for r in decode_batches(buf)]
    assert offsets == list(range(1000, 1010))
    kp = DefaultRecordBatch(bytes(buf[: next(iter_batches(buf)).size]))
    assert kp.validate_crc() and [m.offset for m in kp] == list(range(1000, 1005))


@pytest.mark.parametrize("codec", KP_CODECS)
def test_log_append_time_on_compressed_batches(codec: int) -> None:
    buf = bytearray(kp_batch(codec))
    set_log_append_time(buf, 0, 777_000)
    view = BatchView(buf, 0)
    validate_batch(view)
    assert view.timestamp_type == 1 and view.max_timestamp == 777_000
    kp = DefaultRecordBatch(bytes(buf))
    assert kp.validate_crc()
    assert {m.timestamp for m in kp} == {777_000}
    assert {ts for _, ts in record_timestamps(buf, 0)} == {777_000}


@pytest.mark.parametrize("codec", [0, 1, 2, 3, 4])
def test_fill_max_timestamp_when_producer_left_it_unset(codec: int) -> None:
    recs = [Record(i, 500 + (7 * i) % 5, b"k", b"v") for i in range(6)]
    buf = bytearray(build_batch(recs, compression=codec, max_timestamp=-1))
    assert BatchView(buf, 0).max_timestamp == -1
    assert fill_max_timestamp(buf, 0) == 504
    validate_batch(BatchView(buf, 0))
    assert BatchView(buf, 0).max_timestamp == 504
    assert fill_max_timestamp(buf, 0) == 504  # idempotent


@pytest.mark.parametrize("codec", [0, 1, 2, 3, 4])
def test_our_batches_are_read_by_kafka_python(codec: int) -> None:
    raw = build_batch([(b"a", b"1"), (None, b"2"), (b"c", None)], base_offset=3,
                      compression=codec, timestamp=99)
    validate_batch(next(iter_batches(raw)))
    assert [(r.offset, r.key, r.value, r.timestamp) for r in decode_batches(raw)] == [
        (3, b"a", b"1", 99), (4, None, b"2", 99), (5, b"c", None, 99)]
    if codec != 2:
        kp = DefaultRecordBatch(raw)
        assert kp.validate_crc()
        assert [(m.offset, m.key, m.value) for m in kp] == [
            (3, b"a", b"1"), (4, None, b"2"), (5, b"c", None)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.binary(max_size=40)),
                          st.one_of(st.none(), st.binary(max_size=300))), min_size=1,
                max_size=20), st.sampled_from([0, 1, 2, 3, 4]),
       st.integers(min_value=0, max_value=2 ** 40))
def test_records_round_trip(pairs, codec, ts) -> None:
    raw = build_batch(pairs, compression=codec, timestamp=ts, base_offset=ts % 1000)
    validate_batch(next(iter_batches(raw)))
    assert [(r.key, r.value) for r in decode_batches(raw)] == pairs


@pytest.mark.parametrize("codec", [0, 1, 2, 3, 4])
def test_compression_codecs(codec: int) -> None:
    data = bytes(range(256)) * 1000
    assert codecs.decompress(codec, codecs.compress(codec, data)) == data
    if codec:
        with pytest.raises(CorruptRecordError):
            codecs.decompress(codec, b"\x00garbage" * 10)
        with pytest.raises(CorruptRecordError):
            codecs.decompress(codec, codecs.compress(codec, data), max_size=1000)


def test_raw_snappy_is_accepted() -> None:
    import cramjam

    data = b"snappy " * 1000
    assert codecs.decompress(codecs.SNAPPY, bytes(cramjam.snappy.compress_raw(data))) == data
    assert codecs.compress(codecs.SNAPPY, data).startswith(b"\x82SNAPPY\x00")


@pytest.mark.parametrize("magic,codec", [(0, 0), (0, 1), (1, 0), (1, 1), (1, 3)])
def test_legacy_message_sets_convert_to_one_v2_batch(magic: int, codec: int) -> None:
    b = LegacyRecordBatchBuilder(magic=magic, compression_type=codec, batch_size=1 << 20)
    for i in range(4):
        b.append(i, timestamp=1000 + i if magic else None, key=b"k", value=b"v%d" % i)
    raw = bytes(b.build())
    assert protocol.is_legacy(raw)
    v2 = convert_legacy(memoryview(raw))
    (view,) = list(iter_batches(v2))
    validate_batch(view)
    assert view.compression == codec and view.record_count == 4
    recs = decode_records(view)
    assert [r.value for r in recs] == [b"v0", b"v1", b"v2", b"v3"]
    assert [r.timestamp for r in recs] == ([1000, 1001, 1002, 1003] if magic else [-1] * 4)
    bad = bytearray(raw)
    bad[-1] ^= 0xFF
    with pytest.raises(CorruptRecordError):
        convert_legacy(bad)
    with pytest.raises(CorruptRecordError):
        convert_legacy(raw[:-3])


@pytest.mark.parametrize("magic", [0, 1])
def test_down_conversion_is_read_by_kafka_python(magic: int) -> None:
    v2 = build_batch([Record(10, 100, b"a", b"b"), Record(11, 105, None, b"c")], base_offset=10)
    v2 += build_batch([(b"x", b"y")], base_offset=12, timestamp=200, log_append_time=True)
    mr = MemoryRecords(down_convert(v2, magic))
    got = []
    while (batch := mr.next_batch()) is not None:
        got += [(m.offset, m.timestamp, m.key, m.value) for m in batch]
    ts = [100, 105, 200] if magic else [None, None, None]
    assert got == [(10, ts[0], b"a", b"b"), (11, ts[1], None, b"c"), (12, ts[2], b"x", b"y")]


def test_random_garbage_batches_raise_only_corrupt_record_errors() -> None:
    import random

    rng = random.Random(7)
    good = kp_batch(1)
    for _ in range(2000):
        buf = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        buf = buf[: rng.randint(0, len(buf))] if rng.random() < 0.3 else buf
        try:
            for view in iter_batches(buf):
                validate_batch(view)
                decode_records(view)
        except CorruptRecordError:
            pass
        try:
            convert_legacy(buf)
        except CorruptRecordError:
            pass


def test_decompression_bombs_are_refused_without_inflating() -> None:
    import cramjam

    bomb = b"\x00" * (8 << 20)
    for codec in (1, 2, 3, 4):
        with pytest.raises(CorruptRecordError):
            codecs.decompress(codec, codecs.compress(codec, bomb), max_size=1 << 20)
    # a raw snappy header that declares 4 GiB
    with pytest.raises(CorruptRecordError):
        codecs.decompress(codecs.SNAPPY, b"\xff\xff\xff\xff\x0f" + b"\x00" * 5)
    assert codecs.decompress(2, bytes(cramjam.snappy.compress_raw(b"ok"))) == b"ok"


def test_concatenated_gzip_members_and_zstd_frames_are_read_whole() -> None:
    import gzip

    assert codecs.decompress(codecs.GZIP, gzip.compress(b"abc") + gzip.compress(b"def")) == (
        b"abcdef")
    two = codecs.compress(codecs.ZSTD, b"abc") + codecs.compress(codecs.ZSTD, b"def")
    assert codecs.decompress(codecs.ZSTD, two) == b"abcdef"
    with pytest.raises(CorruptRecordError):
        codecs.decompress(codecs.GZIP, gzip.compress(b"abc" * 100)[:-5])


def test_count_offsets_counts_and_refuses_exactly_as_iter_batches():
    """``count_offsets`` (the produce run's per-request count) is the sum of each batch's
    lastOffsetDelta + 1 and raises CorruptRecordError wherever iter_batches does: trailing
    bytes, a wrong magic, a length under the minimum or past the end."""
    from protocol import build_batch, count_offsets, iter_batches
    from protocol.errors import CorruptRecordError

    one = build_batch([(None, b"a"), (None, b"bb"), (None, b"c")])
    two = build_batch([(None, b"x" * 300)])
    good = bytes(one + two + one)
    assert count_offsets(good) == sum(v.last_offset_delta + 1 for v in iter_batches(good)) == 7
    assert count_offsets(b"") == 0
    bad_magic = bytearray(good)
    bad_magic[len(one) + 16] = 1
    short = bytearray(good)
    short[len(one) + 8:len(one) + 12] = (10).to_bytes(4, "big")
    long = bytearray(good)
    long[8:12] = (len(good)).to_bytes(4, "big")
    for bad in (good + b"\x00" * 20, good[:-1], bytes(bad_magic), bytes(short), bytes(long)):
        with pytest.raises(CorruptRecordError) as want:
            list(iter_batches(bad))
        with pytest.raises(CorruptRecordError) as got:
            count_offsets(bad)
        assert str(got.value) == str(want.value)
