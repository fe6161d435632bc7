"""The log cleaner and transactions, in-process over a real engine: an aborted transaction's
value never becomes a key's latest (read_committed readers would lose the key), and nothing
past the last stable offset is cleaned (an open transaction may still abort)."""
from __future__ import annotations

import pathlib
import sys
import types
import uuid

import pytest

from broker.compaction import LogCleaner
from broker.partition import Partition
from broker.transactions import coordinator_for, ensure_transactions, stop_transactions
from broker.transactions.markers import marker_is_commit
from protocol import build_batch, decode_records, iter_batches
from protocol.records import Record
from storage.engine import open_engine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "storage"))
from storage_helpers import small_config  # noqa: E402

NOW = 1_800_000_000_000
OLD = NOW - 10 * 86_400_000


def batch(pairs, **kw) -> bytes:
    return build_batch([Record(i, OLD + i, k, v) for i, (k, v) in enumerate(pairs)], **kw)


async def committed_view(p: Partition) -> dict[bytes, bytes]:
    """key -> latest value as a read_committed reader applies the log."""
    out: dict[bytes, bytes] = {}
    off = p.log_start_offset
    while off < p.last_stable_offset:
        res = await p.read(off, 1 << 20, read_committed=True)
        assert res.error == 0 and res.batches
        # as Kafka's consumers apply the list: a producer's batches are aborted from the
        # transaction's first offset up to its ABORT marker
        pending = sorted(res.aborted or [], key=lambda a: a[1])
        aborted: set[int] = set()
        for b in res.batches:
            for v in iter_batches(b.payload):
                while pending and pending[0][1] <= v.base_offset + v.last_offset_delta:
                    aborted.add(pending.pop(0)[0])
                if v.is_control:
                    if marker_is_commit(v) is False:
                        aborted.discard(v.producer_id)
                    continue
                if v.is_transactional and v.producer_id in aborted:
                    continue
                for r in decode_records(v):
                    out[r.key] = r.value
            off = b.next_offset
    return out


@pytest.fixture
async def setup(tmp_path):
    eng = open_engine(small_config(tmp_path / "data", compaction_min_objects=2))
    await eng.start()
    broker = types.SimpleNamespace(config=types.SimpleNamespace(
        data_dir=str(tmp_path), log_cleaner_io_max_bytes_per_second=0), topics={})
    stream = await eng.create_stream()
    p = await Partition.open(broker, "t", uuid.uuid4(), 0, stream, {"cleanup.policy": "compact"})
    broker.topics["t"] = types.SimpleNamespace(partitions=[p])
    await ensure_transactions(broker)
    yield eng, broker, p
    await p.close()
    await stop_transactions(broker)
    await eng.close()


async def txn(broker, p: Partition, tid: str, pairs, commit: bool | None) -> None:
    coord = coordinator_for(broker)
    err, pid, epoch = await coord.init_producer_id(tid, 60_000)
    assert err == 0
    errs = await coord.add_partitions(tid, pid, epoch, [("t", 0)], lambda t, i: True)
    assert errs == {("t", 0): 0}
    res = await p.append(batch(pairs, producer_id=pid, producer_epoch=epoch, base_sequence=0,
                               transactional=True))
    assert res.error == 0, res
    if commit is not None:
        assert await coord.end_txn(tid, pid, epoch, commit) == 0


async def test_aborted_values_never_win_and_open_ones_are_not_cleaned(setup) -> None:
    eng, broker, p = setup
    for rnd in range(4):
        assert (await p.append(batch([(b"k%d" % i, b"c%d-%d" % (rnd, i)) for i in range(4)]))).error == 0
        await eng.flush()
    await txn(broker, p, "aborter", [(b"k0", b"aborted"), (b"k1", b"aborted")], commit=False)
    await txn(broker, p, "committer", [(b"k2", b"txn-committed")], commit=True)
    await eng.flush()
    await txn(broker, p, "open", [(b"k3", b"open")], commit=None)
    for rnd in range(3):   # behind the open transaction: past the LSO
        assert (await p.append(batch([(b"k%d" % i, b"late%d-%d" % (rnd, i)) for i in range(4)]))).error == 0
        await eng.flush()
    before = await committed_view(p)
    assert before == {b"k0": b"c3-0", b"k1": b"c3-1", b"k2": b"txn-committed", b"k3": b"c3-3"}
    lso = p.last_stable_offset
    res = await LogCleaner(broker).clean(p, NOW, force=True)
    assert res is not None and res.end <= lso
    await eng.maintenance.purge()
    eng.drop_caches()
    assert await committed_view(p) == before
    assert p.last_stable_offset == lso


