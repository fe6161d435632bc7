"""Partition over a real in-memory Stream: offsets, validation, idempotence, time index."""
from __future__ import annotations

import asyncio
import types
import uuid

import crc32c
import pytest

import protocol
from broker.partition import Partition
from protocol import ErrorCode
from storage.memory import MemoryStream, MemoryStreamStore
from storage.stream import Batch, PayloadChecksumError, RetriableStorageError

from .batches import CODECS, batch_headers, make_batch, read_records

TOPIC_ID = uuid.UUID("00000000-0000-0000-0000-0000000000aa")


def fake_broker(tmp_path) -> types.SimpleNamespace:
    """Only what Partition.open reads from the broker: config.data_dir and topics."""
    return types.SimpleNamespace(config=types.SimpleNamespace(data_dir=str(tmp_path)), topics={})


async def open_partition(tmp_path, store=None, stream=None, configs=None, broker=None):
    store = store or MemoryStreamStore()
    stream = stream or await store.create_stream()
    broker = broker or fake_broker(tmp_path)
    p = await Partition.open(broker, "t", TOPIC_ID, 0, stream, configs if configs is not None else {})
    return p, store, stream, broker


async def read_all(p: Partition, offset: int = 0) -> list[tuple[int, int, bytes | None]]:
    res = await p.read(offset, 1 << 30)
    assert res.error == 0
    return [r for b in res.batches for r in read_records(b.payload)]


async def test_offsets_assigned_in_place(tmp_path):
    p, *_ = await open_partition(tmp_path)
    r1 = await p.append(make_batch([b"a", b"b", b"c"]))
    r2 = await p.append(make_batch([b"d"]))
    assert (r1.error, r1.base_offset) == (0, 0)
    assert (r2.error, r2.base_offset) == (0, 3)
    assert p.high_watermark == 4 and p.log_start_offset == 0
    recs = await read_all(p)
    assert [(o, v) for o, _, v in recs] == [(0, b"a"), (1, b"b"), (2, b"c"), (3, b"d")]
    # offsets were written into the stored headers and the CRC still validates
    res = await p.read(0, 1 << 30)
    for b in res.batches:
        for h in batch_headers(b.payload):
            assert h.validate_crc()
            assert h.leader_epoch == 0


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
async def test_each_codec_round_trips(tmp_path, codec):
    p, *_ = await open_partition(tmp_path)
    batch = make_batch([b"x" * 100, b"y"], codec=codec)
    assert batch_headers(batch)[0].compression_type == CODECS[codec]
    r = await p.append(batch, api_version=9)
    assert r.error == 0
    assert [v for _, _, v in await read_all(p)] == [b"x" * 100, b"y"]


async def test_zstd_needs_produce_v7(tmp_path):
    p, *_ = await open_partition(tmp_path)
    r = await p.append(make_batch([b"z" * 300], codec="zstd"), api_version=6)
    assert r.error == ErrorCode.UNSUPPORTED_COMPRESSION_TYPE
    assert p.high_watermark == 0


async def test_corrupt_batch_rejected(tmp_path):
    p, *_ = await open_partition(tmp_path)
    raw = bytearray(make_batch([b"hello world"]))
    raw[-3] ^= 0xFF  # flip a payload byte: CRC-32C no longer matches
    r = await p.append(bytes(raw))
    assert r.error == ErrorCode.CORRUPT_MESSAGE
    r = await p.append(b"\x00\x01garbage")
    assert r.error == ErrorCode.CORRUPT_MESSAGE
    assert p.high_watermark == 0


async def test_large_corrupt_batch_checked_by_the_stream_is_rejected(tmp_path):
    """A lone large batch without a producer id has its CRC checked by the stream while it is
    copied (Stream.append check=): still CORRUPT_MESSAGE with nothing stored, also when a
    header field would have refused it anyway, and an intact batch then takes offset 0."""
    configs: dict[str, str] = {}
    p, *_ = await open_partition(tmp_path, configs=configs)
    assert p.stream.checks_payloads
    raw = bytearray(make_batch([b"q" * 200_000]))
    raw[-3] ^= 0x10
    r = await p.append(memoryview(raw), owned=True)
    assert (r.error, p.high_watermark) == (ErrorCode.CORRUPT_MESSAGE, 0)
    configs["max.message.bytes"] = "1000"
    raw = bytearray(make_batch([b"q" * 200_000]))
    raw[-3] ^= 0x10
    assert (await p.append(bytes(raw))).error == ErrorCode.CORRUPT_MESSAGE
    assert (await p.append(make_batch([b"q" * 200_000]))).error == \
        ErrorCode.MESSAGE_SIZE_TOO_LARGE
    del configs["max.message.bytes"]
    r = await p.append(make_batch([b"g" * 200_000]))
    assert (r.error, r.base_offset, p.high_watermark) == (0, 0, 1)
    assert [v for _, _, v in await read_all(p)] == [b"g" * 200_000]


