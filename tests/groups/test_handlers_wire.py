"""Group API handlers over the real codec: every advertised version is encoded by kafka-python's
client-side classes, parsed by ``protocol.parse_request``, handled, encoded by
``protocol.encode_response`` and decoded again as a client would."""
from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

import broker.handlers.groups  # noqa: F401  (registers the handlers)
from broker.groups import GroupCoordinator
from broker.handlers.registry import HANDLERS, RequestContext
from protocol import SUPPORTED_APIS, ErrorCode as E, encode_response, parse_request, request_class, response_class

from .test_coordinator import subscription

TOPIC_ID = uuid.uuid4()


@pytest.fixture
async def env(tmp_path):
    coord = GroupCoordinator(str(tmp_path / "meta.db"), 0, "127.0.0.1", 9092, min_session_timeout_ms=10)
    await coord.start()
    broker = SimpleNamespace(
        config=SimpleNamespace(node_id=3, advertised_host="kafka.example", advertised_port=19092),
        topics={"t1": SimpleNamespace(name="t1", topic_id=TOPIC_ID, partitions=[object(), object()])},
        groups=coord,
    )
    yield broker
    await coord.close()


def versions(key: int) -> list[int]:
    lo, hi = SUPPORTED_APIS[key]
    return list(range(lo, hi + 1))


async def call(broker: Any, api_key: int, version: int, **fields: Any) -> Any:
    key = api_key
    req = request_class(key)(**fields)
    req.with_header(correlation_id=11, client_id="wire-test")
    frame = req.encode(version=version, header=True)
    header, parsed = parse_request(frame)
    ctx = RequestContext(broker=broker, header=header, conn=SimpleNamespace(peer="10.1.2.3:4242"))
    resp = await HANDLERS[key](ctx, parsed)
    out = encode_response(header, resp)
    decoded = response_class(key).decode(out, version=version, header=True, framed=True)
    assert decoded.header.correlation_id == 11
    return decoded


@pytest.mark.parametrize("v", versions(10))
async def test_find_coordinator(env, v):
    if v >= 4:
        r = await call(env, 10, v, key_type=0, coordinator_keys=["g1", "g2"])
        assert [(c.key, c.node_id, c.host, c.port, c.error_code) for c in r.coordinators] == [
            ("g1", 3, "kafka.example", 19092, 0), ("g2", 3, "kafka.example", 19092, 0)]
        r = await call(env, 10, v, key_type=2, coordinator_keys=["s"])
        assert r.coordinators[0].error_code == E.INVALID_REQUEST
    else:
        kw = {"key_type": 1} if v >= 1 else {}
        r = await call(env, 10, v, key="g1", **kw)
        assert (r.error_code, r.node_id, r.host, r.port) == (0, 3, "kafka.example", 19092)


def proto(v: int, topics=("t1",)) -> list[Any]:
    P = request_class(11).JoinGroupRequestProtocol
    return [P(name="range", metadata=subscription(*topics))]


@pytest.mark.parametrize("v", versions(11))
async def test_join_sync_heartbeat_leave_cycle(env, v):
    sv, hv, lv = min(v, SUPPORTED_APIS[14][1]), min(v, SUPPORTED_APIS[12][1]), min(v, SUPPORTED_APIS[13][1])
    join = dict(group_id="g", session_timeout_ms=10_000, rebalance_timeout_ms=10_000, member_id="",
                protocol_type="consumer", protocols=proto(v))
    r = await call(env, 11, v, **join)
    if v >= 4:
        assert r.error_code == E.MEMBER_ID_REQUIRED and r.member_id
        join["member_id"] = r.member_id
        r = await call(env, 11, v, **join)
    assert r.error_code == 0 and r.generation_id == 1 and r.leader == r.member_id
    assert r.protocol_name == "range" and [m.member_id for m in r.members] == [r.member_id]
    assert r.members[0].metadata == subscription("t1")
    if v >= 7:
        assert r.protocol_type == "consumer"
    me = r.member_id
    A = request_class(14).SyncGroupRequestAssignment
    extra = {"protocol_type": "consumer", "protocol_name": "range"} if sv >= 5 else {}
    s = await call(env, 14, sv, group_id="g", generation_id=1, member_id=me,
                   assignments=[A(member_id=me, assignment=b"\x00\x01")], **extra)
    assert s.error_code == 0 and s.assignment == b"\x00\x01"
    h = await call(env, 12, hv, group_id="g", generation_id=1, member_id=me)
    assert h.error_code == 0
    h = await call(env, 12, hv, group_id="g", generation_id=9, member_id=me)
    assert h.error_code == E.ILLEGAL_GENERATION
    d = await call(env, 15, SUPPORTED_APIS[15][1], groups=["g"])
    g = d.groups[0]
    assert (g.group_state, g.protocol_type, g.protocol_data) == ("Stable", "consumer", "range")
    assert [(m.member_id, m.client_id, m.client_host, m.member_assignment) for m in g.members] == [
        (me, "wire-test", "/10.1.2.3", b"\x00\x01")]
    if lv >= 3:
        M = request_class(13).MemberIdentity
        lr = await call(env, 13, lv, group_id="g", members=[M(member_id=me), M(member_id="ghost")])
        assert lr.error_code == 0 and [m.error_code for m in lr.members] == [0, E.UNKNOWN_MEMBER_ID]
    else:
        lr = await call(env, 13, lv, group_id="g", member_id=me)
        assert lr.error_code == 0
    h = await call(env, 12, hv, group_id="g", generation_id=1, member_id=me)
    assert h.error_code == E.UNKNOWN_MEMBER_ID
    d = await call(env, 15, 0, groups=["g"])
    assert d.groups[0].group_state == "Empty"


