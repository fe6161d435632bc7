"""broker/compaction.py over a real engine, in-process: what a cleaning pass keeps."""
from __future__ import annotations

import pathlib
import sys
import types
import uuid

import pytest

from broker.compaction import LogCleaner
from broker.partition import Partition
from protocol import build_batch, decode_records, iter_batches
from protocol.batches import DELETE_HORIZON_MASK, validate_batch
from protocol.compression import GZIP
from protocol.records import Record
from storage.engine import open_engine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "storage"))
from storage_helpers import small_config  # noqa: E402

NOW = 1_800_000_000_000
DAY = 86_400_000


def batch(pairs, ts=NOW - 10 * DAY, **kw) -> bytes:
    return build_batch([Record(i, ts + i, k, v) for i, (k, v) in enumerate(pairs)], **kw)


async def records(p: Partition) -> list[tuple[int, bytes | None, bytes | None]]:
    out, off = [], p.log_start_offset
    while off < p.high_watermark:
        res = await p.read(off, 1 << 20)
        assert res.error == 0 and res.batches, f"nothing at {off}"
        for b in res.batches:
            for v in iter_batches(b.payload):
                validate_batch(v, strict=False)     # CRC-32C of every rewritten batch
                out += [(r.offset, r.key, r.value) for r in decode_records(v)]
            off = b.next_offset
    return out


@pytest.fixture
async def engine(tmp_path):
    eng = open_engine(small_config(tmp_path / "data", compaction_min_objects=2))
    await eng.start()
    yield eng
    await eng.close()


async def open_p(eng, tmp_path, configs) -> tuple[Partition, LogCleaner]:
    broker = types.SimpleNamespace(config=types.SimpleNamespace(
        data_dir=str(tmp_path), log_cleaner_io_max_bytes_per_second=0), topics={})
    stream = await eng.create_stream()
    p = await Partition.open(broker, "t", uuid.uuid4(), 0, stream, configs)
    return p, LogCleaner(broker)


async def test_latest_value_per_key_offsets_preserved(engine, tmp_path) -> None:
    p, cleaner = await open_p(engine, tmp_path, {"cleanup.policy": "compact"})
    expect: dict[bytes, tuple[int, bytes]] = {}
    off = 0
    for rnd in range(20):
        pairs = [(b"k%d" % (i % 7), b"v%d-%d" % (rnd, i)) for i in range(5)]
        codec = GZIP if rnd % 3 == 0 else 0
        assert (await p.append(batch(pairs, compression=codec, producer_id=7,
                                     producer_epoch=0, base_sequence=off))).error == 0
        for i, (k, v) in enumerate(pairs):
            expect[k] = (off + i, v)
        off += 5
        if rnd % 4 == 3:
            await engine.flush()
    await p.append(batch([(b"k0", b"tail")], ts=NOW))   # not uploaded: never cleaned
    n_objects = len(engine.store.list())
    res = await cleaner.clean(p, NOW)
    assert res is not None and res.end == 100 and res.bytes_after < res.bytes_before / 3
    await engine.maintenance.purge()
    engine.drop_caches()
    got = await records(p)
    assert got[:-1] == sorted((o, k, v) for k, (o, v) in expect.items())
    assert got[-1] == (100, b"k0", b"tail")
    assert len(engine.store.list()) < n_objects
    # the last batch keeps the producer's sequence and the batch's offset span
    last = [v for b in (await p.read(95, 1 << 20)).batches for v in iter_batches(b.payload)][0]
    assert (last.base_offset, last.last_offset_delta, last.base_sequence) == (95, 4, 95)
    assert await cleaner.clean(p, NOW) is None          # nothing dirty: no pass


async def test_tombstones_kept_delete_retention_then_removed(engine, tmp_path) -> None:
    p, cleaner = await open_p(engine, tmp_path, {"cleanup.policy": "compact",
                                                 "delete.retention.ms": "1000"})
    await p.append(batch([(b"a", b"1"), (b"b", b"1"), (b"c", b"1")]))
    await p.append(batch([(b"a", None), (b"b", b"2")]))
    await engine.flush()
    assert await cleaner.clean(p, NOW)
    got = await records(p)
    assert got == [(2, b"c", b"1"), (3, b"a", None), (4, b"b", b"2")]
    horizon = [v for b in (await p.read(3, 1 << 20)).batches for v in iter_batches(b.payload)]
    assert horizon[-1].attributes & DELETE_HORIZON_MASK and horizon[-1].base_timestamp == NOW + 1000
    await p.append(batch([(b"d", b"1")]))
    await engine.flush()
    await cleaner.clean(p, NOW + 500, force=True)        # before the horizon: still there
    assert (3, b"a", None) in await records(p)
    assert await cleaner.clean(p, NOW + 900) is None     # nothing dirty, horizon ahead
    assert await cleaner.clean(p, NOW + 1001)            # the horizon passed: a pass is due
    engine.drop_caches()
    assert await records(p) == [(2, b"c", b"1"), (4, b"b", b"2"), (5, b"d", b"1")]


