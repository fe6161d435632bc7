"""The coordinator in-process over a real engine: a transaction a crash left prepared is
completed by the next coordinator (markers written, offsets committed), an Ongoing one past its
timeout is aborted with the epoch bumped, and the state survives in the metadata store."""
from __future__ import annotations

import asyncio
import pathlib
import sys
import types
import uuid

import pytest

from broker.partition import Partition
from broker.producer_state import _meta_db_url
from broker.transactions import coordinator_for, ensure_transactions, stop_transactions
from broker.transactions.coordinator import TransactionCoordinator
from broker.transactions.store import (COMPLETE_ABORT, COMPLETE_COMMIT, ONGOING, PREPARE_COMMIT,
                                       TxnStore)
from protocol import build_batch
from protocol.records import Record
from storage.engine import open_engine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "storage"))
from storage_helpers import small_config  # noqa: E402


class Groups:
    """Stands in for the group coordinator: records what a commit makes visible."""

    def __init__(self) -> None:
        self.committed: dict[str, list] = {}

    async def commit_txn_offsets(self, group_id, offsets) -> None:
        self.committed.setdefault(group_id, []).extend(offsets)


@pytest.fixture
async def setup(tmp_path):
    eng = open_engine(small_config(tmp_path / "data", compaction_min_objects=2))
    await eng.start()
    broker = types.SimpleNamespace(config=types.SimpleNamespace(data_dir=str(tmp_path)),
                                   topics={}, groups=Groups())
    stream = await eng.create_stream()
    p = await Partition.open(broker, "t", uuid.uuid4(), 0, stream, {})
    broker.topics["t"] = types.SimpleNamespace(partitions=[p])
    await ensure_transactions(broker)
    yield broker, p
    await p.close()
    await stop_transactions(broker)
    await eng.close()


async def begin(broker, p, tid: str, timeout_ms: int = 60_000) -> tuple[int, int]:
    coord = coordinator_for(broker)
    err, pid, epoch = await coord.init_producer_id(tid, timeout_ms)
    assert err == 0
    assert await coord.add_partitions(tid, pid, epoch, [("t", 0)], lambda t, i: True) \
        == {("t", 0): 0}
    batch = build_batch([Record(0, 1, b"k", b"v")], producer_id=pid, producer_epoch=epoch,
                        base_sequence=0, transactional=True)
    assert (await p.append(batch)).error == 0
    return pid, epoch


async def restart_coordinator(broker) -> TransactionCoordinator:
    await stop_transactions(broker)
    return await ensure_transactions(broker)


async def test_prepared_commit_is_completed_after_a_crash(setup) -> None:
    broker, p = setup
    pid, epoch = await begin(broker, p, "prep")
    coord = coordinator_for(broker)
    assert await coord.add_offsets("prep", pid, epoch, "g") == 0
    assert await coord.txn_offset_commit("prep", "g", pid, epoch, [("t", 0, 1, -1, "")]) == 0
    assert broker.groups.committed == {}
    # the crash: PrepareCommit durable, no marker written yet
    meta = coord.txns["prep"]
    meta.state = PREPARE_COMMIT
    await coord._save(meta)
    assert p.last_stable_offset == 0
    coord = await restart_coordinator(broker)
    assert coord.txns["prep"].state == PREPARE_COMMIT
    assert await coord._tick(True)
    assert coord.txns["prep"].state == COMPLETE_COMMIT
    assert p.last_stable_offset == p.high_watermark == 2   # record + COMMIT marker
    assert broker.groups.committed == {"g": [("t", 0, 1, -1, "")]}
    assert p.aborted_between(0, 2) == []
    store = TxnStore(_meta_db_url(broker))
    try:
        assert [m.state for m in store.load_all()] == [COMPLETE_COMMIT]
    finally:
        store.close()


async def test_timed_out_transaction_is_aborted_and_its_producer_fenced(setup) -> None:
    broker, p = setup
    pid, epoch = await begin(broker, p, "slow", timeout_ms=1)
    coord = coordinator_for(broker)
    coord.txns["slow"].start_ms -= 10
    assert coord.txns["slow"].state == ONGOING
    assert await coord._tick(False)
    meta = coord.txns["slow"]
    assert (meta.state, meta.epoch) == (COMPLETE_ABORT, epoch + 1)
    assert p.last_stable_offset == p.high_watermark == 2
    assert p.aborted_between(0, 2) == [(pid, 0)]
    assert await coord.end_txn("slow", pid, epoch, True) != 0   # the old epoch is fenced
    late = build_batch([Record(0, 1, b"k", b"late")], producer_id=pid, producer_epoch=epoch,
                       base_sequence=1, transactional=True)
    assert (await p.append(late)).error != 0


async def test_idle_transactional_ids_expire(setup) -> None:
    broker, p = setup
    pid, epoch = await begin(broker, p, "idle")
    coord = coordinator_for(broker)
    assert await coord.end_txn("idle", pid, epoch, True) == 0
    assert await coord._tick(False) and "idle" in coord.txns   # not idle long enough yet
    coord.expiration_ms = 0
    coord.txns["idle"].update_ms -= 10
    store = TxnStore(_meta_db_url(broker))
    try:
        assert [m.transactional_id for m in store.load_all()] == ["idle"]
        assert await coord._tick(False)
        assert "idle" not in coord.txns and pid not in coord.by_pid
        assert store.load_all() == []
        # a new instance starts over with a new producer id
        err, pid2, epoch2 = await coord.init_producer_id("idle", 60_000)
        assert (err, epoch2) == (0, 0) and pid2 != pid
    finally:
        store.close()