@pytest.mark.parametrize("v", [v for v in versions(11) if v >= 5])
async def test_static_member_fenced_over_wire(env, v):
    join = dict(group_id="g", session_timeout_ms=10_000, rebalance_timeout_ms=10_000, member_id="",
                group_instance_id="inst-1", protocol_type="consumer", protocols=proto(v))
    first = await call(env, 11, v, **join)
    assert first.error_code == 0
    await call(env, 14, 3, group_id="g", generation_id=1, member_id=first.member_id, group_instance_id="inst-1",
               assignments=[])
    second = await call(env, 11, v, **join)  # restart of the same instance: replaced, no rebalance
    assert second.error_code == 0 and second.generation_id == 1 and second.member_id != first.member_id
    h = await call(env, 12, 3, group_id="g", generation_id=1, member_id=first.member_id, group_instance_id="inst-1")
    assert h.error_code == E.FENCED_INSTANCE_ID
    h = await call(env, 12, 3, group_id="g", generation_id=1, member_id=second.member_id, group_instance_id="inst-1")
    assert h.error_code == 0


def commit_req(v: int, offsets: dict[tuple[str, int], int], **kw: Any) -> dict[str, Any]:
    T = request_class(8).OffsetCommitRequestTopic
    P = T.OffsetCommitRequestPartition
    by_topic: dict[str, list[Any]] = {}
    for (t, p), o in offsets.items():
        by_topic.setdefault(t, []).append(P(partition_index=p, committed_offset=o, committed_metadata=f"m{o}"))
    return dict(group_id=kw.pop("group_id", "simple"), topics=[T(name=t, partitions=ps) for t, ps in by_topic.items()],
                **kw)


@pytest.mark.parametrize("v", versions(8))
async def test_offset_commit_simple_consumer_all_versions(env, v):
    kw = {"generation_id_or_member_epoch": -1, "member_id": ""} if v >= 1 else {}
    r = await call(env, 8, v, **commit_req(v, {("t1", 0): 10 + v, ("t1", 1): 20, ("t1", 7): 1, ("nope", 0): 1}, **kw))
    errs = {(t.name, p.partition_index): p.error_code for t in r.topics for p in t.partitions}
    assert errs == {("t1", 0): 0, ("t1", 1): 0, ("t1", 7): E.UNKNOWN_TOPIC_OR_PARTITION,
                    ("nope", 0): E.UNKNOWN_TOPIC_OR_PARTITION}
    # a commit from a stale generation of a group nobody joined is refused
    if v >= 1:
        r = await call(env, 8, v, **commit_req(v, {("t1", 0): 99}, group_id="other",
                                                generation_id_or_member_epoch=5, member_id="m"))
        assert r.topics[0].partitions[0].error_code == E.ILLEGAL_GENERATION
    too_big = commit_req(v, {("t1", 0): 5}, **kw)
    too_big["topics"][0].partitions[0].committed_metadata = "x" * 5000
    r = await call(env, 8, v, **too_big)
    assert r.topics[0].partitions[0].error_code == E.OFFSET_METADATA_TOO_LARGE


