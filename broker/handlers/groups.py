"""Group APIs: FindCoordinator, JoinGroup, SyncGroup, Heartbeat, LeaveGroup, OffsetCommit,
OffsetFetch, DescribeGroups, ListGroups, DeleteGroups, OffsetDelete.

These only translate between the versioned wire objects and ``ctx.broker.groups`` (the
GroupCoordinator); every rule about groups lives in ``broker/groups/``.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

from protocol import ErrorCode as E, response_class
from storage.sqldb import note_unreachable

from ..failures import is_store_outage
from ..groups import GroupCoordinator
from ..listeners import of_connection, own_address
from ..partition import find_topic, find_topic_by_id
from ..transactions import coordinator_for
from ..transactions.placement import transaction_coordinator
from .authorized import GROUP_OPS, ops_if
from .registry import RequestContext, handler

log = logging.getLogger(__name__)

FIND_COORDINATOR, OFFSET_COMMIT, OFFSET_FETCH, JOIN_GROUP, HEARTBEAT = 10, 8, 9, 11, 12
LEAVE_GROUP, SYNC_GROUP, DESCRIBE_GROUPS, LIST_GROUPS, DELETE_GROUPS, OFFSET_DELETE = 13, 14, 15, 16, 42, 47
KEY_TYPE_GROUP, KEY_TYPE_TRANSACTION = 0, 1


def _coordinator(ctx: RequestContext) -> GroupCoordinator:
    return ctx.broker.groups


def _client_host(ctx: RequestContext) -> str:
    """Kafka reports client hosts as "/<ip>"; the connection knows its peer as "ip:port"."""
    peer = getattr(ctx.conn, "peer", None)
    if not peer:
        return ""
    host = peer[0] if isinstance(peer, (tuple, list)) else str(peer).rsplit(":", 1)[0]
    return f"/{host}"


def _client_id(ctx: RequestContext) -> str:
    return getattr(ctx.header, "client_id", None) or ""


def _bytes(value: Any) -> bytes:
    if value is None:
        return b""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return bytes(value.encode()) if hasattr(value, "encode") else b""


# ------------------------------------------------------------------------- FindCoordinator
@handler(FIND_COORDINATOR)
async def find_coordinator(ctx: RequestContext, req: Any) -> Any:
    """Groups (key type 0) are spread over the live brokers (``ClusterRoom.coordinator``,
    see broker/cluster/coordinators.py), transactional ids (key type 1) by the same placement
    (broker/transactions/placement.py). A single broker coordinates everything. Share groups (key type 2, v6)
    are refused with INVALID_REQUEST."""
    cls = response_class(FIND_COORDINATOR)
    cfg = ctx.broker.config
    cluster = getattr(ctx.broker, "cluster", None)
    key_type = req.key_type

    def answer(key: str) -> tuple[int, str | None, int, str, int]:
        if key_type not in (KEY_TYPE_GROUP, KEY_TYPE_TRANSACTION):
            return E.INVALID_REQUEST, f"unsupported coordinator key type {key_type}", -1, "", -1
        node = cfg.node_id
        if cluster is not None:
            # one placement for both (broker/cluster/coordinators.py)
            node = cluster.coordinator(key) if key_type == KEY_TYPE_GROUP \
                else transaction_coordinator(ctx.broker, key)
        if node == cfg.node_id:
            host, port = advertised_for(ctx)
            return E.NONE, None, node, host, port
        ep = cluster.endpoint(node, of_connection(ctx)) \
            if cluster is not None and node >= 0 else None
        if ep is None:             # it just left; the next is being chosen
            return E.COORDINATOR_NOT_AVAILABLE, "the coordinator is changing", -1, "", -1
        return E.NONE, None, node, ep[0], ep[1]

    if ctx.version >= 4:
        coordinators = []
        for key in req.coordinator_keys or []:
            err, msg, n, h, p = answer(key)
            coordinators.append(cls.Coordinator(key=key, node_id=n, host=h, port=p, error_code=err, error_message=msg))
        return cls(throttle_time_ms=0, coordinators=coordinators)
    err, msg, n, h, p = answer(req.key)
    return cls(throttle_time_ms=0, error_code=err, error_message=msg, node_id=n, host=h, port=p)


def advertised_for(ctx: RequestContext) -> tuple[str, int]:
    """This broker's advertised address on the listener the client connected to."""
    return own_address(ctx.broker.config, of_connection(ctx))


