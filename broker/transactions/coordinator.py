"""The transaction coordinator (Kafka's TransactionCoordinator, one node).

Every transactional id has a ``TxnMeta`` kept in memory and written through to the metadata
store (``store.TxnStore``) before an answer goes out. The state machine follows Kafka:
Empty -> Ongoing (AddPartitionsToTxn / AddOffsetsToTxn) -> PrepareCommit|PrepareAbort (EndTxn,
durable) -> markers written to every partition of the transaction and, on commit, the pending
offsets made visible to their groups -> CompleteCommit|CompleteAbort (durable) -> answer.
A crash between the two durable steps is completed on start. An Ongoing transaction older than
its timeout is aborted by the broker, with the epoch bumped so the producer is fenced.

Per transactional id, one operation at a time (an asyncio lock). The in-memory state changes
before any await, so a partition's verification (``verify``) of a transactional batch and the
coordinator's decision to end its transaction are ordered: a batch verified before the state
left Ongoing got its offsets before the marker's.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

from protocol import ErrorCode as E

from ..periodic import Periodic
from ..producer_state import EPOCH_MAX, producer_store_for
from .markers import build_marker
from .store import (COMPLETE_ABORT, COMPLETE_COMMIT, EMPTY, ONGOING, PREPARE_ABORT,
                    PREPARE_COMMIT, TxnMeta, TxnStore)

log = logging.getLogger(__name__)

COORDINATOR_EPOCH = 0  # one node: the coordinator never moves (yet)
EXPIRATION_MS = 604_800_000  # Kafka's transactional.id.expiration.ms (7 days)
CHECK_INTERVAL_S = 1.0  # Kafka's transaction.abort.timed.out.transaction.cleanup.interval.ms is 10 s
MARKER_ATTEMPTS = 5


def _now_ms() -> int:
    return int(time.time() * 1000)


class TxnError(Exception):
    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or E(code).name)
        self.code = code


class TransactionCoordinator:
    """Coordinates every transactional id of this broker (see the module docstring)."""

    def __init__(self, broker: Any, store: TxnStore) -> None:
        self.broker = broker
        self.store = store
        self.txns: dict[str, TxnMeta] = {}
        self.by_pid: dict[int, TxnMeta] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._io = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="s3kafka-txn-state")
        self._recovering = True
        self._closed = False
        self._active = True
        cfg = getattr(broker, "config", None)
        self.max_timeout_ms = int(getattr(cfg, "transaction_max_timeout_ms", 900_000))
        self.check_interval_s = float(getattr(cfg, "transaction_check_interval_s",
                                              CHECK_INTERVAL_S))
        self.expiration_ms = int(getattr(cfg, "transactional_id_expiration_ms", EXPIRATION_MS))
        self._periodic = Periodic("s3kafka-txn-coordinator", self.check_interval_s, self._pass,
                                  log, immediate=True)

    # --- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Load every transactional id; unfinished transactions are finished by the loop."""
        await self._load()
        self._periodic.start()

    async def close(self) -> None:
        self._closed = True
        await self._periodic.stop()
        self._io.shutdown(wait=True)
        self.store.close()

    async def _load(self) -> None:
        """(Re)read every transactional id's state from the metadata store."""
        metas = await self._run(self.store.load_all)
        self.txns = {m.transactional_id: m for m in metas}
        self.by_pid = {m.producer_id: m for m in metas}
        self._active = self.is_active()

    def is_active(self) -> bool:
        """In a cluster only the controller coordinates transactions (FindCoordinator sends
        clients there); the state is in the shared metadata store, so a broker that becomes
        the controller reloads it and finishes what the previous one left."""
        cluster = getattr(self.broker, "cluster", None)
        if cluster is None:
            return True
        node = getattr(getattr(self.broker, "config", None), "node_id", None)
        return getattr(cluster, "controller_id", node) == node

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _save(self, meta: TxnMeta) -> None:
        meta.update_ms = _now_ms()
        await self._run(self.store.save, meta.to_row())

    def _lock(self, tid: str) -> asyncio.Lock:
        lock = self._locks.get(tid)
        if lock is None:
            lock = self._locks[tid] = asyncio.Lock()
        return lock

    async def _pass(self) -> None:
        """Finish transactions a crash left prepared; abort the ones past their timeout."""
        if await self._tick(self._recovering):
            self._recovering = False

    async def _tick(self, recovering: bool) -> bool:
        """One pass; False while the broker is still opening its topics (a marker for a
        partition not open yet must not be taken for one of a deleted topic)."""
        if getattr(self.broker, "_server", True) is None:
            return False
        if not self.is_active():
            self._active = False  # another broker coordinates: never act on stale state
            return True
        if not self._active:
            await self._load()    # became the coordinator: take the state over
            recovering = True
        now = _now_ms()
        for meta in list(self.txns.values()):
            if meta.state in (PREPARE_COMMIT, PREPARE_ABORT):
                async with self._lock(meta.transactional_id):
                    if meta.state in (PREPARE_COMMIT, PREPARE_ABORT):
                        if recovering:
                            log.info("completing transaction transactional_id=%s state=%s",
                                     meta.transactional_id, meta.state)
                        await self._complete(meta)
            elif meta.state in (EMPTY, COMPLETE_COMMIT, COMPLETE_ABORT) \
                    and now - meta.update_ms > self.expiration_ms:
                async with self._lock(meta.transactional_id):
                    await self._expire(meta)
            elif meta.state == ONGOING and now - meta.start_ms > meta.timeout_ms:
                async with self._lock(meta.transactional_id):
                    if meta.state == ONGOING and _now_ms() - meta.start_ms > meta.timeout_ms:
                        log.info("aborting timed-out transaction transactional_id=%s "
                                 "producer_id=%d epoch=%d timeout_ms=%d", meta.transactional_id,
                                 meta.producer_id, meta.epoch, meta.timeout_ms)
                        await self._abort_with_bump(meta)
        return True

    async def _expire(self, meta: TxnMeta) -> None:
        """Forget a transactional id idle for transactional.id.expiration.ms (as Kafka): its
        next InitProducerId starts again with a new producer id."""
        tid = meta.transactional_id
        if self.txns.get(tid) is not meta or meta.state not in (EMPTY, COMPLETE_COMMIT,
                                                                 COMPLETE_ABORT):
            return
        await self._run(self.store.delete, tid)
        self.txns.pop(tid, None)
        if self.by_pid.get(meta.producer_id) is meta:
            del self.by_pid[meta.producer_id]
        self._locks.pop(tid, None)
        log.info("transactional id expired transactional_id=%s producer_id=%d", tid,
                 meta.producer_id)

    # --- InitProducerId ----------------------------------------------------------------------
    async def init_producer_id(self, tid: str, timeout_ms: int, producer_id: int = -1,
                               producer_epoch: int = -1) -> tuple[int, int, int]:
        """(error, producer id, epoch): bump the epoch (fencing the previous instance), after
        finishing whatever transaction the previous instance left."""
        if timeout_ms <= 0 or timeout_ms > self.max_timeout_ms:
            return E.INVALID_TRANSACTION_TIMEOUT, -1, -1
        if not self.is_active():
            return E.NOT_COORDINATOR, -1, -1
        async with self._lock(tid):
            meta = self.txns.get(tid)
            if meta is None:
                pid = await self._allocate()
                meta = TxnMeta(tid, pid, 0, timeout_ms, EMPTY)
                await self._save(meta)
                self.txns[tid] = meta
                self.by_pid[pid] = meta
                return E.NONE, pid, 0
            if producer_id >= 0:
                # KIP-360: a producer recovering from an abortable error names itself
                if producer_id != meta.producer_id or producer_epoch < meta.epoch - 1:
                    return E.PRODUCER_FENCED, -1, -1
            if meta.state in (PREPARE_COMMIT, PREPARE_ABORT):
                await self._complete(meta)
                if meta.state in (PREPARE_COMMIT, PREPARE_ABORT):
                    return E.CONCURRENT_TRANSACTIONS, -1, -1
            if meta.state == ONGOING:
                # the previous instance's transaction is aborted under the new epoch
                await self._abort_with_bump(meta)
                if meta.state != COMPLETE_ABORT:
                    return E.CONCURRENT_TRANSACTIONS, -1, -1
            else:
                await self._bump(meta)
            meta.timeout_ms = timeout_ms
            meta.state = EMPTY
            await self._save(meta)
            return E.NONE, meta.producer_id, meta.epoch

    async def _allocate(self) -> int:
        store = producer_store_for(self.broker)
        return int(await asyncio.to_thread(store.allocate_producer_id))

    async def _bump(self, meta: TxnMeta) -> None:
        """Next epoch, or a new producer id when the epoch space is used up (as Kafka)."""
        if meta.epoch + 1 >= EPOCH_MAX - 1:
            self.by_pid.pop(meta.producer_id, None)
            meta.producer_id, meta.epoch = await self._allocate(), 0
            self.by_pid[meta.producer_id] = meta
        else:
            meta.epoch += 1

    async def _abort_with_bump(self, meta: TxnMeta) -> None:
        """Abort an Ongoing transaction from the broker's side: the epoch is bumped first, so
        the producer that owned it is fenced, and the markers carry the new epoch."""
        meta.state = PREPARE_ABORT  # before any await: no batch verifies from here on
        await self._bump(meta)
        await self._save(meta)
        await self._complete(meta)

    # --- checks ------------------------------------------------------------------------------
    def _check(self, tid: str, producer_id: int, epoch: int) -> TxnMeta:
        meta = self.txns.get(tid)
        if meta is None or meta.producer_id != producer_id:
            raise TxnError(E.INVALID_PRODUCER_ID_MAPPING)
        if epoch != meta.epoch:
            raise TxnError(E.PRODUCER_FENCED)
        return meta

    def verify(self, producer_id: int, epoch: int, topic: str, partition: int) -> int:
        """Produce-time check of a transactional batch: its transaction is Ongoing and has this
        partition (KIP-890 part 1's server-side verification); an error code, 0 if fine."""
        meta = self.by_pid.get(producer_id)
        if meta is None:
            return E.INVALID_PRODUCER_ID_MAPPING
        if epoch < meta.epoch:
            return E.INVALID_PRODUCER_EPOCH
        if epoch != meta.epoch or meta.state != ONGOING or (topic, partition) not in meta.partitions:
            return E.INVALID_TXN_STATE
        return E.NONE

    # --- AddPartitionsToTxn / AddOffsetsToTxn --------------------------------------------------
    async def add_partitions(self, tid: str, producer_id: int, epoch: int,
                             partitions: list[tuple[str, int]],
                             exists: Any) -> dict[tuple[str, int], int]:
        """Add partitions to the transaction; error code per partition (Kafka: all fail
        together, the unknown ones with their own code, the others OPERATION_NOT_ATTEMPTED)."""
        if not self.is_active():
            return {tp: E.NOT_COORDINATOR for tp in partitions}
        unknown = [tp for tp in partitions if not exists(*tp)]
        if unknown:
            return {tp: (E.UNKNOWN_TOPIC_OR_PARTITION if tp in unknown
                         else E.OPERATION_NOT_ATTEMPTED) for tp in partitions}
        try:
            async with self._lock(tid):
                meta = self._check(tid, producer_id, epoch)
                if meta.state in (PREPARE_COMMIT, PREPARE_ABORT):
                    raise TxnError(E.CONCURRENT_TRANSACTIONS)
                new = set(partitions) - meta.partitions
                if new or meta.state != ONGOING:
                    self._begin(meta)
                    meta.partitions |= new
                    await self._save(meta)
        except TxnError as e:
            return {tp: e.code for tp in partitions}
        return {tp: E.NONE for tp in partitions}

    def verify_partitions(self, tid: str, producer_id: int, epoch: int,
                          partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """AddPartitionsToTxn v4+ verify_only: which partitions are already in the transaction."""
        try:
            meta = self._check(tid, producer_id, epoch)
        except TxnError as e:
            return {tp: e.code for tp in partitions}
        ok = meta.state == ONGOING
        return {tp: E.NONE if ok and tp in meta.partitions else E.INVALID_TXN_STATE
                for tp in partitions}

    def _begin(self, meta: TxnMeta) -> None:
        if meta.state != ONGOING:
            meta.state = ONGOING
            meta.start_ms = _now_ms()
            meta.partitions = set()
            meta.groups = set()
            meta.pending_offsets = {}

    async def add_offsets(self, tid: str, producer_id: int, epoch: int, group_id: str) -> int:
        if not self.is_active():
            return E.NOT_COORDINATOR
        try:
            async with self._lock(tid):
                meta = self._check(tid, producer_id, epoch)
                if meta.state in (PREPARE_COMMIT, PREPARE_ABORT):
                    return E.CONCURRENT_TRANSACTIONS
                if group_id not in meta.groups or meta.state != ONGOING:
                    self._begin(meta)
                    meta.groups.add(group_id)
                    await self._save(meta)
        except TxnError as e:
            return e.code
        return E.NONE

    async def txn_offset_commit(self, tid: str, group_id: str, producer_id: int, epoch: int,
                                offsets: list[tuple[str, int, int, int, str | None]]) -> int:
        """Hold the offsets with the transaction; the group sees them only on commit."""
        if not self.is_active():
            return E.NOT_COORDINATOR
        try:
            async with self._lock(tid):
                meta = self._check(tid, producer_id, epoch)
                if meta.state != ONGOING or group_id not in meta.groups:
                    return E.INVALID_TXN_STATE  # AddOffsetsToTxn comes first
                pending = meta.pending_offsets.setdefault(group_id, {})
                for t, p, o, le, md in offsets:
                    pending[(t, p)] = (o, le, md)
                await self._save(meta)
        except TxnError as e:
            return E.INVALID_PRODUCER_EPOCH if e.code == E.PRODUCER_FENCED else e.code
        return E.NONE

    # --- EndTxn --------------------------------------------------------------------------------
    async def end_txn(self, tid: str, producer_id: int, epoch: int, commit: bool) -> int:
        if not self.is_active():
            return E.NOT_COORDINATOR
        try:
            async with self._lock(tid):
                meta = self._check(tid, producer_id, epoch)
                want_prepare = PREPARE_COMMIT if commit else PREPARE_ABORT
                want_done = COMPLETE_COMMIT if commit else COMPLETE_ABORT
                if meta.state == ONGOING:
                    meta.state = want_prepare  # before any await (see the module docstring)
                    await self._save(meta)
                elif meta.state == want_done:
                    return E.NONE  # a retry of an EndTxn that completed
                elif meta.state != want_prepare:
                    return E.INVALID_TXN_STATE
                await self._complete(meta)
                return E.NONE if meta.state == want_done else E.COORDINATOR_NOT_AVAILABLE
        except TxnError as e:
            return e.code

    async def _complete(self, meta: TxnMeta) -> None:
        """Write the markers and (commit) the offsets of a prepared transaction, then mark it
        complete; on failure it stays prepared and the loop (or the client's retry) tries again."""
        commit = meta.state == PREPARE_COMMIT
        ok = await self._write_markers(meta, commit)
        if ok and commit and meta.pending_offsets:
            groups = getattr(self.broker, "groups", None)
            try:
                for group_id, tps in meta.pending_offsets.items():
                    await groups.commit_txn_offsets(
                        group_id, [(t, p, o, le, md) for (t, p), (o, le, md) in tps.items()])
            except Exception:  # noqa: BLE001 - retried with the markers (they are idempotent)
                log.exception("transactional offsets not committed transactional_id=%s",
                              meta.transactional_id)
                ok = False
        if not ok:
            return
        meta.state = COMPLETE_COMMIT if commit else COMPLETE_ABORT
        meta.partitions = set()
        meta.groups = set()
        meta.pending_offsets = {}
        await self._save(meta)

    async def _write_markers(self, meta: TxnMeta, commit: bool) -> bool:
        from ..partition import find_topic, get_partition  # noqa: PLC0415 - partition imports us

        async def one(topic: str, index: int) -> bool:
            partition = get_partition(find_topic(self.broker, topic), index)
            if partition is None:
                return True  # topic deleted meanwhile: nothing left to mark
            delay = 0.05
            for attempt in range(MARKER_ATTEMPTS):
                err = await partition.write_marker(meta.producer_id, meta.epoch, commit,
                                                   COORDINATOR_EPOCH)
                if err == E.NONE:
                    return True
                if partition.closed:
                    return False
                log.warning("marker not written topic=%s partition=%d error=%s attempt=%d",
                            topic, index, E(err).name, attempt + 1)
                await asyncio.sleep(delay)
                delay *= 2
            return False

        results = await asyncio.gather(*(one(t, p) for t, p in sorted(meta.partitions)))
        return all(results)

    def pending_offset_partitions(self, group_id: str) -> set[tuple[str, int]]:
        """(topic, partition) of ``group_id`` with offsets pending in an unfinished transaction."""
        out: set[tuple[str, int]] = set()
        for meta in self.txns.values():
            if meta.pending_offsets and meta.state in (ONGOING, PREPARE_COMMIT, PREPARE_ABORT):
                out.update(meta.pending_offsets.get(group_id, ()))
        return out

    # --- describe ------------------------------------------------------------------------------
    def describe(self, tid: str) -> TxnMeta | None:
        return self.txns.get(tid)

    def list(self, states: list[str], producer_ids: list[int],
             duration_ms: int = -1) -> list[TxnMeta]:
        now = _now_ms()
        out = []
        for meta in self.txns.values():
            if states and meta.state not in states:
                continue
            if producer_ids and meta.producer_id not in producer_ids:
                continue
            if duration_ms >= 0 and (meta.state != ONGOING or now - meta.start_ms < duration_ms):
                continue
            out.append(meta)
        return out


def coordinator_for(broker: Any) -> TransactionCoordinator | None:
    """The broker's running coordinator (None before ``ensure_transactions`` started it)."""
    return getattr(broker, "_txn_coordinator", None)


async def ensure_transactions(broker: Any) -> TransactionCoordinator:
    """Start the broker's coordinator once (on first use or when partitions open)."""
    coord = getattr(broker, "_txn_coordinator", None)
    if coord is not None:
        return coord
    starting = getattr(broker, "_txn_starting", None)
    if starting is None:
        async def start() -> TransactionCoordinator:
            from ..producer_state import _meta_db_url  # noqa: PLC0415

            store = await asyncio.to_thread(TxnStore, _meta_db_url(broker))
            c = TransactionCoordinator(broker, store)
            await c.start()
            broker._txn_coordinator = c
            return c
        starting = asyncio.ensure_future(start())
        broker._txn_starting = starting
    return await asyncio.shield(starting)


async def stop_transactions(broker: Any) -> None:
    coord = getattr(broker, "_txn_coordinator", None)
    broker._txn_starting = None
    if coord is not None:
        broker._txn_coordinator = None
        await coord.close()