@pytest.mark.parametrize("v", versions(9))
async def test_offset_fetch_all_versions(env, v):
    await env.groups.commit_offsets("grp", -1, "", None, [("t1", 0, 5, 2, "meta"), ("t1", 1, 6, -1, None)])
    if v >= 8:
        G = request_class(9).OffsetFetchRequestGroup
        GT = G.OffsetFetchRequestTopics
        r = await call(env, 9, v, groups=[
            G(group_id="grp", topics=[GT(name="t1", partition_indexes=[0, 1])]),
            G(group_id="grp", topics=None),
            G(group_id="unknown", topics=[GT(name="t1", partition_indexes=[0])]),
        ], require_stable=True)
        got = [[(t.name, p.partition_index, p.committed_offset, p.metadata) for t in g.topics for p in t.partitions]
               for g in r.groups]
        assert got[0] == got[1] == [("t1", 0, 5, "meta"), ("t1", 1, 6, "")]
        assert got[2] == [("t1", 0, -1, "")]
        assert r.groups[0].topics[0].partitions[0].committed_leader_epoch == 2
        return
    T = request_class(9).OffsetFetchRequestTopic
    r = await call(env, 9, v, group_id="grp", topics=[T(name="t1", partition_indexes=[0, 1, 5])],
                   **({"require_stable": True} if v >= 7 else {}))
    got = [(t.name, p.partition_index, p.committed_offset, p.metadata, p.error_code) for t in r.topics for p in t.partitions]
    assert got == [("t1", 0, 5, "meta", 0), ("t1", 1, 6, "", 0), ("t1", 5, -1, "", 0)]
    if v >= 2:
        r = await call(env, 9, v, group_id="grp", topics=None)
        assert [(p.partition_index, p.committed_offset) for t in r.topics for p in t.partitions] == [(0, 5), (1, 6)]


@pytest.mark.parametrize("v", versions(16))
async def test_list_groups_with_filters(env, v):
    await env.groups.commit_offsets("simple", -1, "", None, [("t1", 0, 1, -1, "")])
    await call(env, 11, 3, group_id="active", session_timeout_ms=10_000, rebalance_timeout_ms=10_000,
               member_id="", protocol_type="consumer", protocols=proto(3))
    r = await call(env, 16, v, **({"states_filter": ["completingrebalance"]} if v >= 4 else {}))
    listed = {(g.group_id, g.protocol_type) for g in r.groups}
    if v >= 4:
        assert listed == {("active", "consumer")} and r.groups[0].group_state == "CompletingRebalance"
    else:
        assert listed == {("active", "consumer"), ("simple", "")}
    if v >= 5:
        r = await call(env, 16, v, types_filter=["consumer"])
        assert r.groups == []


@pytest.mark.parametrize("v", versions(42))
async def test_delete_groups(env, v):
    await env.groups.commit_offsets("simple", -1, "", None, [("t1", 0, 1, -1, "")])
    await call(env, 11, 3, group_id="active", session_timeout_ms=10_000, rebalance_timeout_ms=10_000,
               member_id="", protocol_type="consumer", protocols=proto(3))
    r = await call(env, 42, v, groups_names=["simple", "active", "missing"])
    assert [(x.group_id, x.error_code) for x in r.results] == [
        ("simple", 0), ("active", E.NON_EMPTY_GROUP), ("missing", E.GROUP_ID_NOT_FOUND)]
    d = await call(env, 15, 0, groups=["simple"])
    assert d.groups[0].group_state == "Dead"


@pytest.mark.parametrize("v", versions(47))
async def test_offset_delete(env, v):
    j = await call(env, 11, 3, group_id="g", session_timeout_ms=10_000, rebalance_timeout_ms=10_000,
                   member_id="", protocol_type="consumer", protocols=proto(3, topics=("t1",)))
    await env.groups.sync_group("g", 1, j.member_id, None, None, None, {})
    await env.groups.commit_offsets("g", 1, j.member_id, None, [("t1", 0, 1, -1, "")])
    T = request_class(47).OffsetDeleteRequestTopic
    P = T.OffsetDeleteRequestPartition
    r = await call(env, 47, v, group_id="g", topics=[T(name="t1", partitions=[P(partition_index=0)]),
                                                      T(name="zz", partitions=[P(partition_index=0)])])
    assert r.error_code == 0
    assert [p.error_code for t in r.topics for p in t.partitions] == [E.GROUP_SUBSCRIBED_TO_TOPIC,
                                                                      E.UNKNOWN_TOPIC_OR_PARTITION]
    r = await call(env, 47, v, group_id="missing", topics=[])
    assert r.error_code == E.GROUP_ID_NOT_FOUND