async def test_max_message_bytes(tmp_path):
    configs = {"max.message.bytes": "200"}
    p, *_ = await open_partition(tmp_path, configs=configs)
    r = await p.append(make_batch([b"x" * 500]))
    assert r.error == ErrorCode.MESSAGE_SIZE_TOO_LARGE
    configs["max.message.bytes"] = "100000"  # live config dict, changed in place
    assert (await p.append(make_batch([b"x" * 500]))).error == 0


async def test_log_append_time(tmp_path):
    configs = {"message.timestamp.type": "LogAppendTime"}
    p, *_ = await open_partition(tmp_path, configs=configs)
    r = await p.append(make_batch([b"a", b"b"], timestamps=[5, 6]))
    assert r.error == 0 and r.log_append_time > 1_600_000_000_000
    res = await p.read(0, 1 << 30)
    (h,) = batch_headers(res.batches[0].payload)
    assert h.timestamp_type == 1 and h.max_timestamp == r.log_append_time and h.validate_crc()
    assert {ts for _, ts, _ in await read_all(p)} == {r.log_append_time}


async def test_log_append_time_on_a_large_lone_batch(tmp_path):
    """A lone batch large enough that the stream checks its CRC (STREAM_CHECKS_CRC_FROM) on a
    LogAppendTime topic, by the task path and the task-less one: the stamp rewrites its CRC,
    so the client's is checked first and the stream gets the new one (it used to check the
    client's CRC against the restamped bytes and refuse every such batch CORRUPT_MESSAGE); a
    corrupt one is refused by both paths."""
    from broker.partition import STREAM_CHECKS_CRC_FROM

    configs = {"message.timestamp.type": "LogAppendTime"}
    stream = _CheckingDirectStream()
    p, *_ = await open_partition(tmp_path, stream=stream, configs=configs)
    value = b"v" * STREAM_CHECKS_CRC_FROM
    r = await p.append(make_batch([value], timestamps=[5]))
    assert r.error == 0 and r.log_append_time > 1_600_000_000_000, r.message
    answered = asyncio.get_running_loop().create_future()
    assert p.append_now(bytearray(make_batch([value], timestamps=[5])), 9,
                        answered.set_result)
    r = await answered
    assert r.error == 0 and r.base_offset == 1 and r.log_append_time > 0, r.message
    res = await p.read(0, 1 << 30)
    assert len(res.batches) == 2
    for b in res.batches:
        (h,) = batch_headers(b.payload)
        assert h.timestamp_type == 1 and h.validate_crc()
    assert len(stream.checks) == 2
    assert all(c is not None and c[0] == protocol.CRC_START for c in stream.checks)
    bad = bytearray(make_batch([value], timestamps=[5]))
    bad[-1] ^= 0xFF
    assert (await p.append(bytes(bad))).error == ErrorCode.CORRUPT_MESSAGE
    refused = asyncio.get_running_loop().create_future()
    assert p.append_now(bad, 9, refused.set_result)
    assert (await refused).error == ErrorCode.CORRUPT_MESSAGE
    assert p.high_watermark == 2 and len(stream.checks) == 2
    # an idempotent one (checked whole before its producer state) likewise, corrupt or not
    idem = bytearray(make_batch([value], timestamps=[5], producer_id=3, epoch=0, base_sequence=0))
    bad_idem = bytearray(idem)
    bad_idem[-1] ^= 0xFF
    assert (await p.append(bytes(bad_idem))).error == ErrorCode.CORRUPT_MESSAGE
    r = await p.append(bytes(idem))
    assert r.error == 0 and r.base_offset == 2 and r.log_append_time > 0, r.message
    (h,) = batch_headers((await p.read(2, 1 << 30)).batches[0].payload)
    assert h.timestamp_type == 1 and h.validate_crc()
    assert len(stream.checks) == 3 and stream.checks[2][0] == protocol.CRC_START