async def test_lso_waits_for_the_log_tail_replay(setup) -> None:
    """Reopened while the log tail cannot be read yet (object store down): the transactions in
    it are unknown, so the LSO stays where the replay started instead of exposing them."""
    broker, p = setup
    await begin(broker, p, "unreplayed")   # an open transaction at offset 0
    assert (p.last_stable_offset, p.high_watermark) == (0, 1)
    stream = p.stream
    real_read = stream.read

    async def stuck_read(*args, **kwargs):
        await asyncio.sleep(3600)

    stream.read = stuck_read
    try:
        again = Partition(broker, "t", p.topic_id, 0, stream, {}, None)  # no snapshot
        await again._restore()
        assert not again._producers_ready
        assert again.high_watermark == 1 and again.last_stable_offset == 0
    finally:
        stream.read = real_read
        await again.close()


async def test_a_reload_keeps_the_state_a_request_is_changing(setup) -> None:
    """The coordinator rereads its ids when the cluster's membership changes. A read that
    crosses an AddPartitionsToTxn (its save queued behind the read) must not replace the
    transaction the request is changing with the row as it was: the next transaction's
    produce would be refused (INVALID_TXN_STATE), its EndTxn too."""
    broker, p = setup
    pid, epoch = await begin(broker, p, "reread")
    coord = coordinator_for(broker)
    assert await coord.end_txn("reread", pid, epoch, False) == 0
    # the reread starts first, then the next transaction adds the partition
    reload = asyncio.ensure_future(coord._load())
    await asyncio.sleep(0)
    added = await coord.add_partitions("reread", pid, epoch, [("t", 0)], lambda t, i: True)
    await reload
    assert added == {("t", 0): 0}
    assert coord.verify(pid, epoch, "t", 0) == 0
    batch = build_batch([Record(0, 1, b"k", b"v2")], producer_id=pid, producer_epoch=epoch,
                        base_sequence=1, transactional=True)
    assert (await p.append(batch)).error == 0
    assert await coord.end_txn("reread", pid, epoch, True) == 0
    assert coord.txns["reread"].state == COMPLETE_COMMIT


async def test_a_reload_takes_a_row_another_broker_wrote(setup) -> None:
    """A row written by another broker meanwhile (a newer row version) replaces what this one
    held: the store is the authority between coordinators."""
    broker, p = setup
    pid, epoch = await begin(broker, p, "moved")
    coord = coordinator_for(broker)
    store = TxnStore(_meta_db_url(broker))
    try:
        other = store.load_one("moved")
        other.epoch += 1
        other.state = COMPLETE_ABORT
        other.partitions = set()
        store.save(other.to_row(), other.row_version)
    finally:
        store.close()
    await coord._load()
    meta = coord.txns["moved"]
    assert (meta.state, meta.epoch) == (COMPLETE_ABORT, epoch + 1)
    assert coord.by_pid[pid] is meta
    assert coord.verify(pid, epoch, "t", 0) != 0



async def test_a_late_copy_of_a_marker_does_not_end_the_next_transaction(setup) -> None:
    """A marker call that timed out at the coordinator, was retried, and reached the leader
    only after the next transaction began: written, it would end (abort) that transaction
    here. Markers carry a number that grows per transaction; the leader answers a copy of one
    it holds already without writing it, also after a restart (rebuilt from the log)."""
    broker, p = setup
    pid, epoch = await begin(broker, p, "late")           # data at offset 0
    coord = coordinator_for(broker)
    assert await coord.end_txn("late", pid, epoch, False) == 0   # ABORT marker at 1
    first = p.txns.marked[pid]
    assert first > 0
    assert await coord.add_partitions("late", pid, epoch, [("t", 0)], lambda t, i: True) \
        == {("t", 0): 0}
    batch = build_batch([Record(0, 1, b"k", b"kept")], producer_id=pid, producer_epoch=epoch,
                        base_sequence=1, transactional=True)
    assert (await p.append(batch)).base_offset == 2
    assert await p.write_marker(pid, epoch, False, first, from_coordinator=True) == 0
    assert (p.high_watermark, p.last_stable_offset) == (3, 2)   # nothing written, still open
    assert await coord.end_txn("late", pid, epoch, True) == 0    # COMMIT marker at 3
    assert (p.high_watermark, p.last_stable_offset) == (4, 4)
    assert p.aborted_between(0, 4) == [(pid, 0)]                 # the commit is not hidden
    second = p.txns.marked[pid]
    assert second > first
    # rebuilt from the log after a restart (no snapshot): the copy is still recognised
    again = Partition(broker, "t", p.topic_id, 0, p.stream, {}, None)
    try:
        await again._restore()
        assert again.txns.marked[pid] == second
        assert again.txns.marked_already(pid, first)
        assert not again.txns.marked_already(pid, second + 1)
    finally:
        await again.close()
    # a marker from elsewhere (Admin's abortTransaction) is written as before
    assert await p.write_marker(pid, epoch, False, 0) == 0
    assert p.high_watermark == 5