def _elsewhere(ctx: RequestContext, group_id: str) -> bool:
    """Another broker coordinates this group (the client must look it up again)."""
    coord = _coordinator(ctx)
    return coord is not None and not coord.coordinates(group_id or "")


# ------------------------------------------------------------------------- JoinGroup
@handler(JOIN_GROUP)
async def join_group(ctx: RequestContext, req: Any) -> Any:
    """Parks until the rebalance's join phase completes (or answers at once on errors)."""
    cls = response_class(JOIN_GROUP)
    v = ctx.version
    protocols = [(p.name, _bytes(p.metadata)) for p in (req.protocols or [])]
    if _elsewhere(ctx, req.group_id):
        return cls(throttle_time_ms=0, error_code=E.NOT_COORDINATOR, generation_id=-1,
                   protocol_type=None, protocol_name=None if v >= 7 else "", leader="",
                   skip_assignment=False, member_id=req.member_id or "", members=[])
    res = await _coordinator(ctx).join_group(
        req.group_id,
        req.member_id or "",
        req.group_instance_id if v >= 5 else None,
        _client_id(ctx),
        _client_host(ctx),
        req.session_timeout_ms,
        req.rebalance_timeout_ms if v >= 1 else -1,
        req.protocol_type,
        protocols,
        require_known_member_id=v >= 4,
    )
    ok = res.error == E.NONE
    protocol_name = res.protocol_name if ok else None
    return cls(
        throttle_time_ms=0,
        error_code=res.error,
        generation_id=res.generation_id if ok else -1,
        protocol_type=res.protocol_type if ok else None,
        protocol_name=protocol_name if v >= 7 else (protocol_name or ""),
        leader=res.leader_id if ok else "",
        skip_assignment=res.skip_assignment,
        member_id=res.member_id,
        members=[
            cls.JoinGroupResponseMember(member_id=mid, group_instance_id=iid, metadata=meta)
            for mid, iid, meta in res.members
        ],
    )


# ------------------------------------------------------------------------- SyncGroup
@handler(SYNC_GROUP)
async def sync_group(ctx: RequestContext, req: Any) -> Any:
    """Parks followers until the leader's assignment arrives."""
    cls = response_class(SYNC_GROUP)
    v = ctx.version
    assignments = {a.member_id: _bytes(a.assignment) for a in (req.assignments or [])}
    if _elsewhere(ctx, req.group_id):
        return cls(throttle_time_ms=0, error_code=E.NOT_COORDINATOR, protocol_type=None,
                   protocol_name=None, assignment=b"")
    res = await _coordinator(ctx).sync_group(
        req.group_id,
        req.generation_id,
        req.member_id,
        req.group_instance_id if v >= 3 else None,
        req.protocol_type if v >= 5 else None,
        req.protocol_name if v >= 5 else None,
        assignments,
    )
    ok = res.error == E.NONE
    return cls(
        throttle_time_ms=0,
        error_code=res.error,
        protocol_type=res.protocol_type if ok else None,
        protocol_name=res.protocol_name if ok else None,
        assignment=res.assignment,
    )


# ------------------------------------------------------------------------- Heartbeat
@handler(HEARTBEAT)
async def heartbeat(ctx: RequestContext, req: Any) -> Any:
    if _elsewhere(ctx, req.group_id):
        return response_class(HEARTBEAT)(throttle_time_ms=0, error_code=E.NOT_COORDINATOR)
    err = _coordinator(ctx).heartbeat(
        req.group_id, req.generation_id, req.member_id, req.group_instance_id if ctx.version >= 3 else None
    )
    return response_class(HEARTBEAT)(throttle_time_ms=0, error_code=err)