async def test_a_large_idempotent_lone_batch_hands_its_crc_to_the_stream(tmp_path):
    """Validated here (producer state), a large lone idempotent batch still hands its CRC to
    the stream (checked again in the stream's own pass; the upload writes such payloads from
    their frames); a corrupt one is refused before any producer state is taken."""
    from broker.partition import STREAM_CHECKS_CRC_FROM

    stream = _CheckingDirectStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    checks = stream.checks
    value = b"i" * STREAM_CHECKS_CRC_FROM
    bad = bytearray(make_batch([value], producer_id=7, epoch=0, base_sequence=0))
    bad[-1] ^= 0xFF
    assert (await p.append(bytes(bad))).error == ErrorCode.CORRUPT_MESSAGE
    assert not checks
    r = await p.append(make_batch([value], producer_id=7, epoch=0, base_sequence=0))
    assert r.error == 0 and r.base_offset == 0
    assert len(checks) == 1 and checks[0][0] == protocol.CRC_START
    # the small one is checked here alone, as before
    assert (await p.append(make_batch([b"s"], producer_id=7, epoch=0, base_sequence=1))).error == 0
    assert checks[1] is None


async def test_legacy_magic_converted(tmp_path):
    p, *_ = await open_partition(tmp_path)
    r = await p.append(make_batch([b"old1", b"old2"], magic=1), api_version=2)
    assert r.error == 0 and r.base_offset == 0
    res = await p.read(0, 1 << 30)
    (h,) = batch_headers(res.batches[0].payload)
    assert h.magic == 2
    assert [v for _, _, v in await read_all(p)] == [b"old1", b"old2"]


async def test_timestamp_lookup_and_max(tmp_path):
    p, *_ = await open_partition(tmp_path)
    await p.append(make_batch([b"a", b"b"], timestamps=[100, 200]))
    await p.append(make_batch([b"c", b"d"], timestamps=[500, 300]))
    await p.append(make_batch([b"e"], timestamps=[400]))
    assert await p.offset_for_timestamp(0) == (0, 100)
    assert await p.offset_for_timestamp(150) == (1, 200)
    assert await p.offset_for_timestamp(250) == (2, 500)
    assert await p.offset_for_timestamp(500) == (2, 500)
    assert await p.offset_for_timestamp(501) == (-1, -1)
    assert await p.max_timestamp_offset() == (2, 500)


async def test_read_out_of_range_and_trim(tmp_path):
    p, *_ = await open_partition(tmp_path)
    for i in range(5):
        await p.append(make_batch([b"%d" % i]))
    assert (await p.read(6, 100)).error == ErrorCode.OFFSET_OUT_OF_RANGE
    assert (await p.read(5, 100)).batches == []
    assert await p.trim_to(3) == 3
    assert p.log_start_offset == 3
    assert (await p.read(1, 100)).error == ErrorCode.OFFSET_OUT_OF_RANGE
    assert [v for _, _, v in await read_all(p, 3)] == [b"3", b"4"]


async def test_idempotent_duplicate_gap_and_fencing(tmp_path):
    p, *_ = await open_partition(tmp_path)
    pid = 4242
    r0 = await p.append(make_batch([b"a", b"b"], producer_id=pid, epoch=0, base_sequence=0))
    r1 = await p.append(make_batch([b"c"], producer_id=pid, epoch=0, base_sequence=2))
    assert (r0.base_offset, r1.base_offset) == (0, 2)
    # a retry of an earlier batch is answered with its original offset, nothing appended
    dup = await p.append(make_batch([b"a", b"b"], producer_id=pid, epoch=0, base_sequence=0))
    assert (dup.error, dup.base_offset) == (0, 0)
    assert p.high_watermark == 3
    # a gap is out of order
    gap = await p.append(make_batch([b"x"], producer_id=pid, epoch=0, base_sequence=5))
    assert gap.error == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER
    # a new epoch must restart at 0, then the old epoch is fenced
    bad = await p.append(make_batch([b"x"], producer_id=pid, epoch=1, base_sequence=3))
    assert bad.error == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER
    ok = await p.append(make_batch([b"x"], producer_id=pid, epoch=1, base_sequence=0))
    assert (ok.error, ok.base_offset) == (0, 3)
    old = await p.append(make_batch([b"y"], producer_id=pid, epoch=0, base_sequence=3))
    assert old.error == ErrorCode.INVALID_PRODUCER_EPOCH
    assert p.high_watermark == 4
    rows = p.producer_rows()
    assert rows[0][:3] == (pid, 1, 0)