async def log_batches(p: Partition) -> list:
    """Every batch view of the log from its start to the high watermark (read_uncommitted)."""
    out = []
    off = p.log_start_offset
    while off < p.high_watermark:
        res = await p.read(off, 1 << 20)
        assert res.error == 0 and res.batches
        for b in res.batches:
            out.extend(iter_batches(b.payload))
            off = b.next_offset
    return out


def uncommitted_view(views) -> dict[bytes, bytes]:
    """key -> latest value as a read_uncommitted reader applies the log (aborted data too)."""
    out: dict[bytes, bytes] = {}
    for v in views:
        if not v.is_control:
            for r in decode_records(v):
                out[r.key] = r.value
    return out


async def test_aborted_data_then_markers_removed(setup) -> None:
    """Aborted transactions' data goes at the first pass (read_uncommitted readers stop seeing
    it); a marker whose transaction has no batch left is flagged with a delete horizon and
    removed by the first pass after delete.retention.ms, with its aborted-index entry;
    read_committed readers see the same values throughout."""
    eng, broker, p = setup
    p.configs["delete.retention.ms"] = "60000"
    for rnd in range(2):
        assert (await p.append(batch([(b"k%d" % i, b"c%d-%d" % (rnd, i)) for i in range(4)]))).error == 0
        await eng.flush()
    await txn(broker, p, "ab", [(b"k0", b"aborted"), (b"k1", b"aborted")], commit=False)
    await txn(broker, p, "ab", [(b"k4", b"ab-later")], commit=True)   # "ab"'s last batch
    await txn(broker, p, "cm", [(b"k2", b"txn-1")], commit=True)
    await txn(broker, p, "cm", [(b"k2", b"txn-2")], commit=True)     # supersedes txn-1
    await eng.flush()
    for i in range(2):       # fresh values of other keys, so all of the above is cleanable
        assert (await p.append(batch([(b"k5", b"x%d" % i)]))).error == 0
        await eng.flush()
    views = await log_batches(p)
    assert sum(v.is_control for v in views) == 4
    assert uncommitted_view(views)[b"k0"] == b"aborted"
    want = {b"k0": b"c1-0", b"k1": b"c1-1", b"k2": b"txn-2", b"k3": b"c1-3", b"k4": b"ab-later",
            b"k5": b"x1"}
    assert await committed_view(p) == want
    assert len(p.txns.aborted) == 1
    cleaner = LogCleaner(broker)

    # pass 1: aborted data and the superseded committed batch go; their markers get a horizon
    res = await cleaner.clean(p, NOW, force=True)
    assert res is not None and res.aborted_dropped == 2 and res.markers_dropped == 0, res
    await eng.maintenance.purge()
    eng.drop_caches()
    views = await log_batches(p)
    assert uncommitted_view(views) == want          # read_uncommitted: no aborted value left
    assert await committed_view(p) == want
    markers = [v for v in views if v.is_control]
    assert len(markers) == 4
    flagged = [v for v in markers if v.attributes & 0x40]
    assert len(flagged) == 2 and all(v.base_timestamp == NOW + 60_000 for v in flagged)
    assert len(p.txns.aborted) == 1                 # the marker is still there

    # before the horizon nothing more goes; after it the two markers do
    res = await cleaner.clean(p, NOW + 59_000, force=True)
    assert res is None or res.markers_dropped == 0
    res = await cleaner.clean(p, NOW + 60_001)      # due by the horizon alone
    assert res is not None and res.markers_dropped == 2, res
    await eng.maintenance.purge()
    eng.drop_caches()
    views = await log_batches(p)
    kept = [v for v in views if v.is_control]
    assert len(kept) == 2 and not any(v.attributes & 0x40 for v in kept)   # last txns' markers
    assert p.txns.aborted == []
    assert uncommitted_view(views) == want
    assert await committed_view(p) == want