# ------------------------------------------------------------------------- LeaveGroup
@handler(LEAVE_GROUP)
async def leave_group(ctx: RequestContext, req: Any) -> Any:
    """v0-2 name one member; v3+ carry a batch (static members by instance id)."""
    cls = response_class(LEAVE_GROUP)
    if _elsewhere(ctx, req.group_id):
        if ctx.version < 3:
            return cls(throttle_time_ms=0, error_code=E.NOT_COORDINATOR)
        return cls(throttle_time_ms=0, error_code=E.NOT_COORDINATOR, members=[])
    if ctx.version < 3:
        _, errors = _coordinator(ctx).leave_group(req.group_id, [(req.member_id, None)])
        return cls(throttle_time_ms=0, error_code=errors[0])
    members = [(m.member_id or "", m.group_instance_id) for m in (req.members or [])]
    top, errors = _coordinator(ctx).leave_group(req.group_id, members)
    return cls(
        throttle_time_ms=0,
        error_code=top,
        members=[
            cls.MemberResponse(member_id=mid, group_instance_id=iid, error_code=err)
            for (mid, iid), err in zip(members, errors)
        ],
    )


# ------------------------------------------------------------------------- OffsetCommit
def _partition_exists(ctx: RequestContext, topic: str | None, partition: int) -> bool:
    t = find_topic(ctx.broker, topic)   # in a cluster another broker may lead it
    return t is not None and 0 <= partition < len(t.partitions)


def _name_of(ctx: RequestContext, topic_id: Any) -> str | None:
    """v10 addresses topics by id."""
    topic = find_topic_by_id(ctx.broker, topic_id)
    return topic.name if topic is not None else None


@handler(OFFSET_COMMIT)
async def offset_commit(ctx: RequestContext, req: Any) -> Any:
    """Unknown topics/partitions and oversized metadata are refused per partition; the group
    check (generation, member) applies to the rest, which are durable before we answer."""
    cls = response_class(OFFSET_COMMIT)
    tcls, pcls = cls.OffsetCommitResponseTopic, cls.OffsetCommitResponseTopic.OffsetCommitResponsePartition
    v = ctx.version
    coord = _coordinator(ctx)
    errors: dict[tuple[int, int], int] = {}  # (topic index, partition index in request) -> error
    valid: list[tuple[str, int, int, int, str | None]] = []
    valid_keys: list[tuple[int, int]] = []
    elsewhere = _elsewhere(ctx, req.group_id)
    for ti, t in enumerate(req.topics or []):
        name = _name_of(ctx, t.topic_id) if v >= 10 else t.name
        for pi, p in enumerate(t.partitions or []):
            if elsewhere:
                errors[(ti, pi)] = E.NOT_COORDINATOR
            elif name is None:
                errors[(ti, pi)] = E.UNKNOWN_TOPIC_ID
            elif not _partition_exists(ctx, name, p.partition_index):
                errors[(ti, pi)] = E.UNKNOWN_TOPIC_OR_PARTITION
            elif not coord.validate_metadata(p.committed_metadata):
                errors[(ti, pi)] = E.OFFSET_METADATA_TOO_LARGE
            else:
                epoch = p.committed_leader_epoch if v >= 6 else -1
                valid.append((name, p.partition_index, p.committed_offset, epoch, p.committed_metadata))
                valid_keys.append((ti, pi))
    generation = req.generation_id_or_member_epoch if v >= 1 else -1
    member_id = req.member_id if v >= 1 else ""
    instance_id = req.group_instance_id if v >= 7 else None
    if elsewhere:
        group_error = E.NOT_COORDINATOR
    elif valid or not errors:
        group_error = await coord.commit_offsets(req.group_id, generation, member_id or "", instance_id, valid)
    else:
        group_error = E.NONE
    for key in valid_keys:
        errors[key] = group_error
    return cls(
        throttle_time_ms=0,
        topics=[
            tcls(
                name=t.name, topic_id=t.topic_id,
                partitions=[pcls(partition_index=p.partition_index, error_code=errors[(ti, pi)])
                            for pi, p in enumerate(t.partitions or [])],
            )
            for ti, t in enumerate(req.topics or [])
        ],
    )