async def test_only_last_five_batches_deduplicated(tmp_path):
    p, *_ = await open_partition(tmp_path)
    for seq in range(7):
        assert (await p.append(make_batch([b"v"], producer_id=7, epoch=0,
                                          base_sequence=seq))).error == 0
    assert (await p.append(make_batch([b"v"], producer_id=7, epoch=0,
                                      base_sequence=2))).base_offset == 2
    old = await p.append(make_batch([b"v"], producer_id=7, epoch=0, base_sequence=1))
    assert old.error == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER


async def test_producer_state_survives_reopen(tmp_path):
    """Snapshot + replay of the log tail: a retried batch after restart is deduplicated."""
    store = MemoryStreamStore()
    p, store, stream, broker = await open_partition(tmp_path, store=store)
    await p.append(make_batch([b"a"], producer_id=9, epoch=0, base_sequence=0))
    p.snapshot().result()  # covers offset 0 only; the next batch is replayed from the log
    await p.append(make_batch([b"b"], producer_id=9, epoch=0, base_sequence=1))
    # crash: no close(); a new broker object (new sqlite connection) over the same streams
    p2, *_ = await open_partition(tmp_path, store=store, stream=stream,
                                  broker=fake_broker(tmp_path))
    dup = await p2.append(make_batch([b"b"], producer_id=9, epoch=0, base_sequence=1))
    assert (dup.error, dup.base_offset) == (0, 1)
    gap = await p2.append(make_batch([b"c"], producer_id=9, epoch=0, base_sequence=3))
    assert gap.error == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER
    assert await p2.offset_for_timestamp(0) == (0, 1_700_000_000_000)


async def test_retriable_storage_error_rolls_back_sequence(tmp_path):
    class FlakyStream(type(await MemoryStreamStore().create_stream())):
        fail = True

        async def append(self, payload, base_offset, count, check=None):
            if self.fail:
                self.fail = False
                raise RetriableStorageError("full")
            await super().append(payload, base_offset, count, check)

    stream = FlakyStream(1)
    p, *_ = await open_partition(tmp_path, stream=stream)
    batch = make_batch([b"a"], producer_id=1, epoch=0, base_sequence=0)
    r = await p.append(batch)
    assert r.error == ErrorCode.NOT_ENOUGH_REPLICAS
    r = await p.append(batch)  # the client's retry goes through
    assert (r.error, r.base_offset) == (0, 0)


async def test_wait_for_wakes_on_append(tmp_path):
    p, *_ = await open_partition(tmp_path)
    waiter = asyncio.ensure_future(p.wait_for(1))
    await asyncio.sleep(0)
    assert not waiter.done()
    await p.append(make_batch([b"a"]))
    assert await waiter is True


def _with_header_field(batch: bytes, offset: int, fmt: str, value: int) -> bytes:
    """Rewrite one header field and fix the CRC-32C (as a sloppy producer would send it)."""
    import struct

    import crc32c

    b = bytearray(batch)
    struct.pack_into(fmt, b, offset, value)
    struct.pack_into(">I", b, 17, crc32c.crc32c(bytes(b[21:])))
    return bytes(b)


async def test_unset_max_timestamp_is_filled(tmp_path):
    p, *_ = await open_partition(tmp_path)
    batch = _with_header_field(make_batch([b"a", b"b"], timestamps=[700, 900], codec="gzip"),
                               35, ">q", -1)
    assert batch_headers(batch)[0].max_timestamp == -1
    assert (await p.append(batch)).error == 0
    res = await p.read(0, 1 << 30)
    (h,) = batch_headers(res.batches[0].payload)
    assert h.max_timestamp == 900 and h.validate_crc()
    assert await p.offset_for_timestamp(800) == (1, 900)