async def test_describe_unknown_group_v6_style(env):
    hi = SUPPORTED_APIS[15][1]
    r = await call(env, 15, hi, groups=["nope"])
    assert r.groups[0].group_state == "Dead"
    assert r.groups[0].error_code == (E.GROUP_ID_NOT_FOUND if hi >= 6 else 0)


async def test_join_waits_for_rebalance_over_wire(env):
    """Two members: the second join parks until the first rejoins; both land in generation 2."""
    base = dict(group_id="g", session_timeout_ms=10_000, rebalance_timeout_ms=10_000,
                protocol_type="consumer", protocols=proto(3))
    a = await call(env, 11, 3, member_id="", **base)
    await call(env, 14, 3, group_id="g", generation_id=1, member_id=a.member_id, assignments=[])
    tb = asyncio.create_task(call(env, 11, 3, member_id="", **base))
    for _ in range(1000):
        h = await call(env, 12, 3, group_id="g", generation_id=1, member_id=a.member_id)
        if h.error_code == E.REBALANCE_IN_PROGRESS:
            break
        await asyncio.sleep(0.005)
    assert h.error_code == E.REBALANCE_IN_PROGRESS
    a2 = await call(env, 11, 3, member_id=a.member_id, **base)
    b = await tb
    assert a2.generation_id == b.generation_id == 2 and a2.leader == b.leader


async def call_unadvertised(broker: Any, key: int, version: int, **fields: Any) -> Any:
    """For versions below the advertised range (ZooKeeper-era clients): codec round trip without
    the ApiVersions gate, so the handler is ready if the range is widened."""
    req = request_class(key)(**fields)
    parsed = request_class(key).decode(req.encode(version=version), version=version)
    header = SimpleNamespace(api_key=key, api_version=version, correlation_id=1, client_id="old")
    ctx = RequestContext(broker=broker, header=header, conn=SimpleNamespace())
    resp = await HANDLERS[key](ctx, parsed)
    return response_class(key).decode(resp.encode(version=version), version=version)


@pytest.mark.parametrize("v", [0, 1])
async def test_offset_commit_and_fetch_zookeeper_era_versions(env, v):
    kw = {"generation_id_or_member_epoch": -1, "member_id": ""} if v >= 1 else {}
    r = await call_unadvertised(env, 8, v, **commit_req(v, {("t1", 0): 33}, group_id="old-grp", **kw))
    assert r.topics[0].partitions[0].error_code == 0
    T = request_class(9).OffsetFetchRequestTopic
    f = await call_unadvertised(env, 9, 0, group_id="old-grp", topics=[T(name="t1", partition_indexes=[0])])
    assert [(p.committed_offset, p.metadata) for t in f.topics for p in t.partitions] == [(33, "m33")]


async def test_offset_commit_and_fetch_by_topic_id_v10(env):
    """v10 (topic ids) is not advertised yet; the handlers already map ids to names."""
    T = request_class(8).OffsetCommitRequestTopic
    P = T.OffsetCommitRequestPartition
    r = await call_unadvertised(env, 8, 10, group_id="ids", generation_id_or_member_epoch=-1, member_id="",
                                topics=[T(topic_id=TOPIC_ID, partitions=[P(partition_index=1, committed_offset=8)]),
                                        T(topic_id=uuid.uuid4(), partitions=[P(partition_index=0, committed_offset=1)])])
    assert [p.error_code for t in r.topics for p in t.partitions] == [0, E.UNKNOWN_TOPIC_ID]
    G = request_class(9).OffsetFetchRequestGroup
    GT = G.OffsetFetchRequestTopics
    f = await call_unadvertised(env, 9, 10, groups=[G(group_id="ids", topics=[GT(topic_id=TOPIC_ID, partition_indexes=[1])])])
    assert [(t.topic_id, p.committed_offset) for t in f.groups[0].topics for p in t.partitions] == [(TOPIC_ID, 8)]