# ------------------------------------------------------------------------- OffsetFetch
async def _unstable(ctx: RequestContext, group_id: str, require_stable: bool
                    ) -> set[tuple[str, int]]:
    """Partitions of ``group_id`` with offsets pending in an unfinished transaction (any
    broker's: in a cluster the transaction's coordinator may be another broker)."""
    txn_coord = coordinator_for(ctx.broker) if require_stable else None
    if txn_coord is None:
        return set()
    return await txn_coord.pending_offsets_anywhere(group_id)


def _fetch_group(
    ctx: RequestContext, group_id: str, req_topics: Iterable[Any] | None, use_ids: bool,
    unstable: set[tuple[str, int]] | None = None,
) -> list[tuple[str, Any, list[tuple[int, int, int, str, int]]]]:
    """[(topic name, topic id, [(partition, offset, leader epoch, metadata, error)])].
    ``unstable`` (KIP-447 require_stable, see ``_unstable``): those partitions answer
    UNSTABLE_OFFSET_COMMIT (retriable) until their transaction ends."""
    coord = _coordinator(ctx)
    unstable = unstable or set()
    if req_topics is None:
        wanted = None
    else:
        wanted, order = [], []
        for t in req_topics:
            name = (_name_of(ctx, t.topic_id) or "") if use_ids else t.name
            order.append(name)
            wanted.extend((name, p) for p in (t.partition_indexes or []))
    rows = coord.fetch_offsets(group_id, wanted)
    out: dict[str, list[tuple[int, int, int, str, int]]] = {}
    for topic, partition, c in rows:
        if (topic, partition) in unstable:
            out.setdefault(topic, []).append((partition, -1, -1, "", E.UNSTABLE_OFFSET_COMMIT))
        elif c is None:
            out.setdefault(topic, []).append((partition, -1, -1, "", E.NONE))
        else:
            out.setdefault(topic, []).append((partition, c.offset, c.leader_epoch, c.metadata or "", E.NONE))
    if wanted is not None:
        for name in order:  # topics asked for with no partitions still get an entry
            out.setdefault(name, [])
    return [(name, getattr(find_topic(ctx.broker, name), "topic_id", None), parts) for name, parts in out.items()]


async def _fresh_offsets(ctx: RequestContext, group_id: str) -> None:
    """In a cluster of several brokers, read the group's offsets from the metadata store: a
    previous coordinator may have acknowledged a commit after this one loaded the group."""
    cluster = getattr(ctx.broker, "cluster", None)
    if cluster is not None and len(cluster.live) > 1:
        await _coordinator(ctx).refresh_offsets(group_id)


async def _readable(ctx: RequestContext, group_id: str, require_stable: bool
                    ) -> tuple[int, set[tuple[str, int]]]:
    """(error, unstable partitions) before an OffsetFetch of ``group_id`` is answered: the
    store reads of ``_fresh_offsets`` and ``_unstable``. While the metadata store is out of
    reach the group's offsets are not known yet: COORDINATOR_LOAD_IN_PROGRESS, Kafka's answer
    while a coordinator loads a group's offsets - every client retries it in place until the
    store is back. Not COORDINATOR_NOT_AVAILABLE: librdkafka does not retry an OffsetFetch
    that answers it (it only looks the coordinator up again) and leaves the partitions it
    asked about unfetched until the next rebalance, so a group assigned during an outage
    reads nothing for good (session 23's chaos run, docs/FINDINGS.md;
    tests/cluster/test_group_offsets_outage.py)."""
    try:
        await _fresh_offsets(ctx, group_id)
        return E.NONE, await _unstable(ctx, group_id, require_stable)
    except Exception as exc:
        if not is_store_outage(exc):
            raise
        note_unreachable(f"offsets of group {group_id} not read: {exc}")
        return E.COORDINATOR_LOAD_IN_PROGRESS, set()