async def test_undecodable_records_rejected_without_side_effects(tmp_path):
    p, *_ = await open_partition(tmp_path)
    # valid CRC, gzip flag, garbage compressed body, unset max timestamp: records must be read
    raw = bytearray(make_batch([b"q" * 300], codec="gzip", producer_id=3, epoch=0,
                               base_sequence=0))
    raw[61:] = b"\x00" * (len(raw) - 61)
    bad = _with_header_field(bytes(raw), 35, ">q", -1)
    assert (await p.append(bad)).error == ErrorCode.CORRUPT_MESSAGE
    assert p.high_watermark == 0 and p.producers.entries == {}
    unknown_codec = _with_header_field(make_batch([b"x"]), 21, ">h", 6)
    assert (await p.append(unknown_codec)).error == ErrorCode.CORRUPT_MESSAGE
    ok = await p.append(make_batch([b"q"], producer_id=3, epoch=0, base_sequence=0))
    assert (ok.error, ok.base_offset) == (0, 0)


async def test_reopen_uses_snapshot_index_and_replays_only_the_tail(tmp_path):
    store = MemoryStreamStore()
    p, store, stream, _ = await open_partition(tmp_path, store=store)
    for i in range(3):
        await p.append(make_batch([b"%d" % i], timestamps=[100 * (i + 1)],
                                  producer_id=8, epoch=0, base_sequence=i))
    p.snapshot().result()
    await p.append(make_batch([b"3"], timestamps=[400], producer_id=8, epoch=0,
                              base_sequence=3))
    reads: list[int] = []
    original = stream.read

    async def counting_read(offset, max_bytes):
        reads.append(offset)
        return await original(offset, max_bytes)

    stream.read = counting_read
    p2, *_ = await open_partition(tmp_path, store=store, stream=stream,
                                  broker=fake_broker(tmp_path))
    assert reads == [3]  # only the payload after the snapshot was read back
    assert await p2.offset_for_timestamp(150) == (1, 200)
    assert (await p2.append(make_batch([b"3"], producer_id=8, epoch=0,
                                       base_sequence=3))).base_offset == 3
    # seq 0 is known only from the snapshot: still answered as a duplicate
    dup = await p2.append(make_batch([b"0"], producer_id=8, epoch=0, base_sequence=0))
    assert (dup.error, dup.base_offset) == (0, 0)
    assert p2.high_watermark == 4


async def test_index_kept_in_offset_order(tmp_path):
    p, *_ = await open_partition(tmp_path)
    p._indexed(1, 10, 50, 2)  # completion of the second append resumes first
    assert p.log_index.end_offset == 0 and p.log_index.bases == []
    p._indexed(0, 10, 40, 1)
    assert p.log_index.end_offset == 2 and p.log_index.total_bytes == 20


async def test_timestamp_bounds(tmp_path):
    import time

    now = int(time.time() * 1000)
    configs = {"message.timestamp.after.max.ms": "3600000"}
    p, *_ = await open_partition(tmp_path, configs=configs)
    future = make_batch([b"f"], timestamps=[now + 7_200_000])
    assert (await p.append(future)).error == ErrorCode.INVALID_TIMESTAMP
    assert (await p.append(make_batch([b"ok"], timestamps=[now]))).error == 0
    configs["message.timestamp.before.max.ms"] = "60000"
    assert (await p.append(make_batch([b"old"], timestamps=[now - 600_000]))).error \
        == ErrorCode.INVALID_TIMESTAMP
    configs["message.timestamp.type"] = "LogAppendTime"  # broker time: bounds do not apply
    assert (await p.append(future)).error == 0


async def test_snapshot_skipped_when_unchanged(tmp_path):
    p, *_ = await open_partition(tmp_path)
    saved: list[int] = []
    store = p._producer_store
    original = store.save_snapshot
    store.save_snapshot = lambda *a: (saved.append(a[3]), original(*a))  # runs on the writer
    p.snapshot()
    p.snapshot()
    await p.append(make_batch([b"a"]))
    p.snapshot()
    p.snapshot()
    await p.trim_to(1)
    p.snapshot().result()
    assert saved == [0, 1, 1]


