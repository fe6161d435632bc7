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
store. A broker that dies keeps its partitions until it restarts (WAL takeover is not built).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Any

from .store import ACTIVE, DRAINING, LIVE, MOVING, STOPPED, Assignment, BrokerRow, \
    ClusterStore, NodeIdInUse, now_ms

log = logging.getLogger("broker.cluster")

HEARTBEAT_S = 1.0
LEASE_MS = 6000
POLL_S = 0.2
MAX_MOVES_PER_ROUND = 16


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
        self._ops: set[asyncio.Task] = set()
        self._members_seen: frozenset[int] = frozenset()
        self._stopping = False
        self._wake = asyncio.Event()

    # ---- start / stop -----------------------------------------------------------------------
    async def start(self) -> None:
        """Register (refusing a node id another live broker holds) and read the cluster."""
        cfg = self.broker.config
        self.store = await asyncio.to_thread(ClusterStore, cfg.metadata_url)
        try:
            home = f"{socket.gethostname()}:{os.path.abspath(cfg.wal_path)}"
            await asyncio.to_thread(self.store.register, self.node_id, cfg.advertised_host,
                                    cfg.advertised_port, self.rack, self.instance, LEASE_MS,
                                    home)
        except NodeIdInUse as e:
            raise ClusterError(str(e)) from None
        await self._elect()
        await self._refresh()
        log.info("cluster joined node_id=%d rack=%s live_brokers=%s controller=%d",
                 self.node_id, self.rack, sorted(self.live), self.controller_id)

    def run(self) -> None:
        """Start the background loops (after the topics are loaded)."""
        self._members_seen = frozenset(self.live)
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
        for t in self._tasks:
            t.cancel()
        for t in list(self._tasks) + list(self._ops):
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self.store is not None:
            try:
                if self.controller_id == self.node_id:
                    await asyncio.to_thread(self.store.resign, self.node_id,
                                            self.controller_epoch)
                await asyncio.to_thread(self.store.set_state, self.node_id, self.instance,
                                        STOPPED, True)
            except Exception:  # noqa: BLE001
                log.exception("cluster deregistration failed")
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

    def live_brokers(self) -> list[BrokerRow]:
        return [self.live[n] for n in sorted(self.live)]

    def endpoint(self, node: int) -> tuple[str, int] | None:
        b = self.live.get(node)
        return None if b is None else (b.host, b.port)

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

    def topic_changed(self) -> None:
        """Topics were created, deleted, grown or reconfigured here: tell the others."""
        if self.store is not None:
            t = asyncio.get_running_loop().run_in_executor(None, self.store.bump)
            self._ops.add(t)  # type: ignore[arg-type]
            t.add_done_callback(self._ops.discard)  # type: ignore[arg-type]

    # ---- loops --------------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                ok = await asyncio.to_thread(self.store.heartbeat, self.node_id, self.instance,
                                             LEASE_MS)
                if not ok:
                    log.error("node id %d was taken over by another broker instance",
                              self.node_id)
                await self._elect()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - database briefly unavailable: next beat
                log.exception("cluster heartbeat failed")

    async def _elect(self) -> None:
        assert self.store is not None
        was = self.controller_id, self.controller_epoch
        self.controller_id, self.controller_epoch = await asyncio.to_thread(
            self.store.elect, self.node_id,
            self.controller_epoch if was[0] == self.node_id else -1, LEASE_MS)
        if (self.controller_id, self.controller_epoch) != was:
            log.info("controller node_id=%d epoch=%d (this broker: %s)", self.controller_id,
                     self.controller_epoch, "yes" if self.controller_id == self.node_id else "no")
            if self.controller_id == self.node_id and was[1] > 0 and self.broker.groups:
                reload = getattr(self.broker.groups, "reload", None)
                if reload is not None:   # groups are coordinated by the controller
                    await reload()
            self._wake.set()

    async def _watch_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._refresh()
                await self._apply()
                if self.controller_id == self.node_id:
                    await self._control()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("cluster watch round failed")

    async def _refresh(self, force: bool = False) -> None:
        assert self.store is not None
        v = await asyncio.to_thread(self.store.version)
        now = now_ms()
        rows = await asyncio.to_thread(self.store.brokers)
        live = {b.node_id: b for b in rows if b.lease_until_ms > now and b.state != STOPPED}
        changed = set(live) != set(self.live) or any(
            live[n].state != self.live[n].state for n in live if n in self.live)
        self.live = live
        if v == self.version and not force and not changed:
            return
        self.version = v
        self.assign = {(a.topic_id, a.partition): a
                       for a in await asyncio.to_thread(self.store.assignments)}
        tm = self.broker.topic_manager
        if tm is not None and self._tasks:
            await tm.sync()

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
                if a.leader == self.node_id and p is None:
                    self._spawn(key, self._open(topic, i, a))
                elif a.leader == self.node_id and a.state == MOVING:
                    self._spawn(key, self._release(topic, i, a))
                elif a.leader != self.node_id and p is not None:
                    log.warning("partition led elsewhere was open here topic=%s partition=%d "
                                "leader=%d; closing", topic.name, i, a.leader)
                    self._spawn(key, self._close_local(topic, i))

    def _spawn(self, key: tuple[str, int], coro: Any) -> None:
        self._busy.add(key)
        t = asyncio.create_task(coro)
        self._ops.add(t)

        def done(t: asyncio.Task) -> None:
            self._busy.discard(key)
            self._ops.discard(t)
            self._wake.set()
        t.add_done_callback(done)

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
        except Exception:  # noqa: BLE001 - retried next round
            log.exception("opening partition failed topic=%s partition=%d", topic.name, index)
            await asyncio.sleep(1)
            return
        if self.broker.topics.get(topic.name) is not topic or index >= len(topic.partitions):
            await p.close()
            return
        topic.partitions[index] = p
        log.info("partition opened topic=%s partition=%d leader_epoch=%d log_end_offset=%d "
                 "took_ms=%.0f", topic.name, index, a.leader_epoch, stream.end_offset,
                 (time.monotonic() - t0) * 1000)

    async def _release(self, topic: Any, index: int, a: Assignment) -> None:
        """Stop accepting, upload, save producer state, hand the row to the target."""
        t0 = time.monotonic()
        p = topic.partitions[index]
        if p is None:
            return
        topic.partitions[index] = None      # produce/fetch answer NOT_LEADER_OR_FOLLOWER now
        await p.close()
        store = self.broker.store
        release = getattr(store, "release_stream", None)
        try:
            end = await release(p.stream.stream_id) if release else p.stream.end_offset
            fut = p.snapshot(force=True)     # covers the appends that were in flight
            if fut is not None:
                await asyncio.wrap_future(fut)
        except Exception:  # noqa: BLE001 - keep leading; the move is retried
            log.exception("releasing partition failed topic=%s partition=%d", topic.name, index)
            await self._reopen(topic, index, p)
            await asyncio.sleep(1)
            return
        assert self.store is not None
        new = await asyncio.to_thread(self.store.hand_over, a.topic_id, index, self.node_id,
                                      a.leader_epoch, end)
        if new is None:     # cancelled meanwhile: lead it again
            await self._reopen(topic, index, p)
            return
        log.info("partition moved topic=%s partition=%d from=%d to=%d leader_epoch=%d "
                 "end_offset=%d release_ms=%.0f", topic.name, index, self.node_id, new,
                 a.leader_epoch + 1, end, (time.monotonic() - t0) * 1000)

    async def _reopen(self, topic: Any, index: int, old: Any) -> None:
        from ..partition import Partition  # noqa: PLC0415
        stream = old.stream
        if hasattr(stream, "owned"):
            stream.owned = True
        topic.partitions[index] = await Partition.open(
            self.broker, topic.name, topic.topic_id, index, stream, topic.configs)

    async def _close_local(self, topic: Any, index: int) -> None:
        p = topic.partitions[index]
        if p is None:
            return
        topic.partitions[index] = None
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
