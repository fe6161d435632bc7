"""The classic group coordinator: JoinGroup/SyncGroup/Heartbeat/LeaveGroup state machine,
session and rebalance timers, committed offsets written through to the metadata database.

Everything runs on the event loop; the only blocking work (SQLite writes) runs on one
dedicated worker thread, so writes reach the database in the order they were issued.
Timers are ``loop.call_later`` handles (one per member, one per rebalance): nothing polls.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

from protocol import ErrorCode as E
from storage.sqldb import note_unreachable
from ..failures import is_store_outage
from .group import Group, GroupState, JoinResult, Member, SyncResult
from .store import GroupRecord, GroupStore, OffsetRecord, SqliteGroupStore

log = logging.getLogger(__name__)
T = TypeVar("T")

S = GroupState
TopicPartition = tuple[str, int]


@dataclass(frozen=True)
class CommittedOffset:
    offset: int
    leader_epoch: int
    metadata: str | None
    commit_ts_ms: int


@dataclass
class MemberSummary:
    member_id: str
    instance_id: str | None
    client_id: str
    client_host: str
    metadata: bytes
    assignment: bytes


@dataclass
class GroupSummary:
    group_id: str
    state: str
    protocol_type: str
    protocol_data: str
    members: list[MemberSummary]


class GroupCoordinator:
    """Coordinator for every group (this node coordinates them all)."""

    def __init__(
        self,
        db_path_or_url: str,
        node_id: int = 0,
        host: str = "127.0.0.1",
        port: int = 9092,
        *,
        store: GroupStore | None = None,
        min_session_timeout_ms: int = 6000,
        max_session_timeout_ms: int = 1_800_000,
        initial_rebalance_delay_ms: int = 0,
        max_metadata_bytes: int = 4096,
    ) -> None:
        self.db_path_or_url = db_path_or_url
        self.node_id = node_id
        self.host = host
        self.port = port
        self.min_session_timeout_ms = min_session_timeout_ms
        self.max_session_timeout_ms = max_session_timeout_ms
        self.initial_rebalance_delay_ms = initial_rebalance_delay_ms
        self.max_metadata_bytes = max_metadata_bytes
        self._store: GroupStore | None = store
        self._executor: ThreadPoolExecutor | None = None
        self.groups: dict[str, Group] = {}
        self.offsets: dict[str, dict[TopicPartition, CommittedOffset]] = {}
        self._closing = False
        self._background: set[asyncio.Future[None]] = set()
        # in a cluster: whether this broker coordinates a group id (None: every group)
        self.owns: Callable[[str], bool] | None = None

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Open the store and load committed offsets and persisted groups."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="group-store")
        if self._store is None:
            self._store = await self._run(SqliteGroupStore, self.db_path_or_url)
        offsets = await self._run(self._store.load_offsets)
        records = await self._run(self._store.load_groups)
        for rec in offsets:
            self.offsets.setdefault(rec.group_id, {})[(rec.topic, rec.partition)] = CommittedOffset(
                rec.offset, rec.leader_epoch, rec.metadata, rec.commit_ts_ms
            )
            self.groups.setdefault(rec.group_id, Group(rec.group_id))
        for grec in records:
            self._restore_group(grec)
        log.info("group coordinator started: %d groups, %d with committed offsets", len(self.groups), len(self.offsets))

    def coordinates(self, group_id: str) -> bool:
        """Whether this broker coordinates ``group_id`` (always, outside a cluster)."""
        return self.owns is None or self.owns(group_id)

    async def placement_changed(self, owns: Callable[[str], bool]) -> None:
        """The cluster placed coordinators anew (a broker joined, left or is draining):
        drop the groups this broker no longer coordinates - parked JoinGroup/SyncGroup calls
        answer NOT_COORDINATOR so members look the coordinator up again - and load the ones
        it gained from the metadata store (state and committed offsets another coordinator
        saved there)."""
        self.owns = owns
        lost = [g for gid, g in self.groups.items() if not owns(gid)]
        for group in lost:
            self._unload(group)
        if lost:
            log.info("groups moved to another coordinator: %d", len(lost))
        if self._store is None or self._executor is None or self._closing:
            return
        offsets = await self._run(self._store.load_offsets)
        records = await self._run(self._store.load_groups)
        known = set(self.groups)
        gained: set[str] = set()
        for rec in offsets:
            if rec.group_id in known or not owns(rec.group_id):
                continue
            gained.add(rec.group_id)
            self.offsets.setdefault(rec.group_id, {})[(rec.topic, rec.partition)] = \
                CommittedOffset(rec.offset, rec.leader_epoch, rec.metadata, rec.commit_ts_ms)
            self.groups.setdefault(rec.group_id, Group(rec.group_id))
        for grec in records:
            if grec.group_id in known or not owns(grec.group_id):
                continue
            gained.add(grec.group_id)
            self._restore_group(grec)
        if gained:
            log.info("groups taken over from the metadata store: %d", len(gained))

    def _unload(self, group: Group) -> None:
        """Forget a group another broker coordinates now; its state is in the store."""
        self._release_members(group, E.NOT_COORDINATOR)
        group.state = S.DEAD        # handlers still holding it stop, and never save it
        if self.groups.get(group.group_id) is group:
            del self.groups[group.group_id]
        self.offsets.pop(group.group_id, None)

    def _release_members(self, group: Group, error: int) -> None:
        """Stop a group's rebalance and member timers and answer every parked JoinGroup and
        SyncGroup with `error` (the group is leaving this coordinator: unload or close)."""
        self._cancel_rebalance_timer(group)
        for handle in group.pending_members.values():
            handle.cancel()
        for m in group.members.values():
            m.cancel_timer()
            m.complete_join(JoinResult(error, m.member_id))
            m.complete_sync(SyncResult(error))

    async def refresh_offsets(self, group_id: str) -> None:
        """Re-read a group's committed offsets from the store (in a cluster a coordinator
        that just moved may have acknowledged a commit after this one loaded the group)."""
        if self._store is None or self._executor is None or self._closing:
            return
        load = getattr(self._store, "load_group_offsets", None)
        if load is None:
            return
        rows = await self._run(load, group_id)
        fresh = {(r.topic, r.partition): CommittedOffset(r.offset, r.leader_epoch, r.metadata,
                                                         r.commit_ts_ms) for r in rows}
        if fresh or group_id in self.offsets:
            self.offsets[group_id] = fresh

    async def close(self) -> None:
        """Stop timers, fail parked calls so clients retry elsewhere, finish pending group
        writes (an Empty group must not come back with its departed members), close the store."""
        for group in self.groups.values():
            self._release_members(group, E.COORDINATOR_NOT_AVAILABLE)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        self._closing = True
        if self._executor is not None:
            if self._store is not None:
                await self._run(self._store.close)
            self._executor.shutdown(wait=True)
            self._executor = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        assert self._executor is not None, "GroupCoordinator.start() not called"
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _restore_group(self, rec: GroupRecord) -> None:
        group = self.groups.setdefault(rec.group_id, Group(rec.group_id))
        group.protocol_type = rec.protocol_type
        group.protocol_name = rec.protocol_name
        group.generation_id = rec.generation_id
        for md in rec.members:
            try:
                group.add_member(Member.from_json(md))
            except (KeyError, ValueError, TypeError):
                log.warning("skipping unreadable persisted member of group %s", rec.group_id)
        group.leader_id = rec.leader_id if rec.leader_id in group.members else group.leader_id
        if group.members:
            # Resume the generation; members that are gone expire after their session timeout.
            group.state = S.STABLE
            for m in group.members.values():
                self._schedule_session(group, m)

    # ----------------------------------------------------------------- persistence
    def _group_record(self, group: Group) -> GroupRecord:
        return GroupRecord(
            group.group_id,
            group.protocol_type,
            group.protocol_name,
            group.generation_id,
            group.leader_id,
            [m.to_json() for m in group.members.values()],
        )

    def _save_group(self, group: Group) -> asyncio.Future[None] | None:
        """Snapshot the group now and queue the write now: the single store thread applies
        snapshots in the order they were taken, so an older state never overwrites a newer one."""
        if self._store is None or self._executor is None or self._closing:
            return None
        if group.state == S.DEAD:     # deleted, or moved to another coordinator
            return None
        fut = asyncio.get_running_loop().run_in_executor(
            self._executor, self._store.save_group, self._group_record(group)
        )
        self._background.add(fut)
        fut.add_done_callback(self._on_group_saved)
        return fut

    def _on_group_saved(self, fut: asyncio.Future[None]) -> None:
        self._background.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            # The group keeps working; only the state it would restart with is stale. A
            # metadata outage is one episode in the log (storage/sqldb.py), not a line each.
            exc = fut.exception()
            if not is_store_outage(exc):
                log.error("could not persist group state: %r", exc)
            else:
                note_unreachable(f"group state not persisted: {exc}")

    async def _persist(self, group: Group) -> None:
        """Persist and wait (SyncGroup answers only once the new generation is stored)."""
        fut = self._save_group(group)
        if fut is not None:
            await asyncio.wait([fut])

    # ----------------------------------------------------------------- timers
    def _schedule_session(self, group: Group, member: Member) -> None:
        member.cancel_timer()
        member.session_timer = asyncio.get_running_loop().call_later(
            member.session_timeout_ms / 1000.0, self._on_session_expired, group, member.member_id
        )

    def _on_session_expired(self, group: Group, member_id: str) -> None:
        member = group.members.get(member_id)
        if member is None or self.groups.get(group.group_id) is not group:
            return
        member.session_timer = None
        if member.awaiting_join:
            # A parked JoinGroup is bounded by the rebalance timeout, not the session timeout.
            self._schedule_session(group, member)
            return
        log.info("member %s of group %s expired", member_id, group.group_id)
        self._remove_member_and_update(group, member, "session timeout")

    def _cancel_rebalance_timer(self, group: Group) -> None:
        if group.rebalance_timer is not None:
            group.rebalance_timer.cancel()
            group.rebalance_timer = None

    # ----------------------------------------------------------------- rebalance
    def _prepare_rebalance(self, group: Group, reason: str) -> None:
        if group.state == S.PREPARING_REBALANCE:
            return
        log.info("group %s rebalancing: %s", group.group_id, reason)
        if group.state == S.COMPLETING_REBALANCE:
            for m in group.members.values():
                m.assignment = b""
                m.complete_sync(SyncResult(E.REBALANCE_IN_PROGRESS))
        was_empty = group.state == S.EMPTY
        group.state = S.PREPARING_REBALANCE
        self._cancel_rebalance_timer(group)
        if was_empty and self.initial_rebalance_delay_ms > 0:
            group.initial_delay_active = True
            delay = self.initial_rebalance_delay_ms / 1000.0
        else:
            group.initial_delay_active = False
            delay = self._rebalance_timeout_s(group)
        group.rebalance_timer = asyncio.get_running_loop().call_later(delay, self._on_rebalance_timeout, group)

    @staticmethod
    def _rebalance_timeout_s(group: Group) -> float:
        """A rebalance waits as long as the most patient member allows."""
        return max((m.rebalance_timeout_ms for m in group.members.values()), default=0) / 1000.0

    def _on_rebalance_timeout(self, group: Group) -> None:
        group.rebalance_timer = None
        if group.state != S.PREPARING_REBALANCE or self.groups.get(group.group_id) is not group:
            return
        if group.initial_delay_active:
            group.initial_delay_active = False
            if not group.all_members_joined():
                group.rebalance_timer = asyncio.get_running_loop().call_later(
                    self._rebalance_timeout_s(group), self._on_rebalance_timeout, group)
                return
        self._complete_join(group)

    def _maybe_complete_join(self, group: Group) -> None:
        if group.state == S.PREPARING_REBALANCE and not group.initial_delay_active and group.all_members_joined():
            self._complete_join(group)

    def _complete_join(self, group: Group) -> None:
        """Close the join phase: drop members that did not rejoin, start the next generation,
        answer every parked JoinGroup (the leader gets the member list)."""
        self._cancel_rebalance_timer(group)
        for m in list(group.members.values()):
            if not m.awaiting_join and m.instance_id is None:
                group.remove_member(m.member_id)
        group.generation_id += 1
        if not group.members:
            group.state = S.EMPTY
            group.protocol_name = None
            group.leader_id = None
            self._save_group(group)
            return
        group.protocol_name = group.select_protocol()
        if group.leader_id not in group.members or not group.members[group.leader_id].awaiting_join:
            joined = [m for m in group.members.values() if m.awaiting_join]
            group.leader_id = (joined or list(group.members.values()))[0].member_id
        group.state = S.COMPLETING_REBALANCE
        all_members = [
            (m.member_id, m.instance_id, m.metadata_for(group.protocol_name)) for m in group.members.values()
        ]
        for m in group.members.values():
            if m.awaiting_join:
                m.complete_join(
                    JoinResult(
                        E.NONE,
                        m.member_id,
                        group.generation_id,
                        group.protocol_type,
                        group.protocol_name,
                        group.leader_id or "",
                        all_members if m.member_id == group.leader_id else [],
                    )
                )
            self._schedule_session(group, m)
        log.info(
            "group %s generation %d: %d members, protocol %s",
            group.group_id, group.generation_id, len(group.members), group.protocol_name,
        )

    def _remove_member_and_update(self, group: Group, member: Member, reason: str) -> None:
        member.complete_join(JoinResult(E.UNKNOWN_MEMBER_ID, member.member_id))
        member.complete_sync(SyncResult(E.UNKNOWN_MEMBER_ID))
        group.remove_member(member.member_id)
        if group.state in (S.STABLE, S.COMPLETING_REBALANCE):
            self._prepare_rebalance(group, f"member {member.member_id} left: {reason}")
        if group.state == S.PREPARING_REBALANCE:
            if not group.members and not group.pending_members:
                self._complete_join(group)
            else:
                self._maybe_complete_join(group)

    # ----------------------------------------------------------------- JoinGroup
    async def join_group(
        self,
        group_id: str,
        member_id: str,
        instance_id: str | None,
        client_id: str,
        client_host: str,
        session_timeout_ms: int,
        rebalance_timeout_ms: int,
        protocol_type: str,
        protocols: list[tuple[str, bytes]],
        require_known_member_id: bool,
    ) -> JoinResult:
        """JoinGroup: returns when the join phase of the rebalance completes for this member."""
        if not group_id:
            return JoinResult(E.INVALID_GROUP_ID, member_id)
        if not self.min_session_timeout_ms <= session_timeout_ms <= self.max_session_timeout_ms:
            return JoinResult(E.INVALID_SESSION_TIMEOUT, member_id)
        if rebalance_timeout_ms < 0:  # v0 has no rebalance timeout: Kafka uses the session timeout
            rebalance_timeout_ms = session_timeout_ms
        group = self.groups.get(group_id)
        if group is None:
            if member_id:
                return JoinResult(E.UNKNOWN_MEMBER_ID, member_id)
            if not protocols or not protocol_type:
                return JoinResult(E.INCONSISTENT_GROUP_PROTOCOL, member_id)
            group = self.groups[group_id] = Group(group_id)
        if group.state == S.DEAD:
            return JoinResult(E.COORDINATOR_NOT_AVAILABLE, member_id)
        if not group.supports_protocols(protocol_type, protocols, member_id or None):
            return JoinResult(E.INCONSISTENT_GROUP_PROTOCOL, member_id)
        params = (client_id, client_host, session_timeout_ms, rebalance_timeout_ms, protocol_type, protocols)
        if not member_id:
            if instance_id is not None and instance_id in group.static_members:
                return await self._rejoin_static_unknown(group, instance_id, *params)
            new_id = f"{instance_id or client_id}-{uuid.uuid4()}"
            if require_known_member_id and instance_id is None:
                self._add_pending_member(group, new_id, session_timeout_ms)
                return JoinResult(E.MEMBER_ID_REQUIRED, new_id)
            return await self._add_member_and_rebalance(group, new_id, instance_id, *params)
        if member_id in group.pending_members:
            group.pending_members.pop(member_id).cancel()
            return await self._add_member_and_rebalance(group, member_id, instance_id, *params)
        if group.is_static_member_fenced(member_id, instance_id):
            return JoinResult(E.FENCED_INSTANCE_ID, member_id)
        member = group.members.get(member_id)
        if member is None or group.state == S.EMPTY:
            return JoinResult(E.UNKNOWN_MEMBER_ID, member_id)
        return await self._rejoin_known(group, member, session_timeout_ms, rebalance_timeout_ms, protocols)

    def _add_pending_member(self, group: Group, member_id: str, session_timeout_ms: int) -> None:
        def expire() -> None:
            if group.pending_members.pop(member_id, None) is not None:
                if group.state == S.PREPARING_REBALANCE:
                    self._maybe_complete_join(group)
                else:
                    self._drop_if_unused(group)

        group.pending_members[member_id] = asyncio.get_running_loop().call_later(session_timeout_ms / 1000.0, expire)

    def _drop_if_unused(self, group: Group) -> None:
        """Forget a group that only ever saw a MEMBER_ID_REQUIRED round trip nobody finished."""
        if not group.members and not group.pending_members and group.generation_id == 0:
            if self.groups.get(group.group_id) is group and not self.offsets.get(group.group_id):
                del self.groups[group.group_id]

    async def _add_member_and_rebalance(
        self, group: Group, member_id: str, instance_id: str | None, client_id: str, client_host: str,
        session_timeout_ms: int, rebalance_timeout_ms: int, protocol_type: str, protocols: list[tuple[str, bytes]],
    ) -> JoinResult:
        member = Member(
            member_id, instance_id, client_id, client_host, session_timeout_ms, rebalance_timeout_ms,
            protocol_type, [(n, bytes(m)) for n, m in protocols],
        )
        group.add_member(member)
        self._schedule_session(group, member)
        return await self._join_rebalance(group, member, f"new member {member_id} joined")

    async def _rejoin_known(
        self, group: Group, member: Member, session_timeout_ms: int, rebalance_timeout_ms: int,
        protocols: list[tuple[str, bytes]],
    ) -> JoinResult:
        unchanged = member.same_protocols(protocols)
        if group.state == S.STABLE and unchanged and member.member_id != group.leader_id:
            # A follower rejoining without change: hand back the current generation.
            self._schedule_session(group, member)
            return self._current_join_result(group, member)
        if group.state == S.COMPLETING_REBALANCE and unchanged:
            self._schedule_session(group, member)
            return self._current_join_result(group, member)
        member.session_timeout_ms = session_timeout_ms
        member.rebalance_timeout_ms = rebalance_timeout_ms
        member.protocols = [(n, bytes(m)) for n, m in protocols]
        if member.awaiting_join:  # a duplicate JoinGroup supersedes the parked one
            member.complete_join(JoinResult(E.UNKNOWN_MEMBER_ID, member.member_id))
        self._schedule_session(group, member)
        return await self._join_rebalance(group, member, f"member {member.member_id} rejoined")

    def _current_join_result(self, group: Group, member: Member) -> JoinResult:
        members = []
        if member.member_id == group.leader_id:
            members = [(m.member_id, m.instance_id, m.metadata_for(group.protocol_name)) for m in group.members.values()]
        return JoinResult(
            E.NONE, member.member_id, group.generation_id, group.protocol_type, group.protocol_name,
            group.leader_id or "", members,
        )

    async def _rejoin_static_unknown(
        self, group: Group, instance_id: str, client_id: str, client_host: str, session_timeout_ms: int,
        rebalance_timeout_ms: int, protocol_type: str, protocols: list[tuple[str, bytes]],
    ) -> JoinResult:
        """KIP-345: a static member restarting with a new member id replaces its old self;
        the old member id is fenced, and a Stable group does not rebalance."""
        old_id = group.static_members[instance_id]
        old = group.members[old_id]
        new_id = f"{instance_id}-{uuid.uuid4()}"
        old.complete_join(JoinResult(E.FENCED_INSTANCE_ID, old_id))
        old.complete_sync(SyncResult(E.FENCED_INSTANCE_ID))
        old.cancel_timer()
        old_leader = group.leader_id
        del group.members[old_id]
        old.member_id = new_id
        old.client_id, old.client_host = client_id, client_host
        old.session_timeout_ms, old.rebalance_timeout_ms = session_timeout_ms, rebalance_timeout_ms
        old.protocols = [(n, bytes(m)) for n, m in protocols]
        group.members[new_id] = old
        group.static_members[instance_id] = new_id
        if group.leader_id == old_id:
            group.leader_id = new_id
        self._schedule_session(group, old)
        log.info("group %s: static member %s replaced %s by %s", group.group_id, instance_id, old_id, new_id)
        if group.state == S.STABLE:
            if group.select_protocol() == group.protocol_name:
                await self._persist(group)
                # The old leader id is returned on purpose: the replacement must not believe
                # it leads and compute an assignment a Stable group would never distribute.
                return JoinResult(
                    E.NONE, new_id, group.generation_id, group.protocol_type, group.protocol_name,
                    old_leader or "", [],
                )
        return await self._join_rebalance(group, old, f"static member {instance_id} rejoined")

    async def _join_rebalance(self, group: Group, member: Member, reason: str) -> JoinResult:
        """Park ``member``'s JoinGroup until the rebalance it starts (or joins) completes: the
        answer comes from _maybe_complete_join, now or when the last member has rejoined."""
        fut = member.join_future = asyncio.get_running_loop().create_future()
        self._prepare_rebalance(group, reason)
        self._maybe_complete_join(group)
        return await fut

    # ----------------------------------------------------------------- SyncGroup
    async def sync_group(
        self,
        group_id: str,
        generation_id: int,
        member_id: str,
        instance_id: str | None,
        protocol_type: str | None,
        protocol_name: str | None,
        assignments: dict[str, bytes],
    ) -> SyncResult:
        """SyncGroup: the leader's assignments are distributed to every member of the generation."""
        group = self.groups.get(group_id)
        if group is None:
            return SyncResult(E.UNKNOWN_MEMBER_ID)
        if group.state == S.DEAD:
            return SyncResult(E.COORDINATOR_NOT_AVAILABLE)
        if group.is_static_member_fenced(member_id, instance_id):
            return SyncResult(E.FENCED_INSTANCE_ID)
        member = group.members.get(member_id)
        if member is None:
            return SyncResult(E.UNKNOWN_MEMBER_ID)
        if generation_id != group.generation_id:
            return SyncResult(E.ILLEGAL_GENERATION)
        if (protocol_type is not None and protocol_type != group.protocol_type) or (
            protocol_name is not None and protocol_name != group.protocol_name
        ):
            return SyncResult(E.INCONSISTENT_GROUP_PROTOCOL)
        if group.state == S.EMPTY:
            return SyncResult(E.UNKNOWN_MEMBER_ID)
        if group.state == S.PREPARING_REBALANCE:
            return SyncResult(E.REBALANCE_IN_PROGRESS)
        self._schedule_session(group, member)
        if group.state == S.STABLE:
            return SyncResult(E.NONE, group.protocol_type, group.protocol_name, member.assignment)
        # CompletingRebalance: park until the leader's assignment arrives.
        if member.awaiting_sync:
            member.complete_sync(SyncResult(E.REBALANCE_IN_PROGRESS))
        member.sync_future = asyncio.get_running_loop().create_future()
        fut = member.sync_future
        if member_id == group.leader_id:
            for m in group.members.values():
                m.assignment = bytes(assignments.get(m.member_id, b""))
            generation = group.generation_id
            await self._persist(group)
            if group.state == S.COMPLETING_REBALANCE and group.generation_id == generation:
                group.state = S.STABLE
                for m in group.members.values():
                    m.complete_sync(SyncResult(E.NONE, group.protocol_type, group.protocol_name, m.assignment))
        return await fut

    # ----------------------------------------------------------------- Heartbeat
    def heartbeat(self, group_id: str, generation_id: int, member_id: str, instance_id: str | None) -> int:
        """Heartbeat: keeps the session alive and tells members when to rejoin."""
        group = self.groups.get(group_id)
        if group is None:
            return E.UNKNOWN_MEMBER_ID
        if group.state == S.DEAD:
            return E.COORDINATOR_NOT_AVAILABLE
        if group.is_static_member_fenced(member_id, instance_id):
            return E.FENCED_INSTANCE_ID
        member = group.members.get(member_id)
        if member is None or group.state == S.EMPTY:
            return E.UNKNOWN_MEMBER_ID
        if generation_id != group.generation_id:
            return E.ILLEGAL_GENERATION
        self._schedule_session(group, member)
        if group.state == S.PREPARING_REBALANCE:
            return E.REBALANCE_IN_PROGRESS
        return E.NONE

    # ----------------------------------------------------------------- LeaveGroup
    def leave_group(self, group_id: str, members: list[tuple[str, str | None]]) -> tuple[int, list[int]]:
        """LeaveGroup (v3+ batches): returns (top-level error, per-member errors)."""
        group = self.groups.get(group_id)
        if group is None:
            return E.NONE, [E.UNKNOWN_MEMBER_ID] * len(members)
        if group.state == S.DEAD:
            return E.COORDINATOR_NOT_AVAILABLE, [E.COORDINATOR_NOT_AVAILABLE] * len(members)
        errors: list[int] = []
        for member_id, instance_id in members:
            if instance_id is not None:
                current = group.static_members.get(instance_id)
                if current is None:
                    errors.append(E.UNKNOWN_MEMBER_ID)
                    continue
                if member_id and member_id != current:
                    errors.append(E.FENCED_INSTANCE_ID)
                    continue
                member_id = current
            if member_id in group.pending_members:
                group.pending_members.pop(member_id).cancel()
                self._maybe_complete_join(group)
                errors.append(E.NONE)
                continue
            member = group.members.get(member_id)
            if member is None:
                errors.append(E.UNKNOWN_MEMBER_ID)
                continue
            self._remove_member_and_update(group, member, "left the group")
            errors.append(E.NONE)
        return E.NONE, errors

    # ----------------------------------------------------------------- offsets
    async def commit_offsets(
        self,
        group_id: str,
        generation_id: int,
        member_id: str,
        instance_id: str | None,
        offsets: list[tuple[str, int, int, int, str | None]],
    ) -> int:
        """OffsetCommit after the handler validated topics: (topic, partition, offset,
        leader_epoch, metadata). Durable in the database before this returns NONE."""
        if not group_id:
            return E.INVALID_GROUP_ID
        group = self.groups.get(group_id)
        if group is None:
            if generation_id >= 0:
                return E.ILLEGAL_GENERATION
            if not offsets:
                return E.NONE
            # Simple (assign-based) consumers keep offsets in a group nobody joins.
            group = self.groups[group_id] = Group(group_id)
        error = self._validate_commit(group, generation_id, member_id, instance_id)
        if error != E.NONE:
            return error
        if group.state != S.EMPTY:
            member = group.members.get(member_id)
            if member is not None:
                self._schedule_session(group, member)
        if not offsets:
            return E.NONE
        await self._save_offsets(group_id, offsets)
        if self.groups.get(group_id) is not group:  # deleted meanwhile: it exists again (Empty)
            self.groups.setdefault(group_id, Group(group_id))
        return E.NONE

    async def commit_txn_offsets(self, group_id: str,
                                 offsets: list[tuple[str, int, int, int, str | None]]) -> None:
        """A committed transaction's offsets (TxnOffsetCommit, validated when they were sent)
        become the group's committed offsets; durable before this returns."""
        if not offsets:
            return
        await self._save_offsets(group_id, offsets)
        self.groups.setdefault(group_id, Group(group_id))

    async def _save_offsets(self, group_id: str,
                            offsets: list[tuple[str, int, int, int, str | None]]) -> None:
        """Write (topic, partition, offset, leader epoch, metadata) rows to the store, stamped
        now, and once durable make them the group's committed offsets in memory."""
        now = int(time.time() * 1000)
        records = [OffsetRecord(group_id, t, p, o, ep, md, now) for t, p, o, ep, md in offsets]
        assert self._store is not None
        await self._run(self._store.commit_offsets, records)
        committed = self.offsets.setdefault(group_id, {})
        for r in records:
            committed[(r.topic, r.partition)] = CommittedOffset(r.offset, r.leader_epoch, r.metadata, r.commit_ts_ms)

    def _validate_commit(self, group: Group, generation_id: int, member_id: str, instance_id: str | None) -> int:
        if group.state == S.DEAD:
            return E.COORDINATOR_NOT_AVAILABLE
        if group.is_static_member_fenced(member_id, instance_id):
            return E.FENCED_INSTANCE_ID
        if generation_id < 0 and group.state == S.EMPTY:
            return E.NONE
        if group.state == S.COMPLETING_REBALANCE:
            return E.REBALANCE_IN_PROGRESS
        if member_id not in group.members:
            return E.UNKNOWN_MEMBER_ID
        if generation_id != group.generation_id:
            return E.ILLEGAL_GENERATION
        return E.NONE

    def fetch_offsets(
        self, group_id: str, partitions: list[TopicPartition] | None
    ) -> list[tuple[str, int, CommittedOffset | None]]:
        """OffsetFetch: the requested partitions (None = every partition with a commit)."""
        committed = self.offsets.get(group_id, {})
        if partitions is None:
            return [(t, p, c) for (t, p), c in sorted(committed.items())]
        return [(t, p, committed.get((t, p))) for t, p in partitions]

    def validate_metadata(self, metadata: str | None) -> bool:
        return metadata is None or len(metadata.encode("utf-8")) <= self.max_metadata_bytes

    async def delete_offsets(
        self, group_id: str, partitions: list[TopicPartition]
    ) -> tuple[int, dict[TopicPartition, int]]:
        """OffsetDelete: refused per partition while the group's members subscribe to the topic."""
        group = self.groups.get(group_id)
        if group is None or group.state == S.DEAD:
            return E.GROUP_ID_NOT_FOUND, {}
        subscribed: set[str] = set()
        if not group.is_empty():
            topics = group.subscribed_topics()
            if topics is None:
                return E.NON_EMPTY_GROUP, {}
            subscribed = topics
        result: dict[TopicPartition, int] = {}
        to_delete = []
        for tp in partitions:
            if tp[0] in subscribed:
                result[tp] = E.GROUP_SUBSCRIBED_TO_TOPIC
            else:
                result[tp] = E.NONE
                to_delete.append(tp)
        if to_delete:
            assert self._store is not None
            await self._run(self._store.delete_offsets, group_id, to_delete)
            committed = self.offsets.get(group_id, {})
            for tp in to_delete:
                committed.pop(tp, None)
        return E.NONE, result

    async def on_topic_deleted(self, topic: str) -> None:
        """Drop every group's committed offsets of a deleted topic, as Kafka does: a topic
        created again under that name must not hand consumers the old topic's offsets. A group
        that only ever held offsets (no member ever joined) goes with its last offset."""
        for gid in [g for g, c in self.offsets.items() if any(tp[0] == topic for tp in c)]:
            tps = [tp for tp in self.offsets.get(gid, {}) if tp[0] == topic]
            if not tps:
                continue
            assert self._store is not None
            await self._run(self._store.delete_offsets, gid, tps)
            committed = self.offsets.get(gid, {})
            for tp in tps:
                committed.pop(tp, None)
            if not committed:
                self.offsets.pop(gid, None)
                group = self.groups.get(gid)
                if group is not None and group.state == S.EMPTY:
                    self._drop_if_unused(group)

    # ----------------------------------------------------------------- admin
    def describe_group(self, group_id: str) -> GroupSummary | None:
        group = self.groups.get(group_id)
        if group is None:
            return None
        stable = group.state == S.STABLE
        members = [
            MemberSummary(
                m.member_id, m.instance_id, m.client_id, m.client_host,
                m.metadata_for(group.protocol_name) if stable else b"",
                m.assignment if stable else b"",
            )
            for m in group.members.values()
        ]
        return GroupSummary(
            group.group_id, group.state.value, group.protocol_type or "",
            (group.protocol_name or "") if stable else "", members,
        )

    def list_groups(self) -> list[tuple[str, str, str]]:
        """(group id, protocol type, state) of every group this node coordinates."""
        return [(g.group_id, g.protocol_type or "", g.state.value) for g in self.groups.values()]

    async def delete_groups(self, group_ids: Iterable[str]) -> dict[str, int]:
        """DeleteGroups: only groups without members; their offsets go too."""
        result: dict[str, int] = {}
        for gid in group_ids:
            group = self.groups.get(gid)
            if not gid:
                result[gid] = E.INVALID_GROUP_ID
            elif group is None or group.state == S.DEAD:
                result[gid] = E.GROUP_ID_NOT_FOUND
            elif group.members or group.state != S.EMPTY:
                result[gid] = E.NON_EMPTY_GROUP
            else:
                assert self._store is not None
                await self._run(self._store.delete_group, gid)
                if self.groups.get(gid) is group and not group.members:
                    for handle in group.pending_members.values():
                        handle.cancel()
                    group.state = S.DEAD
                    del self.groups[gid]
                    self.offsets.pop(gid, None)
                result[gid] = E.NONE
        return result