async def test_mutated_batches_never_raise(tmp_path):
    """Random byte flips, truncations and garbage: append answers an error code or accepts
    (a flip outside the CRC-covered bytes), never raises, and offsets stay contiguous."""
    import random

    rnd = random.Random(1234)
    p, *_ = await open_partition(tmp_path)
    seeds = [make_batch([b"k" * 40, b"v" * 70], codec=c) for c in CODECS] + \
        [make_batch([b"old"], magic=0), make_batch([b"old"], magic=1)]
    accepted = 0
    for i in range(600):
        b = bytearray(rnd.choice(seeds))
        kind = i % 4
        if kind == 0:
            for _ in range(rnd.randint(1, 4)):
                b[rnd.randrange(len(b))] = rnd.randrange(256)
        elif kind == 1:
            del b[rnd.randrange(len(b)):]
        elif kind == 2:
            b = bytearray(rnd.randbytes(rnd.randint(0, 200)))
        else:
            b += rnd.randbytes(rnd.randint(1, 80))
        r = await p.append(bytes(b), api_version=rnd.choice([2, 7, 9]))
        if r.error == 0:
            assert r.base_offset == accepted
            accepted = p.high_watermark
    assert p.high_watermark == accepted
    # whatever was accepted reads back as well-formed batches
    res = await p.read(0, 1 << 30)
    assert sum(h.last_offset_delta + 1 for b in res.batches for h in batch_headers(b.payload)) \
        == accepted


async def test_owned_frame_gets_offsets_in_place_and_foreign_buffers_stay_untouched(tmp_path):
    """owned=True (the server's request frame) writes the offset into the given buffer - no
    copy; a caller's buffer (owned=False, the default) is never changed."""
    p, *_ = await open_partition(tmp_path)
    await p.append(make_batch([b"first"]))
    foreign = bytearray(make_batch([b"a", b"b"]))
    before = bytes(foreign)
    r = await p.append(memoryview(foreign))
    assert (r.error, r.base_offset) == (0, 1)
    assert bytes(foreign) == before
    frame = bytearray(b"hdr" + make_batch([b"c"]))
    r = await p.append(memoryview(frame)[3:], owned=True)
    assert (r.error, r.base_offset) == (0, 3)
    assert batch_headers(bytes(frame[3:]))[0].base_offset == 3
    # read-only views are copied even when called owned
    ro = make_batch([b"d"])
    r = await p.append(memoryview(ro), owned=True)
    assert (r.error, r.base_offset) == (0, 4) and batch_headers(ro)[0].base_offset == 0
    assert [(o, v) for o, _, v in await read_all(p)] == [
        (0, b"first"), (1, b"a"), (2, b"b"), (3, b"c"), (4, b"d")]


async def test_owned_corrupt_batch_is_rejected(tmp_path):
    p, *_ = await open_partition(tmp_path)
    frame = bytearray(make_batch([b"payload" * 50]))
    frame[-4] ^= 0x01
    r = await p.append(memoryview(frame), owned=True)
    assert r.error == ErrorCode.CORRUPT_MESSAGE
    assert p.high_watermark == 0


async def test_a_partition_opened_during_a_metadata_outage_logs_the_episode_not_a_traceback(
        tmp_path, monkeypatch, caplog):
    """The producer state store out of reach when a partition opens (a PostgreSQL cut while a
    topic is created) is the store's one-line episode; idempotence state then lives in memory
    (session 26: it logged ERROR with a traceback, which test_stop_in_outage caught)."""
    import logging

    import broker.partition as partition_mod
    from storage import sqldb

    def unreachable(_broker):
        raise sqldb.MetadataUnreachable("cannot reach PostgreSQL metadata")
    noted: list[str] = []
    monkeypatch.setattr(partition_mod, "producer_store_for", unreachable)
    monkeypatch.setattr(sqldb, "note_unreachable", noted.append)
    with caplog.at_level(logging.DEBUG, logger="broker.partition"):
        p, *_ = await open_partition(tmp_path)
    assert (await p.append(make_batch([b"a"]))).error == 0
    bad = [r for r in caplog.records if r.name == "broker.partition"
           and (r.levelno >= logging.WARNING or r.exc_info)]
    assert not bad, [(r.levelname, r.getMessage()) for r in bad]
    assert noted and "cannot reach PostgreSQL" in noted[0], noted