@handler(OFFSET_FETCH)
async def offset_fetch(ctx: RequestContext, req: Any) -> Any:
    """All partitions when topics is null (v2+); v8+ batches groups. require_stable (v7+)
    answers UNSTABLE_OFFSET_COMMIT for offsets pending in an open transaction."""
    cls = response_class(OFFSET_FETCH)
    v = ctx.version
    if v < 8:
        tcls = cls.OffsetFetchResponseTopic
        pcls = tcls.OffsetFetchResponsePartition
        if _elsewhere(ctx, req.group_id):
            return cls(throttle_time_ms=0, error_code=E.NOT_COORDINATOR, topics=[])
        error, unstable = await _readable(
            ctx, req.group_id, v >= 7 and bool(getattr(req, "require_stable", False)))
        if error != E.NONE:
            # v0-1 have no top-level error: each partition asked for carries it
            return cls(throttle_time_ms=0, error_code=error, topics=[] if v >= 2 else [
                tcls(name=t.name, partitions=[
                    pcls(partition_index=p, committed_offset=-1, committed_leader_epoch=-1,
                         metadata="", error_code=error) for p in (t.partition_indexes or [])])
                for t in (req.topics or [])])
        result = _fetch_group(ctx, req.group_id, req.topics, use_ids=False, unstable=unstable)
        return cls(
            throttle_time_ms=0,
            error_code=E.NONE,
            topics=[
                tcls(name=name, partitions=[
                    pcls(partition_index=p, committed_offset=o, committed_leader_epoch=ep, metadata=md, error_code=err)
                    for p, o, ep, md, err in parts
                ])
                for name, _, parts in result
            ],
        )
    gcls = cls.OffsetFetchResponseGroup
    tcls = gcls.OffsetFetchResponseTopics
    pcls = tcls.OffsetFetchResponsePartitions
    groups = []
    for g in req.groups or []:
        if _elsewhere(ctx, g.group_id):
            groups.append(gcls(group_id=g.group_id, error_code=E.NOT_COORDINATOR, topics=[]))
            continue
        error, unstable = await _readable(ctx, g.group_id,
                                          bool(getattr(req, "require_stable", False)))
        if error != E.NONE:
            groups.append(gcls(group_id=g.group_id, error_code=error, topics=[]))
            continue
        result = _fetch_group(ctx, g.group_id, g.topics, use_ids=v >= 10, unstable=unstable)
        groups.append(gcls(
            group_id=g.group_id,
            error_code=E.NONE,
            topics=[
                tcls(name=name, topic_id=tid, partitions=[
                    pcls(partition_index=p, committed_offset=o, committed_leader_epoch=ep, metadata=md, error_code=err)
                    for p, o, ep, md, err in parts
                ])
                for name, tid, parts in result
            ],
        ))
    return cls(throttle_time_ms=0, groups=groups)


