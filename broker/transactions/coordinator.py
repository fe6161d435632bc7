"""The transaction coordinator (Kafka's TransactionCoordinator).

Every transactional id has a ``TxnMeta`` kept in memory by the broker that coordinates it
(``placement.transaction_coordinator``) and written through to the metadata store
(``store.TxnStore``, compare-and-set on the row's version) before an answer goes out. The
state machine follows Kafka: Empty -> Ongoing (AddPartitionsToTxn / AddOffsetsToTxn, or
implicitly by a Produce v12+ / TxnOffsetCommit v5+ of a KIP-890 part 2 client) ->
PrepareCommit|PrepareAbort (EndTxn, durable) -> markers written to every partition of the
transaction (here or, WriteTxnMarkers, on the broker leading it) and, on commit, the pending
offsets made visible to their groups -> CompleteCommit|CompleteAbort (durable) -> answer.
A crash between the two durable steps is completed by the next coordinator. An Ongoing
transaction older than its timeout is aborted by the broker, with the epoch bumped so the
producer is fenced.

KIP-890 part 2 (EndTxn v5+, clients that see ``transaction.version`` 2): every EndTxn bumps
the producer epoch before the markers are written (a new producer id when the epochs run
out); the markers carry the new epoch, so a late batch of the ended transaction (older epoch)
is refused by the partition, and the answer gives the client its new id and epoch.

Per transactional id, one operation at a time (an asyncio lock). The in-memory state changes
before any await, so a partition's verification (``verify``) of a transactional batch and the
coordinator's decision to end its transaction are ordered: a batch verified before the state
left Ongoing got its offsets before the marker's.

In a cluster the ids are spread over the brokers; when the live brokers change, each reloads
the ids it now coordinates from the store (finishing what a dead coordinator left) and drops
the others. A broker that lost an id without noticing yet can never overwrite the new
coordinator's state: its write fails the compare-and-set and it answers NOT_COORDINATOR.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import protocol
from protocol import ErrorCode as E

from ..failures import note
from ..periodic import Periodic
from ..producer_state import EPOCH_MAX, producer_store_for
from .peers import PeerClients, PeerError
from .placement import group_coordinator, transaction_coordinator
from .store import (COMPLETE_ABORT, COMPLETE_COMMIT, EMPTY, ONGOING, PREPARE_ABORT,
                    PREPARE_COMMIT, StaleTxnState, TxnMeta, TxnStore)

log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
EXPIRATION_MS = 604_800_000  # Kafka's transactional.id.expiration.ms (7 days)
CHECK_INTERVAL_S = 1.0  # Kafka's transaction.abort.timed.out.transaction.cleanup.interval.ms is 10 s
MARKER_ATTEMPTS = 8
OFFSETS_TOPIC = "__consumer_offsets"   # a marker there tells a group coordinator to commit
WRITE_TXN_MARKERS = 27
# errors after which a marker is sent again (to whoever leads the partition then)
RETRY_MARKER = {E.NOT_LEADER_OR_FOLLOWER, E.UNKNOWN_TOPIC_OR_PARTITION, E.NOT_ENOUGH_REPLICAS,
                E.KAFKA_STORAGE_ERROR, E.REQUEST_TIMED_OUT, E.COORDINATOR_LOAD_IN_PROGRESS,
                E.NOT_COORDINATOR, E.COORDINATOR_NOT_AVAILABLE}


def _now_ms() -> int:
    return int(time.time() * 1000)


class TxnError(Exception):
    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message or E(code).name)
        self.code = code


class TransactionCoordinator:
    """Coordinates the transactional ids placed on this broker (see the module docstring)."""

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
        cfg = getattr(broker, "config", None)
        self.node_id = int(getattr(cfg, "node_id", 0))
        self.max_timeout_ms = int(getattr(cfg, "transaction_max_timeout_ms", 900_000))
        self.check_interval_s = float(getattr(cfg, "transaction_check_interval_s",
                                              CHECK_INTERVAL_S))
        self.expiration_ms = int(getattr(cfg, "transactional_id_expiration_ms", EXPIRATION_MS))
        self._periodic = Periodic("s3kafka-txn-coordinator", self.check_interval_s, self._pass,
                                  log, immediate=True)
        self.peers = PeerClients(broker)
        self._members: tuple[int, ...] | None = None

    # --- life cycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the ids this broker coordinates; unfinished transactions are finished by the
        periodic pass."""
        await self._load()
        self._periodic.start()

    async def close(self) -> None:
        self._closed = True
        await self._periodic.stop()
        await self.peers.close()
        self._io.shutdown(wait=True)
        self.store.close()

    def owns(self, tid: str) -> bool:
        """Whether this broker coordinates ``tid`` now."""
        return transaction_coordinator(self.broker, tid) == self.node_id

    def _membership(self) -> tuple[int, ...]:
        cluster = getattr(self.broker, "cluster", None)
        if cluster is None:
            return (self.node_id,)
        return tuple(sorted((n, getattr(b, "state", "")) for n, b in
                            (getattr(cluster, "live", {}) or {}).items()))  # type: ignore[misc]

    async def _load(self) -> None:
        """(Re)read the state of every id this broker coordinates from the metadata store.

        An id held already keeps its object unless the store has a newer row (another broker
        wrote it meanwhile). A request may be changing that object right now, with its save
        queued behind this read (an AddPartitionsToTxn, an EndTxn writing markers): replacing
        it with the row as read would answer the next produce and EndTxn from the old state
        (INVALID_TXN_STATE), and complete an ended transaction a second time. (An id created
        here after the read is added when its insert returns, after this, since the store's
        calls run in order on one thread.)"""
        self._members = self._membership()
        metas = await self._run(self.store.load_all)
        txns: dict[str, TxnMeta] = {}
        for m in metas:
            tid = m.transactional_id
            if not self.owns(tid):
                continue
            held = self.txns.get(tid)
            txns[tid] = held if held is not None and held.row_version >= m.row_version else m
        self.txns = txns
        self.by_pid = {m.producer_id: m for m in txns.values()}

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _save(self, meta: TxnMeta) -> None:
        """Write the state through (compare-and-set); StaleTxnState: another broker wrote it,
        this one forgets the id and answers NOT_COORDINATOR."""
        meta.update_ms = _now_ms()
        try:
            meta.row_version = await self._run(self.store.save, meta.to_row(), meta.row_version)
        except StaleTxnState:
            self._forget(meta)
            log.warning("transaction state changed by another broker transactional_id=%s",
                        meta.transactional_id)
            raise TxnError(E.NOT_COORDINATOR) from None

    def _forget(self, meta: TxnMeta) -> None:
        if self.txns.get(meta.transactional_id) is meta:
            del self.txns[meta.transactional_id]
        if self.by_pid.get(meta.producer_id) is meta:
            del self.by_pid[meta.producer_id]

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
        if self._membership() != self._members:
            await self._load()    # ids moved: take over the new ones, drop the others
            recovering = True
        now = _now_ms()
        for meta in list(self.txns.values()):
            try:
                await self._check_one(meta, now, recovering)
            except TxnError:
                pass  # another broker coordinates it now (logged by _save)
        return True

    async def _check_one(self, meta: TxnMeta, now: int, recovering: bool) -> None:
        tid = meta.transactional_id
        if meta.state in (PREPARE_COMMIT, PREPARE_ABORT):
            async with self._lock(tid):
                if meta.state in (PREPARE_COMMIT, PREPARE_ABORT) and self.txns.get(tid) is meta:
                    if recovering:
                        log.info("completing transaction transactional_id=%s state=%s", tid,
                                 meta.state)
                    await self._complete(meta)
        elif meta.state in (EMPTY, COMPLETE_COMMIT, COMPLETE_ABORT) \
                and now - meta.update_ms > self.expiration_ms:
            async with self._lock(tid):
                await self._expire(meta)
        elif meta.state == ONGOING and now - meta.start_ms > meta.timeout_ms:
            async with self._lock(tid):
                if meta.state == ONGOING and _now_ms() - meta.start_ms > meta.timeout_ms \
                        and self.txns.get(tid) is meta:
                    log.info("aborting timed-out transaction transactional_id=%s "
                             "producer_id=%d epoch=%d timeout_ms=%d", tid, meta.producer_id,
                             meta.epoch, meta.timeout_ms)
                    await self._abort_with_bump(meta)

    async def _expire(self, meta: TxnMeta) -> None:
        """Forget a transactional id idle for transactional.id.expiration.ms (as Kafka): its
        next InitProducerId starts again with a new producer id."""
        tid = meta.transactional_id
        if self.txns.get(tid) is not meta or meta.state not in (EMPTY, COMPLETE_COMMIT,
                                                                 COMPLETE_ABORT):
            return
        await self._run(self.store.delete, tid, meta.row_version)
        self._forget(meta)
        self._locks.pop(tid, None)
        log.info("transactional id expired transactional_id=%s producer_id=%d", tid,
                 meta.producer_id)

    async def _meta(self, tid: str) -> TxnMeta | None:
        """The state of an id this broker coordinates (read from the store if another broker
        coordinated it until now); call under the id's lock."""
        if not self.owns(tid):
            raise TxnError(E.NOT_COORDINATOR)
        meta = self.txns.get(tid)
        if meta is None:
            meta = await self._run(self.store.load_one, tid)
            if meta is not None and self.owns(tid) and tid not in self.txns:
                self.txns[tid] = meta
                self.by_pid[meta.producer_id] = meta
            meta = self.txns.get(tid)
        return meta

    # --- InitProducerId ----------------------------------------------------------------------
    async def init_producer_id(self, tid: str, timeout_ms: int, producer_id: int = -1,
                               producer_epoch: int = -1) -> tuple[int, int, int]:
        """(error, producer id, epoch): bump the epoch (fencing the previous instance), after
        finishing whatever transaction the previous instance left."""
        if timeout_ms <= 0 or timeout_ms > self.max_timeout_ms:
            return E.INVALID_TRANSACTION_TIMEOUT, -1, -1
        try:
            async with self._lock(tid):
                return await self._init_locked(tid, timeout_ms, producer_id, producer_epoch)
        except TxnError as e:
            return e.code, -1, -1

    async def _init_locked(self, tid: str, timeout_ms: int, producer_id: int,
                           producer_epoch: int) -> tuple[int, int, int]:
        meta = await self._meta(tid)
        if meta is None:
            pid = await self._allocate()
            meta = TxnMeta(tid, pid, 0, timeout_ms, EMPTY)
            await self._save(meta)
            self.txns[tid] = meta
            self.by_pid[pid] = meta
            return E.NONE, pid, 0
        if producer_id >= 0:
            # KIP-360: a producer recovering from an abortable error names itself
            known = producer_id == meta.producer_id and producer_epoch >= meta.epoch - 1
            previous = producer_id == meta.prev_producer_id and producer_epoch == meta.prev_epoch
            if not known and not previous:
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
        """Next epoch, or a new producer id when the epoch space is used up (as Kafka); the
        previous pair is remembered for a retried EndTxn (KIP-890 part 2)."""
        meta.prev_producer_id, meta.prev_epoch = meta.producer_id, meta.epoch
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
    def _check(self, meta: TxnMeta | None, producer_id: int, epoch: int) -> TxnMeta:
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
        if self._members is not None and self._members != self._membership() \
                and not self.owns(meta.transactional_id):
            return E.INVALID_TXN_STATE   # the id moved to another broker a moment ago
        if epoch < meta.epoch:
            return E.INVALID_PRODUCER_EPOCH
        if epoch != meta.epoch or meta.state != ONGOING or (topic, partition) not in meta.partitions:
            return E.INVALID_TXN_STATE
        return E.NONE

    def knows(self, producer_id: int) -> bool:
        """Whether this broker coordinates the transactional id of ``producer_id``."""
        meta = self.by_pid.get(producer_id)
        return meta is not None and self.owns(meta.transactional_id)

    # --- AddPartitionsToTxn / AddOffsetsToTxn --------------------------------------------------
    async def add_partitions(self, tid: str, producer_id: int, epoch: int,
                             partitions: list[tuple[str, int]],
                             exists: Any) -> dict[tuple[str, int], int]:
        """Add partitions to the transaction; error code per partition (Kafka: all fail
        together, the unknown ones with their own code, the others OPERATION_NOT_ATTEMPTED)."""
        if not self.owns(tid):
            return {tp: E.NOT_COORDINATOR for tp in partitions}
        unknown = [tp for tp in partitions if not exists(*tp)]
        if unknown:
            return {tp: (E.UNKNOWN_TOPIC_OR_PARTITION if tp in unknown
                         else E.OPERATION_NOT_ATTEMPTED) for tp in partitions}
        try:
            async with self._lock(tid):
                meta = self._check(await self._meta(tid), producer_id, epoch)
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

    async def verify_partitions(self, tid: str, producer_id: int, epoch: int,
                                partitions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """AddPartitionsToTxn v4+ verify_only: which partitions are already in the transaction."""
        try:
            meta = self._check(await self._meta(tid), producer_id, epoch)
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
        try:
            async with self._lock(tid):
                meta = self._check(await self._meta(tid), producer_id, epoch)
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
                                offsets: list[tuple[str, int, int, int, str | None]],
                                implicit: bool = False) -> int:
        """Hold the offsets with the transaction; the group sees them only on commit.
        ``implicit`` (TxnOffsetCommit v5+, KIP-890 part 2): the group joins the transaction
        without AddOffsetsToTxn."""
        try:
            async with self._lock(tid):
                meta = self._check(await self._meta(tid), producer_id, epoch)
                if implicit and meta.state not in (PREPARE_COMMIT, PREPARE_ABORT) and \
                        (meta.state != ONGOING or group_id not in meta.groups):
                    self._begin(meta)
                    meta.groups.add(group_id)
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
    async def end_txn(self, tid: str, producer_id: int, epoch: int, commit: bool,
                      bump: bool = False) -> int:
        """End the transaction. ``bump`` (EndTxn v5+, KIP-890 part 2): the epoch is bumped
        first and the markers carry the new one; a retry naming the previous producer id and
        epoch of a completed transaction answers NONE (with the current id and epoch)."""
        try:
            async with self._lock(tid):
                return await self._end_locked(tid, producer_id, epoch, commit, bump)
        except TxnError as e:
            return e.code

    async def _end_locked(self, tid: str, producer_id: int, epoch: int, commit: bool,
                          bump: bool) -> int:
        want_prepare = PREPARE_COMMIT if commit else PREPARE_ABORT
        want_done = COMPLETE_COMMIT if commit else COMPLETE_ABORT
        meta = await self._meta(tid)
        if bump and meta is not None and meta.state in (want_done, want_prepare) \
                and (producer_id, epoch) == (meta.prev_producer_id, meta.prev_epoch):
            if meta.state == want_prepare:   # a retry while the markers are still pending
                await self._complete(meta)
            return E.NONE if meta.state == want_done else E.CONCURRENT_TRANSACTIONS
        meta = self._check(meta, producer_id, epoch)
        if meta.state == ONGOING:
            meta.state = want_prepare  # before any await (see the module docstring)
            if bump:
                await self._bump(meta)
            await self._save(meta)
        elif bump and meta.state in (EMPTY, COMPLETE_COMMIT, COMPLETE_ABORT):
            # KIP-890 part 2: ending a transaction that never reached the broker (nothing
            # was added) still bumps the epoch, so nothing of it can be written later
            await self._bump(meta)
            meta.state = want_done
            await self._save(meta)
            return E.NONE
        elif meta.state == want_done:
            return E.NONE  # a retry of an EndTxn that completed
        elif meta.state != want_prepare:
            return E.INVALID_TXN_STATE
        await self._complete(meta)
        return E.NONE if meta.state == want_done else E.COORDINATOR_NOT_AVAILABLE

    async def _complete(self, meta: TxnMeta) -> None:
        """Write the markers and (commit) the offsets of a prepared transaction, then mark it
        complete; on failure it stays prepared and the loop (or the client's retry) tries again."""
        commit = meta.state == PREPARE_COMMIT
        remote_groups = set()
        if commit and meta.pending_offsets:
            for group_id in meta.pending_offsets:
                if group_coordinator(self.broker, group_id) != self.node_id:
                    remote_groups.add(group_id)
        ok = await self._write_markers(meta, commit, remote_groups)
        if ok and commit and meta.pending_offsets:
            groups = getattr(self.broker, "groups", None)
            try:
                for group_id, tps in meta.pending_offsets.items():
                    if group_id in remote_groups:
                        continue
                    await groups.commit_txn_offsets(
                        group_id, [(t, p, o, le, md) for (t, p), (o, le, md) in tps.items()])
            except Exception as exc:  # noqa: BLE001 - retried with the markers (idempotent)
                note(exc, f"transactional offsets of transactional_id={meta.transactional_id}")
                ok = False
        if not ok:
            return
        meta.state = COMPLETE_COMMIT if commit else COMPLETE_ABORT
        meta.partitions = set()
        meta.groups = set()
        meta.pending_offsets = {}
        await self._save(meta)

    def _leader(self, topic: str, index: int) -> tuple[int, bool]:
        """(leader node, topic exists) of a partition as this broker sees it now."""
        from ..partition import find_topic  # noqa: PLC0415 - partition imports us

        t = find_topic(self.broker, topic)
        if t is None or not 0 <= index < len(getattr(t, "partitions", ())):
            return -1, t is not None
        cluster = getattr(self.broker, "cluster", None)
        if cluster is None:
            return self.node_id, True
        return cluster.leader(t, index)[0], True

    async def _write_markers(self, meta: TxnMeta, commit: bool, groups: set[str]) -> bool:
        """Every marker durable at its partition's leader (this broker or another, followed
        through moves); a marker to ``__consumer_offsets`` at each remote group's coordinator
        makes it commit that group's offsets of this transaction."""
        todo: set[tuple[str, int]] = set(meta.partitions)
        group_nodes = {group_coordinator(self.broker, g) for g in groups}
        delay = 0.05
        for attempt in range(MARKER_ATTEMPTS):
            by_node: dict[int, list[tuple[str, int]]] = {}
            for topic, index in sorted(todo):
                leader, exists = self._leader(topic, index)
                if not exists:
                    todo.discard((topic, index))   # topic deleted meanwhile: nothing to mark
                    continue
                by_node.setdefault(leader, []).append((topic, index))
            jobs = [self._markers_at(node, meta, commit, tps, todo)
                    for node, tps in by_node.items()]
            jobs += [self._group_marker_at(node, meta, commit, group_nodes)
                     for node in sorted(group_nodes)]
            await asyncio.gather(*jobs)
            if not todo and not group_nodes:
                return True
            if self._closed:
                return False
            log.warning("markers not written yet transactional_id=%s partitions=%s groups_at=%s "
                        "attempt=%d", meta.transactional_id, sorted(todo), sorted(group_nodes),
                        attempt + 1)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        return False

    async def _markers_at(self, node: int, meta: TxnMeta, commit: bool,
                          tps: list[tuple[str, int]], todo: set[tuple[str, int]]) -> None:
        """Write the markers of ``tps`` led by ``node``; each one written leaves ``todo``."""
        if node < 0:
            return   # leader offline (failover running): retried
        if node == self.node_id:
            from ..partition import find_topic, get_partition  # noqa: PLC0415

            async def one(topic: str, index: int) -> None:
                partition = get_partition(find_topic(self.broker, topic), index)
                if partition is None:
                    return   # moving here or away: retried
                err = await partition.write_marker(meta.producer_id, meta.epoch, commit,
                                                   marker_epoch(meta), from_coordinator=True)
                if err == E.NONE:
                    todo.discard((topic, index))

            await asyncio.gather(*(one(t, i) for t, i in tps))
            return
        errors = await self._send_markers(node, meta, commit, tps)
        for tp, err in errors.items():
            if err == E.NONE:
                todo.discard(tp)
            elif err not in RETRY_MARKER:
                log.warning("marker refused topic=%s partition=%d node=%d error=%s",
                            tp[0], tp[1], node, E(err).name)

    async def _group_marker_at(self, node: int, meta: TxnMeta, commit: bool,
                               group_nodes: set[int]) -> None:
        if node < 0:
            return
        errors = await self._send_markers(node, meta, commit, [(OFFSETS_TOPIC, 0)])
        if errors.get((OFFSETS_TOPIC, 0)) == E.NONE:
            group_nodes.discard(node)

    async def _send_markers(self, node: int, meta: TxnMeta, commit: bool,
                            tps: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        Req = protocol.request_class(WRITE_TXN_MARKERS)
        M = Req.WritableTxnMarker
        by_topic: dict[str, list[int]] = {}
        for t, i in tps:
            by_topic.setdefault(t, []).append(i)
        req = Req(markers=[M(producer_id=meta.producer_id, producer_epoch=meta.epoch,
                             transaction_result=commit, coordinator_epoch=marker_epoch(meta),
                             topics=[M.WritableTxnMarkerTopic(name=t, partition_indexes=ps)
                                     for t, ps in by_topic.items()])])
        try:
            resp = await self.peers.call(node, WRITE_TXN_MARKERS, 1, req)
        except PeerError as e:
            log.warning("markers not sent node=%d: %s", node, e)
            return {}
        out: dict[tuple[str, int], int] = {}
        for m in resp.markers or []:
            for t in m.topics or []:
                for p in t.partitions or []:
                    out[(t.name, p.partition_index)] = int(p.error_code)
        return out

    # --- the group side of a transaction's commit ----------------------------------------------
    async def commit_offsets_of(self, producer_id: int, epoch: int, commit: bool) -> int:
        """A marker for ``__consumer_offsets`` from a transaction's coordinator on another
        broker: commit (or drop) the transaction's offsets of the groups this broker
        coordinates; they are read from the transaction's durable (prepared) state."""
        if not commit:
            return E.NONE
        meta = await self._run(self.store.load_by_producer, producer_id)
        if meta is None or meta.state != PREPARE_COMMIT or meta.epoch != epoch:
            return E.NONE  # completed already (a retry) or not this transaction: nothing to do
        groups = getattr(self.broker, "groups", None)
        for group_id, tps in meta.pending_offsets.items():
            if group_coordinator(self.broker, group_id) != self.node_id:
                continue
            if groups is None:
                return E.COORDINATOR_NOT_AVAILABLE
            await groups.commit_txn_offsets(
                group_id, [(t, p, o, le, md) for (t, p), (o, le, md) in tps.items()])
        return E.NONE

    def pending_offset_partitions(self, group_id: str) -> set[tuple[str, int]]:
        """(topic, partition) of ``group_id`` with offsets pending in an unfinished transaction
        this broker coordinates."""
        out: set[tuple[str, int]] = set()
        for meta in self.txns.values():
            if meta.pending_offsets and meta.state in (ONGOING, PREPARE_COMMIT, PREPARE_ABORT):
                out.update(meta.pending_offsets.get(group_id, ()))
        return out

    async def pending_offsets_anywhere(self, group_id: str) -> set[tuple[str, int]]:
        """The same over every broker's transactions: in a cluster the group's coordinator
        need not coordinate the transaction holding its offsets, so the store is asked."""
        if getattr(self.broker, "cluster", None) is None:
            return self.pending_offset_partitions(group_id)
        out: set[tuple[str, int]] = set()
        for meta in await self._run(self.store.load_unfinished):
            out.update((meta.pending_offsets or {}).get(group_id, ()))
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


def marker_epoch(meta: TxnMeta) -> int:
    """The coordinator epoch a transaction's markers carry: its state's row version since it
    was prepared, which grows with every transaction of the producer (the row's compare-and-set
    fences old coordinators), so a leader can refuse a late copy of an earlier transaction's
    marker (``PartitionTxns.marked``)."""
    return min(meta.row_version, INT32_MAX)


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