class _CheckingDirectStream(MemoryStream):
    """A MemoryStream with the engine's task-less ``append_now``: the payload's CRC checked
    against ``check`` as the WAL's copy does (PayloadChecksumError, nothing taken), durable at
    once; each call's ``check`` kept (``append``'s too)."""

    def __init__(self) -> None:
        super().__init__(1)
        self.checks: list = []

    async def append(self, payload, base_offset, count, check=None) -> None:
        self.checks.append(check)
        await super().append(payload, base_offset, count, check)

    def append_now(self, payload, base_offset, count, then, check=None) -> bool:
        self.checks.append(check)
        if check is not None and crc32c.crc32c(memoryview(payload)[check[0]:]) != check[1]:
            raise PayloadChecksumError("payload CRC-32C mismatch")
        self._batches.append(Batch(base_offset, count, bytes(payload)))
        self._bases.append(base_offset)
        self._end = base_offset + count
        asyncio.get_running_loop().call_soon(then, None)
        return True


async def test_a_lone_large_batch_is_checked_and_stamped_in_c_its_crc_left_to_the_stream(
        tmp_path, monkeypatch):
    """Partition.append_now of a lone plain batch of STREAM_CHECKS_CRC_FROM bytes or more (a
    raw 1 MiB Produce request): stamp_plain checks and stamps it without reading it for its
    CRC, which goes to the stream's copy (``check``) - the Python checks (_prepare,
    _header_checks, _stamp) never run. A corrupt one is refused CORRUPT_MESSAGE by the stream
    with nothing appended, and the next batch takes the next offsets."""
    import protocol
    from broker import partition as partition_mod
    try:
        from protocol import _produce
    except ImportError:
        pytest.skip("protocol._produce not built")
    # a stale in-place build (stamp_plain without the deferred CRC) is not used: rebuild it
    assert partition_mod._stamp_plain is _produce.stamp_plain
    stream = _CheckingDirectStream()
    p, *_ = await open_partition(tmp_path, stream=stream)

    def python_path(*_a, **_k):
        raise AssertionError("the Python checks ran")
    for name in ("_prepare", "_header_checks", "_stamp"):
        monkeypatch.setattr(Partition, name, python_path)
    answers: list = []
    big = [bytearray(make_batch([f"{i}-{j}".encode() * 100 for j in range(400)]))
           for i in range(2)]
    assert all(len(b) >= partition_mod.STREAM_CHECKS_CRC_FROM for b in big)
    bad = bytearray(big[1])
    bad[len(bad) // 2] ^= 0x55                      # inside the records: the CRC fails
    for buf in (big[0], bad, big[1]):
        assert p.append_now(memoryview(buf), 9, answers.append)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert [(r.error, r.base_offset) for r in answers] == [
        (0, 0), (ErrorCode.CORRUPT_MESSAGE, -1), (0, 400)]
    assert stream.checks == [(protocol.CRC_START, int.from_bytes(b[17:21], "big"))
                             for b in (big[0], bad, big[1])]
    monkeypatch.undo()
    assert p.high_watermark == 800
    assert [v for _, _, v in await read_all(p)] == [f"{i}-{j}".encode() * 100 for i in range(2)
                                                    for j in range(400)]


class _TrustingDirectStream(_CheckingDirectStream):
    """A stream that checks no payload CRC (Stream.checks_payloads False): takes what it gets."""

    checks_payloads = False

    def append_now(self, payload, base_offset, count, then, check=None) -> bool:
        assert check is None, "a CRC handed to a stream that does not check payloads"
        return super().append_now(payload, base_offset, count, then)


async def test_a_lone_large_corrupt_batch_for_a_stream_without_checks_is_refused_here(tmp_path):
    """A stream that checks no payloads gets no deferred CRC: the partition checks a lone large
    batch's CRC itself, so a corrupt one is refused CORRUPT_MESSAGE before the stream sees it."""
    stream = _TrustingDirectStream()
    p, *_ = await open_partition(tmp_path, stream=stream)
    answers: list = []
    bad = bytearray(make_batch([b"c" * 100_000]))
    bad[len(bad) // 2] ^= 0x55
    assert p.append_now(memoryview(bad), 9, answers.append)
    assert p.append_now(memoryview(bytearray(make_batch([b"d" * 100_000]))), 9, answers.append)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert [(r.error, r.base_offset) for r in answers] == [(ErrorCode.CORRUPT_MESSAGE, -1), (0, 0)]
    assert stream.checks == [None]