# ------------------------------------------------------------------------- admin
@handler(DESCRIBE_GROUPS)
async def describe_groups(ctx: RequestContext, req: Any) -> Any:
    """Unknown groups are reported as Dead (v0-5) or GROUP_ID_NOT_FOUND (v6+), as Kafka does."""
    cls = response_class(DESCRIBE_GROUPS)
    gcls, mcls = cls.DescribedGroup, cls.DescribedGroup.DescribedGroupMember
    coord = _coordinator(ctx)
    ops = ops_if(ctx.version >= 3 and getattr(req, "include_authorized_operations", False),
                 GROUP_OPS)
    out = []
    for gid in req.groups or []:
        if _elsewhere(ctx, gid):
            out.append(gcls(
                error_code=E.NOT_COORDINATOR, error_message=None, group_id=gid, group_state="",
                protocol_type="", protocol_data="", members=[], authorized_operations=ops))
            continue
        s = coord.describe_group(gid)
        if s is None:
            missing_error = E.GROUP_ID_NOT_FOUND if ctx.version >= 6 else E.NONE
            out.append(gcls(
                error_code=missing_error,
                error_message=f"group {gid} not found" if missing_error else None,
                group_id=gid, group_state="Dead", protocol_type="", protocol_data="", members=[],
                authorized_operations=ops,
            ))
            continue
        out.append(gcls(
            error_code=E.NONE, error_message=None, group_id=gid, group_state=s.state,
            protocol_type=s.protocol_type, protocol_data=s.protocol_data,
            members=[
                mcls(member_id=m.member_id, group_instance_id=m.instance_id, client_id=m.client_id,
                     client_host=m.client_host, member_metadata=m.metadata, member_assignment=m.assignment)
                for m in s.members
            ],
            authorized_operations=ops,
        ))
    return cls(throttle_time_ms=0, groups=out)


@handler(LIST_GROUPS)
async def list_groups(ctx: RequestContext, req: Any) -> Any:
    """States filter (v4+) and types filter (v5+) match case-insensitively; all groups are classic."""
    cls = response_class(LIST_GROUPS)
    states = {s.lower() for s in (req.states_filter or [])} if ctx.version >= 4 else set()
    types = {t.lower() for t in (req.types_filter or [])} if ctx.version >= 5 else set()
    groups = []
    if not types or "classic" in types:
        for gid, ptype, state in _coordinator(ctx).list_groups():
            if states and state.lower() not in states:
                continue
            groups.append(cls.ListedGroup(group_id=gid, protocol_type=ptype, group_state=state, group_type="classic"))
    return cls(throttle_time_ms=0, error_code=E.NONE, groups=groups)


@handler(DELETE_GROUPS)
async def delete_groups(ctx: RequestContext, req: Any) -> Any:
    cls = response_class(DELETE_GROUPS)
    names = list(req.groups_names or [])
    here = [g for g in names if not _elsewhere(ctx, g)]
    result = await _coordinator(ctx).delete_groups(here)
    for g in names:
        result.setdefault(g, E.NOT_COORDINATOR)
    return cls(
        throttle_time_ms=0,
        results=[cls.DeletableGroupResult(group_id=g, error_code=result[g]) for g in names],
    )


@handler(OFFSET_DELETE)
async def offset_delete(ctx: RequestContext, req: Any) -> Any:
    """Refused per partition (GROUP_SUBSCRIBED_TO_TOPIC) while members consume the topic."""
    cls = response_class(OFFSET_DELETE)
    tcls, pcls = cls.OffsetDeleteResponseTopic, cls.OffsetDeleteResponseTopic.OffsetDeleteResponsePartition
    wanted = [(t.name, p.partition_index) for t in (req.topics or []) for p in (t.partitions or [])]
    known = [tp for tp in wanted if _partition_exists(ctx, *tp)]
    if _elsewhere(ctx, req.group_id):
        return cls(error_code=E.NOT_COORDINATOR, throttle_time_ms=0, topics=[])
    top, per = await _coordinator(ctx).delete_offsets(req.group_id, known)
    return cls(
        error_code=top,
        throttle_time_ms=0,
        topics=[
            tcls(name=t.name, partitions=[
                pcls(partition_index=p.partition_index,
                     error_code=per.get((t.name, p.partition_index), E.UNKNOWN_TOPIC_OR_PARTITION)
                     if top == E.NONE else top)
                for p in (t.partitions or [])
            ])
            for t in (req.topics or [])
        ],
    )
