"""The cluster room: membership, the controller, partition assignment and moves.

Handlers ask one question (``leader(topic, index)``: who leads it, at which epoch); everything
else happens here, driven by the tables of ``store.ClusterStore`` in the shared metadata
database. A single broker is a cluster of one: it registers, is the controller and leads
every partition, exactly as before the cluster existed.

A move (reassignment, controlled shutdown, a joining broker) is a small state machine on the
partition's assignment row: someone sets ``state=moving, target=T`` (CAS on the leader epoch);
the leader stops accepting, uploads the stream's pending data, saves producer state and hands
the row to T at ``leader_epoch + 1`` (CAS); T claims the stream at that epoch in the storage
metadata (CAS: the old owner's commits are refused from then on) and opens it from the object
store. A broker that dies (its lease lapsed, plus a margin) is fenced by the controller: its
node epoch is bumped and a live taker recovers its WAL (``Engine.take_over_wal``); only then
are its partitions handed to live brokers at leader epoch + 1 (see docs/cluster.md, Failover).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import socket
import time
import uuid
from typing import Any

import protocol
from storage.wal.errors import WALLockedError
from storage.crash import crash_point
from storage.waits import end_tasks, wait_event

from ..failures import log_failure, note as note_failure
from ..listeners import decode as decode_listeners, encode as encode_listeners
from ..producer_state import idempotent_batches
from .changes import ChangeWatch
from .coordinators import Placement
from .lease import LeaseWatch, OwnLease
from .store import ACTIVE, DRAINING, FENCED, LIVE, MOVING, STOPPED, TAKEN_OVER, Assignment, \
    BrokerRow, ClusterStore, NodeIdInUse, now_ms

log = logging.getLogger("broker.cluster")

HEARTBEAT_S = 1.0
LEASE_MS = 6000
TAKEOVER_MARGIN_MS = 1000
POLL_S = 0.2
ALONE_POLL_S = 1.0        # watch rounds at most this far apart while no other broker is up
STOP_WAIT_S = 10.0        # a stop waits this long for its cancelled tasks (storage/waits.py)
CATCH_UP_GAP_S = 0.05     # catch_up() rounds (a full re-read) at most this often
MAX_MOVES_PER_ROUND = 16
OP_STUCK_S = 15.0        # a partition operation running longer is logged (once per op)
SNAPSHOT_WAIT_S = 30.0   # a release waits at most this long for a producer snapshot
REFUSED_KEEP = 1000      # refused idempotent batches remembered per partition (refused_here)
BUMP_RETRY_S = 1.0       # a topic change the metadata store refused is announced again after


class ClusterError(Exception):
    """Misconfiguration found at start (one line for the operator)."""


class ClusterRoom:
    """One broker's view of, and part in, the cluster."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        cfg = broker.config
        self.node_id: int = cfg.node_id
        self.rack: str | None = getattr(cfg, "rack", None) or None
        self.instance = uuid.uuid4().hex
        self.store: ClusterStore | None = None
        self.live: dict[int, BrokerRow] = {}
        self.controller_id = self.node_id
        self.controller_epoch = 0
        self.assign: dict[tuple[str, int], Assignment] = {}
        self.version = -1
        self._tasks: list[asyncio.Task] = []
        self._busy: set[tuple[str, int]] = set()
        # what runs for each busy partition and since when (monotonic): an operation that
        # never ends holds every later move of that partition back, so say so in the log
        self._busy_since: dict[tuple[str, int], tuple[str, float, bool]] = {}
        self._changes: ChangeWatch | None = None
        # partitions being released here: produce waits for these (produce.py)
        self._settling: dict[tuple[str, int], asyncio.Future] = {}
        # partitions this broker handed over, at the epoch it led them: a round whose
        # assignments were read before the hand-over must not open them again at that epoch
        self._handed: dict[tuple[str, int], int] = {}
        # idempotent batches (producer id, epoch, first sequence) answered NOT_LEADER_OR_FOLLOWER
        # while an open or release of their partition ran here: failed marks on the Partition
        # that operation installs (refused_here)
        self._refused: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        self._ops: set[asyncio.Task] = set()
        self._bump_failing = False    # a topic change's version bump waits for the store
        self._members_seen: frozenset[int] = frozenset()
        self._stopping = False
        self._wake = asyncio.Event()
        # callers of catch_up() waiting for the next round, which then reads everything anew
        self._catch_up: list[asyncio.Future[None]] = []
        self._forced_at = 0.0
        self.lease_ms: int = int(getattr(cfg, "cluster_lease_ms", LEASE_MS) or LEASE_MS)
        self.margin_ms: int = int(getattr(cfg, "cluster_takeover_margin_ms",
                                          TAKEOVER_MARGIN_MS))
        self.heartbeat_s = min(HEARTBEAT_S, self.lease_ms / 4000)
        self.own_lease = OwnLease(self.lease_ms)    # produce answers only while valid
        # others' renewals on our monotonic clock; unable to read the database for half a
        # lease, we count everyone's silence afresh (lease.py: dead or cut off like us?)
        self.watch = LeaseWatch(blind_ms=max(self.lease_ms / 2, 4 * POLL_S * 1000))
        self._renewed_at = time.monotonic()          # send time of the last good renewal
        self.rows: dict[int, BrokerRow] = {}
        self._takeovers: dict[int, asyncio.Task] = {}
        self._electing: asyncio.Task | None = None   # the heartbeat loop's election
        self._placement = Placement([self.node_id])

    # ---- start / stop -----------------------------------------------------------------------
    async def start(self) -> None:
        """Register (refusing a node id another live broker holds) and read the cluster."""
        cfg = self.broker.config
        self.store = await asyncio.to_thread(ClusterStore, cfg.metadata_url)
        await self._check_object_store()
        try:
            home = f"{socket.gethostname()}:{os.path.abspath(cfg.wal_path)}"
            epoch = int((getattr(cfg, "engine", None) or {}).get("node_epoch", 0) or 0)
            sent = time.monotonic()
            await asyncio.to_thread(self.store.register, self.node_id, cfg.advertised_host,
                                    cfg.advertised_port, self.rack, self.instance, self.lease_ms,
                                    home, epoch, encode_listeners(cfg.listener_list()))
        except NodeIdInUse as e:
            raise ClusterError(str(e)) from None
        self.own_lease.renewed(sent)
        self._renewed_at = sent
        # tests: hold a starting broker here, live but not yet reading the cluster, while the
        # controller hands it partitions (test_start_handover.py)
        crash_point("cluster_registered")
        engine = getattr(self.broker, "store", None)
        if hasattr(engine, "writes_allowed"):
            # a lapsed lease stops uploads, commits and WAL trims too, not only produce
            # answers: this node may be fenced and its WAL about to be taken over (issue 17)
            engine.writes_allowed = self.own_lease.valid
        await self._elect()
        await self._refresh()
        log.info("cluster joined node_id=%d rack=%s live_brokers=%s controller=%d",
                 self.node_id, self.rack, sorted(self.live), self.controller_id)

    async def _check_object_store(self) -> None:
        """Brokers sharing an SQLite file must run on one host and share the object store: a
        broker joining live brokers of another host, or with another store, refuses to start
        with one line (PostgreSQL: the store is checked at every start by the metadata store,
        and brokers may run anywhere)."""
        cfg, meta = self.broker.config, getattr(self.broker, "meta", None)
        if not str(cfg.metadata_url).startswith("sqlite"):
            return
        assert self.store is not None
        now, host = now_ms(), socket.gethostname()
        others = [b for b in await asyncio.to_thread(self.store.brokers)
                  if b.node_id != self.node_id and b.state != STOPPED and b.lease_until_ms > now]
        for b in others:
            theirs = (b.home or "").split(":", 1)[0]
            if theirs and theirs != host:
                raise ClusterError(
                    f"--metadata {cfg.metadata_url} is shared with live broker {b.node_id} on "
                    f"host {theirs}: SQLite metadata serves brokers of one host only; use "
                    "--metadata postgresql://... for brokers on several hosts")
        if meta is not None and getattr(cfg, "storage", "engine") == "engine":
            await asyncio.to_thread(meta.bind_object_store, cfg.object_store_url, bool(others))

    def run(self) -> None:
        """Start the background loops (after the topics are loaded)."""
        self._members_seen = frozenset(self.live)
        loop = asyncio.get_running_loop()
        # a change committed by any broker wakes the watch loop at once (changes.py)
        self._changes = ChangeWatch(str(self.broker.config.metadata_url),
                                    lambda: loop.call_soon_threadsafe(self._wake.set)
                                    ).start(loop)
        self._tasks = [asyncio.create_task(self._heartbeat_loop(), name="cluster-heartbeat"),
                       asyncio.create_task(self._watch_loop(), name="cluster-watch")]

    async def drain(self, timeout_s: float = 20.0) -> None:
        """Controlled shutdown: while other brokers are live, hand every partition this
        broker leads to them before it stops."""
        if self.store is None or not any(n != self.node_id for n in self.live):
            return
        t0 = time.monotonic()
        await asyncio.to_thread(self.store.set_state, self.node_id, self.instance, DRAINING)
        log.info("controlled shutdown: moving partitions away node_id=%d", self.node_id)
        while time.monotonic() - t0 < timeout_s:
            self._wake.set()
            await asyncio.sleep(POLL_S)
            if not any(a.leader == self.node_id for a in self.assign.values()) and not self._busy:
                break
        left = sum(1 for a in self.assign.values() if a.leader == self.node_id)
        log.info("controlled shutdown done in %.0f ms; partitions still led here=%d",
                 (time.monotonic() - t0) * 1000, left)

    async def stop(self) -> None:
        self._stopping = True
        if self._changes is not None:
            if self._changes.on_loop:
                self._changes.stop()          # polls on this loop: closes at once
            else:
                await asyncio.to_thread(self._changes.stop)
        electing = [self._electing] if self._electing is not None else []
        for t in list(self._tasks) + list(self._takeovers.values()) + electing:
            t.cancel()
        await end_tasks(list(self._tasks) + list(self._ops) + list(self._takeovers.values())
                        + electing, STOP_WAIT_S, log, "cluster stop")
        if self.store is not None:
            try:
                if self.controller_id == self.node_id:
                    await asyncio.to_thread(self.store.resign, self.node_id,
                                            self.controller_epoch)
                await asyncio.to_thread(self.store.set_state, self.node_id, self.instance,
                                        STOPPED, True)
            except Exception as exc:  # noqa: BLE001 - the others fence it once its lease lapses
                # an outage (the metadata store cut or gone at shutdown) is its one-line
                # episode, not an ERROR with a traceback; anything else is a bug: logged so
                log_failure(log, exc, "cluster deregistration failed")
            await asyncio.to_thread(self.store.close)

    # ---- what handlers ask --------------------------------------------------------------------
    def leader(self, topic: Any, index: int) -> tuple[int, int]:
        """(leader node id, leader epoch) of a partition; (-1, -1) when its leader is offline."""
        a = self.assign.get((str(topic.topic_id), index))
        if a is None:
            return self.node_id, 0
        if a.leader not in self.live:
            return -1, a.leader_epoch
        return a.leader, a.leader_epoch

    def replicas(self, topic: Any, index: int, leader: int) -> list[int]:
        """The leader first, then other live brokers, as many as the replication factor."""
        a = self.assign.get((str(topic.topic_id), index))
        n = a.replicas if a is not None else 1
        others = sorted(b for b in self.live if b != leader)
        if others:
            k = index % len(others)
            others = others[k:] + others[:k]
        return ([leader] + others)[:max(1, n)] if leader >= 0 else []

    def coordinator(self, key: str) -> int:
        """The node coordinating a consumer group (or transactional id) ``key``: placed by
        ``coordinators.Placement`` over the live brokers that are not draining, so groups
        spread over the cluster and move away from a broker in controlled shutdown."""
        return self._placement.node_for(key)

    def is_coordinator(self, key: str) -> bool:
        return self._placement.node_for(key) == self.node_id

    def coordinator_nodes(self) -> frozenset[int]:
        """The node ids coordinators are placed on (live, not draining; all live ones if
        every broker is draining; this broker alone before it read the cluster)."""
        live = {n for n, b in self.live.items() if b.state == LIVE}
        return frozenset(live or self.live or {self.node_id})

    def live_brokers(self) -> list[BrokerRow]:
        return [self.live[n] for n in sorted(self.live)]

    def endpoint(self, node: int, listener: str | None = None) -> tuple[str, int] | None:
        """(host, port) of a live broker as advertised on the named listener (the client's:
        see broker/listeners.py); its default address for an unnamed or unknown listener."""
        b = self.live.get(node)
        if b is None:
            return None
        if listener and b.listeners:
            ep = decode_listeners(b.listeners).get(listener)
            if ep is not None:
                return ep
        return b.host, b.port

    def settling(self, topic: Any, index: int) -> "asyncio.Future | None":
        """Done when the release of this partition under way here ends (None when there is
        none): a produce that finds the partition closed waits for it (then answers
        NOT_LEADER_OR_FOLLOWER naming the new leader; produce.py)."""
        return self._settling.get((str(topic.topic_id), index))

    def refused_here(self, topic: Any, index: int, records: Any) -> None:
        """A produce found this partition not open here (answered NOT_LEADER_OR_FOLLOWER):
        while an open of it, or a release that may end in a reopen, runs here, its idempotent
        batches become failed marks on the Partition installed next (``_install``), like any
        refused batch's. Without them, the retry of a stored seq n refused here and its stored
        seq n+1, pipelined behind it, answered with its offset by the Partition installed a
        moment later made librdkafka acknowledge seq n implicitly, without an offset (a seq n
        never stored: n+1 answered OUT_OF_ORDER_SEQUENCE). Parsed now: ``records`` is a view
        into a request frame the server reuses."""
        key = (str(topic.topic_id), index)
        if key not in self._busy or not records:
            return
        try:
            ids = list(idempotent_batches(records))
        except protocol.CorruptRecordError:
            return                          # refused anyway; nothing to remember
        if ids:
            refused = self._refused.setdefault(key, [])
            refused.extend(ids)
            del refused[:-REFUSED_KEEP]

    def _install(self, topic: Any, index: int, p: Any, old: Any = None) -> None:
        """``p`` serves the partition from now on. In the same step (no await: every produce
        that found the partition away was recorded before, every later one finds ``p``), the
        failed marks of the Partition it replaces (``old``: a release that failed) and of the
        batches refused meanwhile (``refused_here``) are set on it."""
        marks = getattr(getattr(old, "producers", None), "failed", None)
        if marks:
            p.producers.failed.update(marks)
        refused = self._refused.pop((str(topic.topic_id), index), ())
        for pid, epoch, seq in refused:
            p.producers.fail(pid, epoch, seq)
        topic.partitions[index] = p
        if refused or marks:
            log.info("partition installed topic=%s partition=%d with failed marks: %d kept from "
                     "the Partition it replaces, %d batches refused while it was away",
                     topic.name, index, len(marks or ()), len(refused))

    def should_open(self, topic_id: Any, index: int) -> bool:
        a = self.assign.get((str(topic_id), index))
        return a is None or a.leader == self.node_id

    def placement(self, count: int) -> list[int]:
        """Leaders for ``count`` new partitions: the least loaded live brokers first."""
        counts = {n: 0 for n, b in self.live.items() if b.state == LIVE}
        if not counts:
            return [self.node_id] * count
        for a in self.assign.values():
            if a.leader in counts:
                counts[a.leader] += 1
        out = []
        for _ in range(count):
            n = min(counts, key=lambda k: (counts[k], k))
            out.append(n)
            counts[n] += 1
        return out

    async def assign_new(self, topic_id: Any, first: int, leaders: list[int], rf: int) -> None:
        assert self.store is not None
        await asyncio.to_thread(self.store.assign_new, str(topic_id), first, leaders, rf)
        for i, n in enumerate(leaders):
            self.assign[(str(topic_id), first + i)] = Assignment(str(topic_id), first + i, n, 0,
                                                                 rf, ACTIVE, -1)

    async def claim_unassigned(self, topic_id: Any, count: int) -> None:
        """At start: partitions with no assignment row (a store from before the cluster)."""
        assert self.store is not None
        if all((str(topic_id), i) in self.assign for i in range(count)):
            return
        await asyncio.to_thread(self.store.claim_unassigned, str(topic_id), count, self.node_id)
        for a in await asyncio.to_thread(self.store.assignments):
            self.assign[(a.topic_id, a.partition)] = a

    async def forget_topic(self, topic_id: Any) -> None:
        assert self.store is not None
        await asyncio.to_thread(self.store.delete_topic, str(topic_id))
        for k in [k for k in self.assign if k[0] == str(topic_id)]:
            del self.assign[k]

    async def request_move(self, topic: Any, index: int, target: int | None) -> int:
        """AlterPartitionReassignments: move to ``target`` (None cancels). Returns an error
        code (0 = accepted)."""
        from protocol import ErrorCode  # noqa: PLC0415
        assert self.store is not None
        a = self.assign.get((str(topic.topic_id), index))
        if a is None:
            return ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        if target is None:
            if a.state != MOVING:
                return ErrorCode.NO_REASSIGNMENT_IN_PROGRESS
            await asyncio.to_thread(self.store.cancel_move, a.topic_id, index, a.leader_epoch)
        elif target not in self.live:
            return ErrorCode.INVALID_REPLICATION_ASSIGNMENT
        elif target != a.leader:
            if not await asyncio.to_thread(self.store.start_move, a.topic_id, index,
                                           a.leader_epoch, target):
                return ErrorCode.REASSIGNMENT_IN_PROGRESS
            log.info("reassignment requested topic=%s partition=%d from=%d to=%d epoch=%d",
                     topic.name, index, a.leader, target, a.leader_epoch)
        self._wake.set()
        return ErrorCode.NONE

    async def leader_epochs(self, topic: Any, index: int) -> list[tuple[int, int]]:
        assert self.store is not None
        return await asyncio.to_thread(self.store.leader_epochs, str(topic.topic_id), index)

    async def catch_up(self, timeout_s: float = 2.0) -> None:
        """Read topics and assignments from the metadata store now rather than at the next
        poll, e.g. for a topic this broker does not know: another broker may have created it
        a moment ago, and a client told UNKNOWN_TOPIC_OR_PARTITION right after CreateTopics
        may join a group with nothing to assign (kafka-python 3.0.12 can then hang in the
        rebalance that follows: docs/groups.md). Waits for a round that starts after the
        call (at most ``timeout_s``); concurrent callers share it."""
        if self.store is None or not self._tasks or self._stopping \
                or not any(n != self.node_id for n in self.live):
            return          # alone: nobody else creates topics
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._catch_up.append(fut)
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            pass

    def topic_changed(self) -> None:
        """Topics were created, deleted, grown or reconfigured here: tell the others. A bump
        the metadata store refuses (an outage) is retried every BUMP_RETRY_S until it lands:
        the others would otherwise learn of the change only with the next one. (Its failure
        was an unretrieved future's exception, an ERROR from asyncio, in the PostgreSQL cut
        test: a topic created just before the cut.)"""
        if self.store is not None and not self._stopping:
            t = asyncio.get_running_loop().run_in_executor(None, self.store.bump)
            self._ops.add(t)  # type: ignore[arg-type]
            t.add_done_callback(self._bumped)

    def _bumped(self, t: "asyncio.Future[None]") -> None:
        self._ops.discard(t)  # type: ignore[arg-type]
        exc = None if t.cancelled() else t.exception()
        if exc is None:
            if self._bump_failing:
                self._bump_failing = False
                log.info("topic change announced after the metadata store came back")
            return
        if not self._bump_failing:
            self._bump_failing = True
            log.warning("topic change not announced to the other brokers yet (retrying every "
                        "%.0f s): %s", BUMP_RETRY_S, exc)
        if not self._stopping:
            asyncio.get_running_loop().call_later(BUMP_RETRY_S, self.topic_changed)

    # ---- loops --------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        assert self.store is not None
        # a thread of its own: the default executor's few threads can all be waiting on
        # the metadata store (a broker paused inside a transaction holds its locks)
        beat = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cluster-lease")
        try:
            await self._renew_loop(beat)
        finally:
            beat.shutdown(wait=False)

    async def _renew_loop(self, beat: concurrent.futures.Executor) -> None:
        assert self.store is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                sent = time.monotonic()     # the lease runs from the send, not the answer
                ok = await loop.run_in_executor(beat, self.store.heartbeat, self.node_id,
                                                self.instance, self.lease_ms)
                if ok:
                    if sent - self._renewed_at > self.watch.blind_ms / 1000:
                        # our renewals failed for a while: so may everyone's have (lease.py)
                        self.watch.blind_since(self._renewed_at)
                    self._renewed_at = sent
                    self.own_lease.renewed(sent)
                    self.watch.renewal(sent, time.monotonic())
                else:
                    if not self.own_lease.valid():
                        # refused while our lease is lapsed: the controller fenced us (or
                        # another instance took the id): no second round trip to be sure -
                        # a zombie's every extra moment is a risk (issue 17)
                        log.critical("this broker was fenced after its lease lapsed (its "
                                     "renewal was refused while lapsed); exiting - restart it "
                                     "to rejoin at a new node epoch")
                        logging.shutdown()
                        os._exit(4)
                    row = await asyncio.to_thread(self.store.broker, self.node_id)
                    if row is not None and row.instance == self.instance \
                            and row.state in (FENCED, TAKEN_OVER):
                        # our lease lapsed (paused, cut off) and the controller fenced us:
                        # another broker owns our WAL now; stop at once, as kill -9 would
                        log.critical("this broker was fenced after its lease lapsed "
                                     "(node_epoch=%d, taker=%d); exiting - restart it to "
                                     "rejoin at a new node epoch", row.node_epoch, row.taker)
                        logging.shutdown()
                        os._exit(4)
                    log.error("node id %d was taken over by another broker instance",
                              self.node_id)
                if self._electing is None or self._electing.done():
                    # not awaited: an election waiting for a row lock (the controller paused
                    # inside its renewal) must not hold this broker's own renewals back
                    self._electing = asyncio.create_task(self._elect_logged())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - database briefly unavailable: next beat
                note_failure(exc, "cluster heartbeat")   # an outage: one episode, not a line each

    async def _elect_logged(self) -> None:
        try:
            await self._elect()
        except Exception as exc:  # noqa: BLE001 - database briefly unavailable: next beat
            note_failure(exc, "cluster election")   # an outage: one episode

    async def _elect(self) -> None:
        assert self.store is not None
        was = self.controller_id, self.controller_epoch
        self.controller_id, self.controller_epoch = await asyncio.to_thread(
            self.store.elect, self.node_id,
            self.controller_epoch if was[0] == self.node_id else -1, self.lease_ms)
        if (self.controller_id, self.controller_epoch) != was:
            log.info("controller node_id=%d epoch=%d (this broker: %s)", self.controller_id,
                     self.controller_epoch, "yes" if self.controller_id == self.node_id else "no")
            self._wake.set()

    async def _placement_changed(self) -> None:
        """The set of coordinator brokers changed: groups this broker gained are loaded from
        the metadata database, groups it lost are dropped (their members are told
        NOT_COORDINATOR and look the coordinator up again)."""
        old = self._placement
        self._placement = Placement(self.coordinator_nodes())
        if old.nodes != self._placement.nodes:
            log.info("coordinators placed on brokers=%s (was %s)",
                     sorted(self._placement.nodes), sorted(old.nodes))
        groups = getattr(self.broker, "groups", None)
        moved = getattr(groups, "placement_changed", None)
        if moved is not None:
            await moved(self.is_coordinator)

    def _poll_s(self) -> float:
        """How long the watch loop waits for a wake-up before its next round: POLL_S, or
        up to ALONE_POLL_S while this broker is the only one registered that is not
        stopped and none of its partition operations runs. The 200 ms rounds observe the
        other brokers' leases; alone there is none to observe, and whatever another broker
        does first (registering, a move) bumps the version, which the change watch reports
        at once (changes.py) - an idle single broker spent ~2-3 ms of CPU a second on these
        rounds' thread hops and reads (session 21). Never more than a quarter of a lease:
        the lease watch takes a longer gap between reads for blindness."""
        if self._busy or self._ops or self._catch_up or any(
                n != self.node_id and b.state != STOPPED for n, b in self.rows.items()):
            return POLL_S
        return max(POLL_S, min(ALONE_POLL_S, self.lease_ms / 4000))

    async def _watch_loop(self) -> None:
        while not self._stopping:
            await wait_event(self._wake, self._poll_s())
            self._wake.clear()
            self._report_stuck()
            try:
                waiters, self._catch_up = self._catch_up, []
                if waiters:     # forced rounds at most every CATCH_UP_GAP_S
                    await asyncio.sleep(max(0.0, self._forced_at + CATCH_UP_GAP_S
                                            - time.monotonic()))
                    self._forced_at = time.monotonic()
                try:
                    await self._refresh(force=bool(waiters))
                finally:
                    for w in waiters:
                        if not w.done():
                            w.set_result(None)
                await self._apply()
                self._take_over_assigned()
                if self.controller_id == self.node_id:
                    await self._failover()
                    await self._control()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                note_failure(exc, "cluster watch round")  # an outage: one episode

    async def _refresh(self, force: bool = False) -> None:
        assert self.store is not None
        store, known = self.store, self.version

        def read() -> tuple[int, int, list[BrokerRow], list[Assignment] | None]:
            # one thread hop for the round's reads (three hops took a loaded box's round
            # hundreds of ms); the version first: a change after it is seen next round
            v = store.version()
            now = now_ms()
            rows = store.brokers()
            return v, now, rows, (store.assignments() if v != known or force else None)
        v, now, rows, fresh = await asyncio.to_thread(read)
        self.rows = {b.node_id: b for b in rows}
        self.watch.observe(rows, now)
        live = {b.node_id: b for b in rows if b.state != STOPPED
                and self.watch.alive(b.node_id, max(self.lease_ms, b.lease_ms))}
        changed = set(live) != set(self.live) or any(
            live[n].state != self.live[n].state for n in live if n in self.live)
        self.live = live
        if changed or self._placement.nodes != self.coordinator_nodes():
            await self._placement_changed()
        if v == self.version and not force and not changed:
            return
        if fresh is None:       # only the membership changed
            fresh = await asyncio.to_thread(self.store.assignments)
        self.assign = {(a.topic_id, a.partition): a for a in fresh}
        tm = self.broker.topic_manager
        if tm is not None and self._tasks:
            # moves of known topics start now, not after re-reading every topic (new topics
            # are opened by the round's _apply after the sync)
            await self._apply()
            await tm.sync()
        # only now: a round that failed half way (database cut) must read everything again
        # next time, not skip it because the version did not move since (a move requested
        # then was never seen: the chaos suite's "reassignment that never happened")
        self.version = v

    # ---- this broker's partitions -----------------------------------------------------------
    async def _apply(self) -> None:
        tm = self.broker.topic_manager
        if tm is None:
            return
        for topic in list(tm.topics.values()):
            for i, p in enumerate(list(topic.partitions)):
                key = (str(topic.topic_id), i)
                a = self.assign.get(key)
                if a is None or key in self._busy:
                    continue
                if a.leader != self.node_id:
                    self._refused.pop(key, None)    # its retries go to the leader
                if a.leader == self.node_id and a.leader_epoch <= self._handed.get(key, -1):
                    continue            # a stale view: this broker handed that epoch over
                if a.leader == self.node_id and p is None:
                    self._spawn(key, self._open(topic, i, a), f"open {topic.name}-{i}")
                elif a.leader == self.node_id and a.state == MOVING:
                    self._spawn(key, self._release(topic, i, a), f"release {topic.name}-{i}")
                elif a.leader != self.node_id and p is not None:
                    log.warning("partition led elsewhere was open here topic=%s partition=%d "
                                "leader=%d; closing", topic.name, i, a.leader)
                    self._spawn(key, self._close_local(topic, i), f"close {topic.name}-{i}")

    def _spawn(self, key: tuple[str, int], coro: Any, what: str = "") -> None:
        self._busy.add(key)
        self._busy_since[key] = (what, time.monotonic(), False)
        if what.startswith("release "):
            self._settling[key] = asyncio.get_running_loop().create_future()
        t = asyncio.create_task(coro, name=f"cluster-{what}")
        self._ops.add(t)

        def done(t: asyncio.Task) -> None:
            self._busy.discard(key)
            self._busy_since.pop(key, None)
            self._settle(key)
            self._ops.discard(t)
            self._wake.set()
            if not t.cancelled() and t.exception() is not None:
                # never silent: an operation that died leaves the partition to the next round
                log.error("partition operation failed (%s): %r", what, t.exception(),
                          exc_info=t.exception())
        t.add_done_callback(done)

    def _settle(self, key: tuple[str, int]) -> None:
        """Answer the produces waiting for this partition's open or release now."""
        fut = self._settling.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _report_stuck(self) -> None:
        """Log (once each) partition operations running for more than OP_STUCK_S: while one
        runs, no other move of that partition starts."""
        now = time.monotonic()
        for key, (what, t0, told) in list(self._busy_since.items()):
            if not told and now - t0 > OP_STUCK_S:
                self._busy_since[key] = (what, t0, True)
                log.warning("partition operation still running after %.0f s (%s): further "
                            "moves of this partition wait for it", now - t0, what)

    async def _open(self, topic: Any, index: int, a: Assignment) -> None:
        from ..partition import Partition  # noqa: PLC0415
        t0 = time.monotonic()
        store = self.broker.store
        sid = topic.stream_ids[index]
        try:
            acquire = getattr(store, "acquire_stream", None)
            stream = await (acquire(sid, a.leader_epoch) if acquire else store.open_stream(sid))
            p = await Partition.open(self.broker, topic.name, topic.topic_id, index, stream,
                                     topic.configs)
        except Exception as exc:  # noqa: BLE001 - retried next round
            log_failure(log, exc, "opening partition failed topic=%s partition=%d", topic.name,
                        index)
            self._settle((str(topic.topic_id), index))
            await asyncio.sleep(1)
            return
        if self.broker.topics.get(topic.name) is not topic or index >= len(topic.partitions):
            await p.close()
            return
        start = stream.end_offset   # where this epoch begins (appends may follow at once)
        p.leader_epoch = a.leader_epoch     # stamped into every batch it appends
        self._install(topic, index, p)
        if a.leader_epoch > 0 and self.store is not None:   # a failover records no start
            await asyncio.to_thread(self.store.record_epoch_start, a.topic_id, index,
                                    a.leader_epoch, start)
        log.info("partition opened topic=%s partition=%d leader_epoch=%d log_end_offset=%d "
                 "took_ms=%.0f", topic.name, index, a.leader_epoch, start,
                 (time.monotonic() - t0) * 1000)

    async def _release(self, topic: Any, index: int, a: Assignment) -> None:
        """Stop accepting, upload, save producer state, hand the row to the target."""
        t0 = time.monotonic()
        key = (str(topic.topic_id), index)
        p = topic.partitions[index]
        if p is None:
            return
        topic.partitions[index] = None      # produce/fetch answer NOT_LEADER_OR_FOLLOWER now
        store = self.broker.store
        release = getattr(store, "release_stream", None)
        try:
            # no snapshot at close: the one below, after the appends in flight, covers it
            await p.close(snapshot=False)
            end = await release(p.stream.stream_id) if release else p.stream.end_offset
            t_up = time.monotonic()
            fut = p.snapshot(force=True)     # covers the appends that were in flight
            if fut is not None:
                await asyncio.wait_for(asyncio.wrap_future(fut), SNAPSHOT_WAIT_S)
            t_snap = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - keep leading; the move is retried
            log_failure(log, exc, "releasing partition failed topic=%s partition=%d",
                        topic.name, index)
            await self._reopen(topic, index, p)
            self._settle(key)               # held produces: answered now, not after the pause
            await asyncio.sleep(1)
            return
        assert self.store is not None
        try:
            new = await asyncio.to_thread(self.store.hand_over, a.topic_id, index, self.node_id,
                                          a.leader_epoch, end)
        except Exception as exc:  # noqa: BLE001
            # not reopened here: the hand-over may have committed with its answer lost; the
            # next round reads the row and opens the partition again if it is still ours
            log_failure(log, exc, "hand-over failed topic=%s partition=%d leader_epoch=%d; the "
                        "next round retries", topic.name, index, a.leader_epoch)
            self._settle(key)
            await asyncio.sleep(1)
            return
        if new is None:     # cancelled meanwhile: lead it again
            await self._reopen(topic, index, p)
            return
        self._handed[(str(topic.topic_id), index)] = a.leader_epoch
        self._refused.pop(key, None)        # led elsewhere now: its retries go there
        # our own view at once: NOT_LEADER answers name the new leader (KIP-951) from now,
        # not from our next round
        self.assign[(str(topic.topic_id), index)] = Assignment(
            a.topic_id, index, new, a.leader_epoch + 1, a.replicas, ACTIVE, -1)
        t1 = time.monotonic()
        log.info("partition moved topic=%s partition=%d from=%d to=%d leader_epoch=%d "
                 "end_offset=%d release_ms=%.0f (upload_ms=%.0f snapshot_ms=%.0f "
                 "handover_ms=%.0f)", topic.name, index, self.node_id, new, a.leader_epoch + 1,
                 end, (t1 - t0) * 1000, (t_up - t0) * 1000, (t_snap - t_up) * 1000,
                 (t1 - t_snap) * 1000)

    async def _reopen(self, topic: Any, index: int, old: Any) -> None:
        from ..partition import Partition  # noqa: PLC0415
        stream = old.stream
        if hasattr(stream, "owned"):
            stream.owned = True
        try:
            p = await Partition.open(self.broker, topic.name, topic.topic_id, index, stream,
                                     topic.configs)
        except Exception as exc:  # noqa: BLE001 - left closed: the next round opens it afresh
            log_failure(log, exc, "reopening partition failed topic=%s partition=%d; the next "
                        "round opens it", topic.name, index)
            return
        p.leader_epoch = getattr(old, "leader_epoch", 0)
        self._install(topic, index, p, old)

    async def _close_local(self, topic: Any, index: int) -> None:
        p = topic.partitions[index]
        if p is None:
            return
        topic.partitions[index] = None
        self._refused.pop((str(topic.topic_id), index), None)
        await p.close()
        disown = getattr(self.broker.store, "disown_stream", None)
        if disown is not None:
            disown(p.stream.stream_id)

    # ---- the controller ---------------------------------------------------------------------
    async def _control(self) -> None:
        """Moves the controller decides: away from draining brokers, retargets of moves to
        brokers that left, and a balancing pass when the set of brokers changed."""
        assert self.store is not None
        ctl = (self.node_id, self.controller_epoch)
        targets = {n for n, b in self.live.items() if b.state == LIVE}
        known = {(str(t.topic_id), i) for t in self.broker.topics.values()
                 for i in range(len(t.partitions))}
        rows = [a for k, a in self.assign.items() if k in known]
        counts = {n: 0 for n in targets}
        for a in rows:
            dest = a.target if a.state == MOVING else a.leader
            if dest in counts:
                counts[dest] += 1
        moves: list[tuple[Assignment, int, str]] = []

        def least(exclude: int) -> int | None:
            c = [n for n in counts if n != exclude]
            return min(c, key=lambda n: (counts[n], n)) if c else None

        for a in rows:
            draining = a.leader in self.live and self.live[a.leader].state == DRAINING
            if a.state == ACTIVE and draining:
                t = least(a.leader)
                if t is not None:
                    moves.append((a, t, "controlled shutdown"))
                    counts[t] += 1
            elif a.state == MOVING and a.target not in targets and a.leader in self.live:
                t = least(a.leader)
                if t is not None:
                    moves.append((a, t, f"target {a.target} left"))
                    counts[t] += 1
        members = frozenset(targets)
        joined = members - self._members_seen
        self._members_seen = members
        if joined and not moves and len(counts) > 1:
            by_leader: dict[int, list[Assignment]] = {}
            for a in rows:
                if a.state == ACTIVE and a.leader in counts:
                    by_leader.setdefault(a.leader, []).append(a)
            for _ in range(MAX_MOVES_PER_ROUND):
                hi = max(counts, key=lambda n: (counts[n], -n))
                lo = min(counts, key=lambda n: (counts[n], n))
                if counts[hi] - counts[lo] <= 1 or not by_leader.get(hi):
                    break
                a = by_leader[hi].pop()
                moves.append((a, lo, f"broker {lo} joined"))
                counts[hi] -= 1
                counts[lo] += 1
        for a, t, why in moves[:MAX_MOVES_PER_ROUND]:
            if await asyncio.to_thread(self.store.start_move, a.topic_id, a.partition,
                                       a.leader_epoch, t, ctl):
                log.info("assignment change topic_id=%s partition=%d from=%d to=%d "
                         "leader_epoch=%d reason=%s", a.topic_id, a.partition, a.leader, t,
                         a.leader_epoch, why)
        if moves:
            self._wake.set()

    # ---- failover: fencing a dead broker and taking over its WAL ------------------------------
    async def _failover(self) -> None:
        """Controller: fence brokers whose lease lapsed more than the margin ago and give
        their WAL to a live taker; give a takeover whose taker failed or left to another."""
        assert self.store is not None
        if not self.own_lease.valid():
            return      # cut off ourselves: we cannot tell the dead from the cut off (lease.py)
        ctl = (self.node_id, self.controller_epoch)
        takers = sorted(n for n, b in self.live.items() if b.state == LIVE) or [self.node_id]
        for n, b in list(self.rows.items()):
            if n == self.node_id or n in self.live:
                continue
            # spread takeovers: the dead node's successor in the ring of live brokers
            taker = next((t for t in takers if t > n), takers[0])
            # its lease as it sees it ended before ours (lease.py): no wall clocks compared
            lease = max(self.lease_ms, b.lease_ms)
            if b.state in (LIVE, DRAINING) and self.watch.expired(n, lease, self.margin_ms):
                row = await asyncio.to_thread(self.store.fence, n, b.instance,
                                              b.lease_until_ms, taker, ctl)
                if row is not None:
                    log.warning("broker fenced node_id=%d node_epoch=%d lease_lapsed_ms=%d "
                                "taker=%d takeover_epoch=%d", n, row.node_epoch,
                                self.watch.unchanged_ms(n) - lease, taker, row.takeover_epoch)
                    self._wake.set()
            elif b.state == FENCED and b.taker not in self.live:
                if await asyncio.to_thread(self.store.assign_taker, n, b.takeover_epoch, taker,
                                           ctl):
                    log.warning("takeover reassigned node_id=%d from taker=%d to taker=%d "
                                "takeover_epoch=%d", n, b.taker, taker, b.takeover_epoch + 1)
                    self._wake.set()

    def _take_over_assigned(self) -> None:
        """Start the takeovers assigned to this broker (one task per dead node)."""
        for n, b in self.rows.items():
            if b.state == FENCED and b.taker == self.node_id and n not in self._takeovers \
                    and not self._stopping:
                t = asyncio.create_task(self._take_over(b), name=f"takeover-{n}")
                self._takeovers[n] = t
                t.add_done_callback(lambda _t, n=n: (self._takeovers.pop(n, None),
                                                     self._wake.set()))

    async def _take_over(self, b: BrokerRow) -> None:
        """Recover the dead node's WAL through this broker's engine, then hand its partitions
        to live brokers. On failure give the takeover back (the controller retries)."""
        assert self.store is not None
        n, tepoch = b.node_id, b.takeover_epoch
        t0 = time.monotonic()
        engine = self.broker.store
        meta = getattr(engine, "meta", None)
        try:
            info = await asyncio.to_thread(meta.wal, n) if meta is not None else None
            if info is None or not hasattr(engine, "take_over_wal"):
                log.warning("takeover node_id=%d: no WAL registered; reassigning only", n)
                records = committed = 0
            else:
                log.info("takeover started node_id=%d wal=%s node_epoch=%d taker=%d "
                         "takeover_epoch=%d", n, info.path, info.node_epoch, self.node_id,
                         tepoch)
                try:
                    res = await engine.take_over_wal(info.path, n, info.node_epoch, tepoch)
                except WALLockedError as e:
                    if not _holder_gone(str(e)):
                        raise
                    # fenced after its lease lapsed, and the flock's holder is stopped or
                    # gone: the header fence stops it should it ever run again
                    log.warning("takeover node_id=%d: forcing the WAL lock (%s)", n, e)
                    res = await engine.take_over_wal(info.path, n, info.node_epoch, tepoch,
                                                     force_lock=True)
                records, committed = res.records, res.committed_records
                if res.lost:
                    # records lost for good (a gap between the committed end and the WAL, or
                    # another owner): the partitions open at their committed end; counted in
                    # s3kafka_takeover_lost_streams_total (docs/cluster.md, issue 17)
                    log.error("takeover node_id=%d left records behind (LOST: their partitions "
                              "open at the committed end): %s", n, res.lost)
                log.info("takeover finished node_id=%d records=%d committed=%d skipped=%d "
                         "objects=%d bytes=%d already_done=%s took_ms=%.0f", n, res.records,
                         res.committed_records, res.skipped_records, res.objects, res.bytes,
                         res.already_done, (time.monotonic() - t0) * 1000)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the controller gives it to a taker again
            log.error("takeover failed node_id=%d takeover_epoch=%d: %s: %s", n, tepoch,
                      type(e).__name__, e)
            await asyncio.sleep(1)
            try:
                await asyncio.to_thread(self.store.takeover_failed, n, tepoch)
            except Exception as e2:  # noqa: BLE001 - the controller sees the row unchanged
                log_failure(log, e2, "takeover node_id=%d takeover_epoch=%d: giving it back "
                            "failed", n, tepoch)
            return
        try:
            await self._reassign_taken(n, tepoch, records, committed, t0)
        except Exception as e:  # noqa: BLE001 - the row stays ours: a later round ends it
            # (the done callback retrieves nothing: an exception escaping this task was
            # asyncio's 'Task exception was never retrieved' instead of a line of ours)
            log_failure(log, e, "takeover node_id=%d takeover_epoch=%d: WAL recovered, "
                        "reassigning its partitions failed; the next round retries", n, tepoch)

    async def _reassign_taken(self, n: int, tepoch: int, records: int, committed: int,
                              t0: float) -> None:
        """The dead node's WAL is recovered: hand its partitions to live brokers."""
        assert self.store is not None
        await self._refresh(force=True)
        dead = [a for a in self.assign.values() if a.leader == n]
        counts = {m: 0 for m, r in self.live.items() if r.state == LIVE and m != n}
        if not counts:
            counts = {self.node_id: 0}
        for a in self.assign.values():
            if a.leader in counts:
                counts[a.leader] += 1
        leaders: dict[tuple[str, int], int] = {}
        for a in dead:
            m = min(counts, key=lambda k: (counts[k], k))
            leaders[(a.topic_id, a.partition)] = m
            counts[m] += 1
        moved = await asyncio.to_thread(self.store.finish_takeover, n, tepoch, leaders)
        if moved is None:
            log.warning("takeover node_id=%d takeover_epoch=%d superseded", n, tepoch)
            return
        log.info("partitions reassigned node_id=%d partitions=%d to=%s records=%d "
                 "committed=%d took_ms=%.0f", n, len(moved),
                 sorted({a.leader for a in moved}), records, committed,
                 (time.monotonic() - t0) * 1000)
        self._wake.set()