async def test_dirty_ratio_and_compaction_lag(engine, tmp_path) -> None:
    configs = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.9"}
    p, cleaner = await open_p(engine, tmp_path, configs)
    for i in range(10):
        await p.append(batch([(b"k", b"%d" % i)]))
    await engine.flush()
    assert await cleaner.clean(p, NOW)                  # all dirty: ratio 1.0
    await p.append(batch([(b"k", b"new")]))
    await engine.flush()
    assert await cleaner.clean(p, NOW) is None          # small dirty share: below 0.9
    configs["max.compaction.lag.ms"] = str(DAY)         # but the dirty batch is 10 days old
    assert await cleaner.clean(p, NOW)
    assert [v for _, _, v in await records(p)] == [b"new"]
    configs["min.compaction.lag.ms"] = str(DAY)
    await p.append(batch([(b"k", b"newer")], ts=NOW - 1000))
    await engine.flush()
    assert await cleaner.clean(p, NOW, force=True) is None   # too recent to clean
    assert [v for _, _, v in await records(p)] == [b"new", b"newer"]


async def test_map_full_cleans_in_passes(engine, tmp_path) -> None:
    p, cleaner = await open_p(engine, tmp_path, {"cleanup.policy": "compact"})
    cleaner.map_bytes = 40 * 120                        # 40 keys per pass
    for rnd in range(3):
        for i in range(0, 100, 10):
            await p.append(batch([(b"k%d" % (i + j), b"%d" % rnd) for j in range(10)]))
            await engine.flush()
    passes = 0
    while await cleaner.clean(p, NOW, force=True):
        passes += 1
    assert passes >= 3
    got = await records(p)
    assert sorted(k for _, k, _ in got) == sorted(b"k%d" % i for i in range(100))
    assert {v for _, _, v in got} == {b"2"}


async def test_compact_delete_policy_trims_and_compacts(engine, tmp_path, monkeypatch) -> None:
    import broker.partition as partition_mod
    from broker.compaction import is_compacted
    monkeypatch.setattr(partition_mod, "CHUNK_BYTES", 1)    # retention at batch granularity
    from broker.retention import apply_retention
    assert is_compacted({"cleanup.policy": "compact, delete"})
    assert not is_compacted({"cleanup.policy": "delete"}) and not is_compacted({})
    configs = {"cleanup.policy": "compact,delete", "retention.ms": str(5 * DAY)}
    p, cleaner = await open_p(engine, tmp_path, configs)
    await p.append(batch([(b"a", b"old"), (b"b", b"old")], ts=NOW - 9 * DAY))
    await p.append(batch([(b"a", b"1"), (b"c", b"1")], ts=NOW - 2 * DAY))
    await p.append(batch([(b"a", b"2"), (b"c", b"2")], ts=NOW - DAY))
    await engine.flush()
    await apply_retention([p], now_ms=NOW)
    assert p.log_start_offset == 2                       # b's only value is gone with retention
    assert await cleaner.clean(p, NOW)
    engine.drop_caches()
    assert await records(p) == [(4, b"a", b"2"), (5, b"c", b"2")]


async def test_aborted_data_removed_and_ongoing_transactions_left_alone(engine, tmp_path) -> None:
    p, cleaner = await open_p(engine, tmp_path, {"cleanup.policy": "compact"})
    if not hasattr(p, "txns"):
        pytest.skip("no transactions in this tree")
    await p.append(batch([(b"k", b"committed"), (b"j", b"1")]))
    s = p.stream
    # an aborted transaction's write of k at offset 2, its ABORT marker at 3 (written straight
    # to the stream: the aborted index says so, as the transaction coordinator would leave it)
    aborted = build_batch([Record(2, NOW - DAY, b"k", b"aborted")], producer_id=9,
                          producer_epoch=0, base_sequence=0, transactional=True)
    await s.append(aborted, 2, 1)
    marker = build_batch([Record(3, NOW - DAY, b"\x00\x00\x00\x00", b"\x00" * 6)],
                         producer_id=9, producer_epoch=0, transactional=True, control=True)
    await s.append(marker, 3, 1)
    p.txns.begin(9, 2)
    p.txns.end(9, 0, False, 3)
    await p.append(batch([(b"j", b"2")]))
    await engine.flush()
    p.txns.begin(11, 4)                                  # an ongoing transaction from 4 on
    assert p.last_stable_offset == 4
    res = await cleaner.clean(p, NOW)
    # nothing at or past the LSO is cleaned (None when one object holds it all; a background
    # upload under load may have split the log at 3, and [0, 3) may be cleaned)
    assert res is None or res.end <= 4
    p.txns.ongoing.pop(11)                               # (committed)
    assert await cleaner.clean(p, NOW, force=True)
    engine.drop_caches()
    got = await records(p)
    assert (0, b"k", b"committed") in got                 # not superseded by the aborted write
    assert (2, b"k", b"aborted") not in got               # aborted data removed
    assert (3, b"\x00\x00\x00\x00", b"\x00" * 6) in got   # its marker kept (for now)
    assert (1, b"j", b"1") not in got and (4, b"j", b"2") in got