def _holder_gone(message: str) -> bool:
    """Whether the flock holder named in a WALLockedError message ("pid N ...") is stopped
    (SIGSTOP), a zombie, or no longer exists; False for a running process."""
    m = re.search(r"pid (\d+)", message)
    if m is None:
        return False
    try:
        with open(f"/proc/{m.group(1)}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("T", "t", "Z", "X")


async def prepare_node_epoch(cfg: Any, startup: Any = None) -> None:
    """Before the engine opens its WAL: take this node's epoch from the cluster registry.
    A node whose WAL another broker is taking over waits for that to finish, without the
    WAL's lock (``startup``, startup_checks.Startup: the taker must open the WAL; a restart
    that locked it before the fence would otherwise block its own takeover); a node whose WAL
    was taken over starts at its bumped epoch and formats the WAL afresh (its records are
    committed elsewhere)."""
    def read() -> BrokerRow | None:
        st = ClusterStore(cfg.metadata_url)
        try:
            return st.broker(cfg.node_id)
        finally:
            st.close()
    deadline = time.monotonic() + float(getattr(cfg, "cluster_takeover_wait_s", 120.0))
    logged = False
    while True:
        row = await asyncio.to_thread(read)
        if row is None or row.state != FENCED:
            break
        if time.monotonic() > deadline:
            raise ClusterError(f"node id {cfg.node_id} is being taken over by broker "
                               f"{row.taker}; start again when that is done")
        if not logged:
            # taker -1: between a taker's failed attempt and the controller's next pick
            log.warning("waiting for the takeover of this node's WAL by %s (node_epoch=%d)",
                        f"broker {row.taker}" if row.taker >= 0 else
                        "the next taker the controller picks", row.node_epoch)
            logged = True
        if startup is not None and getattr(startup, "wal_fd", None) is not None:
            startup.release_wal()
        await asyncio.sleep(0.5)
    if startup is not None and hasattr(startup, "lock_wal_again"):
        await asyncio.to_thread(startup.lock_wal_again, cfg)
    if row is None:
        return
    epoch = max(int(cfg.engine.get("node_epoch", 0) or 0), row.node_epoch)
    cfg.engine["node_epoch"] = epoch
    if row.state == TAKEN_OVER:
        cfg.engine["wal_reformat_taken_over"] = True
        log.warning("this node's WAL was taken over; formatting it afresh node_epoch=%d",
                    epoch)
