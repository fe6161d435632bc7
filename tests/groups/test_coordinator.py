"""Drives the GroupCoordinator state machine directly (real SQLite file, real event loop timers)."""
from __future__ import annotations

import asyncio
import struct

import pytest

from broker.groups import GroupCoordinator
from protocol import ErrorCode as E
from broker.groups.group import parse_subscription


def subscription(*topics: str) -> bytes:
    """ConsumerProtocolSubscription v0 bytes."""
    out = struct.pack(">hi", 0, len(topics))
    for t in topics:
        out += struct.pack(">h", len(t)) + t.encode()
    return out + struct.pack(">i", -1)


PROTOS = [("range", subscription("t1")), ("roundrobin", subscription("t1"))]


@pytest.fixture
async def coord(tmp_path):
    c = GroupCoordinator(str(tmp_path / "meta.db"), 0, "127.0.0.1", 9092, min_session_timeout_ms=10)
    await c.start()
    yield c
    await c.close()


@pytest.fixture
async def store_coord(metadata_url):
    """A coordinator on a fresh metadata database: SQLite and PostgreSQL."""
    c = GroupCoordinator(metadata_url, 0, "127.0.0.1", 9092, min_session_timeout_ms=10)
    await c.start()
    yield c
    await c.close()


async def join(c, group="g", member="", instance=None, session=10_000, rebalance=10_000, protos=PROTOS,
               v4=False, ptype="consumer", client="cli"):
    return await c.join_group(group, member, instance, client, "/127.0.0.1", session, rebalance, ptype, protos, v4)


async def eventually(pred, timeout=20.0):
    """Wait for a condition driven by the coordinator's own timers (not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


async def test_single_member_join_sync_heartbeat(coord):
    r = await join(coord)
    assert r.error == E.NONE and r.generation_id == 1 and r.leader_id == r.member_id
    assert r.protocol_name == "range" and [m[0] for m in r.members] == [r.member_id]
    s = await coord.sync_group("g", 1, r.member_id, None, "consumer", "range", {r.member_id: b"A"})
    assert s.error == E.NONE and s.assignment == b"A"
    assert coord.heartbeat("g", 1, r.member_id, None) == E.NONE
    assert coord.heartbeat("g", 0, r.member_id, None) == E.ILLEGAL_GENERATION
    assert coord.heartbeat("g", 1, "nobody", None) == E.UNKNOWN_MEMBER_ID
    assert coord.heartbeat("nogroup", 1, "x", None) == E.UNKNOWN_MEMBER_ID
    assert coord.describe_group("g").state == "Stable"


async def test_member_id_required_v4(coord):
    r = await join(coord, v4=True)
    assert r.error == E.MEMBER_ID_REQUIRED and r.member_id
    r2 = await join(coord, member=r.member_id, v4=True)
    assert r2.error == E.NONE and r2.member_id == r.member_id
    bogus = await join(coord, member="not-issued", v4=True)
    assert bogus.error == E.UNKNOWN_MEMBER_ID


async def test_rebalance_with_three_members_and_leave(coord):
    a = await join(coord)
    await coord.sync_group("g", a.generation_id, a.member_id, None, None, None, {a.member_id: b"a"})
    # Two newcomers: the group rebalances; the existing member learns it from its heartbeat.
    tb = asyncio.create_task(join(coord, client="b"))
    tc = asyncio.create_task(join(coord, client="c"))
    await eventually(lambda: coord.describe_group("g").state == "PreparingRebalance")
    assert coord.heartbeat("g", a.generation_id, a.member_id, None) == E.REBALANCE_IN_PROGRESS
    a2 = await join(coord, member=a.member_id)
    b, c = await tb, await tc
    assert {a2.generation_id, b.generation_id, c.generation_id} == {2}
    leader = [r for r in (a2, b, c) if r.member_id == r.leader_id]
    assert len(leader) == 1 and len(leader[0].members) == 3
    assert all(not r.members for r in (a2, b, c) if r is not leader[0])
    assign = {r.member_id: r.member_id.encode() for r in (a2, b, c)}
    syncs = await asyncio.gather(*[
        coord.sync_group("g", 2, r.member_id, None, "consumer", "range", assign if r is leader[0] else {})
        for r in (a2, b, c)
    ])
    assert [s.assignment for s in syncs] == [a2.member_id.encode(), b.member_id.encode(), c.member_id.encode()]
    # One leaves: the others must rejoin into generation 3.
    top, errs = coord.leave_group("g", [(c.member_id, None)])
    assert (top, errs) == (E.NONE, [E.NONE])
    assert coord.heartbeat("g", 2, a.member_id, None) == E.REBALANCE_IN_PROGRESS
    r1, r2 = await asyncio.gather(join(coord, member=a.member_id), join(coord, member=b.member_id))
    assert r1.generation_id == r2.generation_id == 3
    assert len(coord.describe_group("g").members) == 2


async def test_rebalance_timeout_drops_members_that_do_not_rejoin(coord):
    a = await join(coord, rebalance=200)
    await coord.sync_group("g", 1, a.member_id, None, None, None, {})
    b = await asyncio.wait_for(join(coord, client="b", rebalance=200), 30)  # a never rejoins
    assert b.error == E.NONE and b.generation_id == 2 and [m[0] for m in b.members] == [b.member_id]
    assert coord.heartbeat("g", 1, a.member_id, None) == E.UNKNOWN_MEMBER_ID


async def test_session_timeout_expires_member(coord):
    a = await join(coord, session=100)
    await coord.sync_group("g", 1, a.member_id, None, None, None, {})
    await eventually(lambda: coord.describe_group("g").state == "Empty")
    assert coord.heartbeat("g", 1, a.member_id, None) == E.UNKNOWN_MEMBER_ID


async def test_inconsistent_protocols_and_bad_session(coord):
    await join(coord)
    r = await join(coord, protos=[("other", b"")])
    assert r.error == E.INCONSISTENT_GROUP_PROTOCOL
    r = await join(coord, ptype="connect")
    assert r.error == E.INCONSISTENT_GROUP_PROTOCOL
    assert (await join(coord, session=1)).error == E.INVALID_SESSION_TIMEOUT
    assert (await join(coord, group="")).error == E.INVALID_GROUP_ID


async def test_protocol_selection_common_to_all(coord):
    a = await join(coord, protos=[("range", b""), ("sticky", b"")])
    tb = asyncio.create_task(join(coord, protos=[("sticky", b""), ("range", b"")], client="b"))
    tc = asyncio.create_task(join(coord, protos=[("sticky", b"")], client="c"))
    await eventually(lambda: coord.describe_group("g").state == "PreparingRebalance"
                     and len(coord.describe_group("g").members) == 3)
    a2 = await join(coord, member=a.member_id, protos=[("range", b""), ("sticky", b"")])
    await tb, await tc
    assert a2.protocol_name == "sticky"


async def test_sync_checks(coord):
    a = await join(coord)
    s = await coord.sync_group("g", 1, a.member_id, None, "consumer", "roundrobin", {})
    assert s.error == E.INCONSISTENT_GROUP_PROTOCOL
    assert (await coord.sync_group("g", 7, a.member_id, None, None, None, {})).error == E.ILLEGAL_GENERATION
    assert (await coord.sync_group("g", 1, "x", None, None, None, {})).error == E.UNKNOWN_MEMBER_ID
    assert (await coord.sync_group("g", 1, a.member_id, None, None, None, {})).error == E.NONE


async def test_follower_sync_waits_for_leader(coord):
    a = await join(coord)
    await coord.sync_group("g", 1, a.member_id, None, None, None, {})
    tb = asyncio.create_task(join(coord, client="b"))
    await eventually(lambda: coord.describe_group("g").state == "PreparingRebalance")
    a2 = await join(coord, member=a.member_id)
    b = await tb
    follower = b if a2.leader_id == a2.member_id else a2
    leader = a2 if follower is b else b
    fsync = asyncio.create_task(coord.sync_group("g", 2, follower.member_id, None, None, None, {}))
    await asyncio.sleep(0)
    assert not fsync.done()
    lsync = await coord.sync_group("g", 2, leader.member_id, None, None, None, {follower.member_id: b"F"})
    assert lsync.error == E.NONE and (await fsync).assignment == b"F"


async def test_static_membership_replaces_without_rebalance(coord):
    a = await join(coord, instance="i-1", v4=True)
    assert a.error == E.NONE  # static members need no second round trip
    b = await asyncio.gather(join(coord, instance="i-2", client="b"), join(coord, member=a.member_id, instance="i-1"))
    gen = b[0].generation_id
    leader = next(r for r in b if r.leader_id == r.member_id)
    assign = {r.member_id: b"x" for r in b}
    await asyncio.gather(*[coord.sync_group("g", gen, r.member_id, r2, None, None, assign if r is leader else {})
                           for r, r2 in zip(b, ["i-2", "i-1"])])
    assert coord.describe_group("g").state == "Stable"
    # i-2 restarts and rejoins with no member id: replaced in place, no rebalance.
    b2 = await join(coord, instance="i-2", client="b")
    assert b2.error == E.NONE and b2.generation_id == gen and b2.member_id != b[0].member_id
    assert coord.describe_group("g").state == "Stable"
    s = await coord.sync_group("g", gen, b2.member_id, "i-2", None, None, {})
    assert s.assignment == b"x"
    # the old incarnation is fenced everywhere
    assert coord.heartbeat("g", gen, b[0].member_id, "i-2") == E.FENCED_INSTANCE_ID
    assert (await join(coord, member=b[0].member_id, instance="i-2")).error == E.FENCED_INSTANCE_ID
    assert await coord.commit_offsets("g", gen, b[0].member_id, "i-2", [("t1", 0, 1, -1, "")]) == E.FENCED_INSTANCE_ID
    top, errs = coord.leave_group("g", [("", "i-2"), ("", "i-9"), (b[0].member_id, "i-1")])
    assert errs == [E.NONE, E.UNKNOWN_MEMBER_ID, E.FENCED_INSTANCE_ID]


async def test_offsets_simple_consumer_and_members(store_coord):
    coord = store_coord
    # Assign-based consumers: no members, generation -1.
    assert await coord.commit_offsets("simple", -1, "", None, [("t1", 0, 42, -1, "meta")]) == E.NONE
    [(t, p, c)] = coord.fetch_offsets("simple", [("t1", 0)])
    assert (c.offset, c.metadata) == (42, "meta")
    assert coord.fetch_offsets("simple", [("t1", 1)])[0][2] is None
    assert await coord.commit_offsets("nogroup", 3, "m", None, [("t1", 0, 1, -1, "")]) == E.ILLEGAL_GENERATION
    a = await join(coord)
    assert await coord.commit_offsets("g", -1, "", None, [("t1", 0, 1, -1, "")]) == E.REBALANCE_IN_PROGRESS
    await coord.sync_group("g", 1, a.member_id, None, None, None, {})
    assert await coord.commit_offsets("g", 1, "x", None, [("t1", 0, 1, -1, "")]) == E.UNKNOWN_MEMBER_ID
    assert await coord.commit_offsets("g", 0, a.member_id, None, [("t1", 0, 1, -1, "")]) == E.ILLEGAL_GENERATION
    assert await coord.commit_offsets("g", 1, a.member_id, None, [("t1", 0, 7, 3, None)]) == E.NONE
    assert [(t, p, c.offset, c.leader_epoch) for t, p, c in coord.fetch_offsets("g", None)] == [("t1", 0, 7, 3)]


async def test_offsets_and_groups_survive_restart(metadata_url):
    url = metadata_url
    if url.startswith("sqlite:///"):
        url = url[len("sqlite:///"):]                 # a bare path works as well as the URL
    c = GroupCoordinator(url, min_session_timeout_ms=10)
    await c.start()
    a = await join(c, session=60_000)
    await c.sync_group("g", 1, a.member_id, None, None, None, {a.member_id: b"as"})
    assert await c.commit_offsets("g", 1, a.member_id, None, [("t1", 0, 5, -1, "m"), ("t1", 1, 6, -1, "")]) == E.NONE
    assert await c.commit_offsets("s", -1, "", None, [("t2", 0, 9, -1, "")]) == E.NONE
    await c.close()
    c2 = GroupCoordinator(metadata_url, min_session_timeout_ms=10)
    await c2.start()
    try:
        assert [(t, p, o.offset) for t, p, o in c2.fetch_offsets("g", None)] == [("t1", 0, 5), ("t1", 1, 6)]
        assert c2.fetch_offsets("s", [("t2", 0)])[0][2].offset == 9
        # the member resumes its generation without rejoining
        assert c2.heartbeat("g", 1, a.member_id, None) == E.NONE
        s = await c2.sync_group("g", 1, a.member_id, None, None, None, {})
        assert s.assignment == b"as"
        assert {g for g, _, _ in c2.list_groups()} == {"g", "s"}
    finally:
        await c2.close()


async def test_delete_groups_and_offsets(store_coord):
    coord = store_coord
    await coord.commit_offsets("s", -1, "", None, [("t1", 0, 1, -1, ""), ("t2", 0, 1, -1, "")])
    a = await join(coord, protos=[("range", subscription("t1"))])
    await coord.sync_group("g", 1, a.member_id, None, None, None, {})
    await coord.commit_offsets("g", 1, a.member_id, None, [("t1", 0, 1, -1, ""), ("t2", 0, 2, -1, "")])
    res = await coord.delete_groups(["s", "g", "missing"])
    assert res == {"s": E.NONE, "g": E.NON_EMPTY_GROUP, "missing": E.GROUP_ID_NOT_FOUND}
    assert coord.fetch_offsets("s", None) == []
    top, parts = await coord.delete_offsets("g", [("t1", 0), ("t2", 0)])
    assert top == E.NONE and parts == {("t1", 0): E.GROUP_SUBSCRIBED_TO_TOPIC, ("t2", 0): E.NONE}
    assert [t for t, _, _ in coord.fetch_offsets("g", None)] == ["t1"]
    assert (await coord.delete_offsets("missing", [("t1", 0)]))[0] == E.GROUP_ID_NOT_FOUND


async def test_deleted_topic_takes_its_offsets(tmp_path):
    """As in Kafka: a deleted topic's committed offsets go from every group (also after a
    restart), and a group that only held offsets of it is gone; other offsets stay."""
    db = str(tmp_path / "meta.db")
    c = GroupCoordinator(db, 0, "127.0.0.1", 9092, min_session_timeout_ms=10)
    await c.start()
    a = await join(c, protos=[("range", subscription("t1"))])
    await c.sync_group("g", 1, a.member_id, None, None, None, {})
    await c.commit_offsets("g", 1, a.member_id, None, [("t1", 0, 4, -1, ""), ("t2", 0, 2, -1, "")])
    await c.commit_offsets("only-t1", -1, "", None, [("t1", 0, 1, -1, ""), ("t1", 1, 3, -1, "")])
    await c.on_topic_deleted("t1")
    assert [(t, p, o.offset) for t, p, o in c.fetch_offsets("g", None)] == [("t2", 0, 2)]
    assert c.fetch_offsets("only-t1", None) == []
    assert {g for g, _, _ in c.list_groups()} == {"g"}
    await c.on_topic_deleted("never-committed")
    await c.close()
    c = GroupCoordinator(db, 0, "127.0.0.1", 9092, min_session_timeout_ms=10)
    await c.start()
    try:
        assert [(t, p, o.offset) for t, p, o in c.fetch_offsets("g", None)] == [("t2", 0, 2)]
        assert "only-t1" not in {g for g, _, _ in c.list_groups()}
    finally:
        await c.close()


def test_parse_subscription_tolerates_garbage():
    assert parse_subscription(subscription("a", "b")) == {"a", "b"}
    assert parse_subscription(b"\x00") is None
    assert parse_subscription(b"\x00\x00\x00\x00\x00\x05\x00\x10ab") is None


def test_sqlite_url_forms():
    from broker.groups.store import sqlite_path

    assert sqlite_path("sqlite:///./data/meta.db") == "./data/meta.db"
    assert sqlite_path("sqlite:////abs/meta.db") == "/abs/meta.db"
    assert sqlite_path("/abs/meta.db") == "/abs/meta.db"
    with pytest.raises(ValueError):
        sqlite_path("postgresql://u@h/db")


async def test_group_emptied_just_before_close_restarts_empty(metadata_url):
    """The Empty state written in the background is flushed by close(): no ghost members."""
    db = metadata_url
    c = GroupCoordinator(db, min_session_timeout_ms=10)
    await c.start()
    a = await join(c, session=60_000)
    await c.sync_group("g", 1, a.member_id, None, None, None, {})
    c.leave_group("g", [(a.member_id, None)])
    await c.close()
    c2 = GroupCoordinator(db, min_session_timeout_ms=10)
    await c2.start()
    try:
        s = c2.describe_group("g")
        assert s.state == "Empty" and s.members == []
    finally:
        await c2.close()


async def test_initial_rebalance_delay_gathers_first_members(tmp_path):
    """group.initial.rebalance.delay.ms: members arriving during the delay share generation 1."""
    c = GroupCoordinator(str(tmp_path / "m.db"), min_session_timeout_ms=10, initial_rebalance_delay_ms=300)
    await c.start()
    try:
        a, b = await asyncio.gather(join(c), join(c, client="b"))
        assert a.generation_id == b.generation_id == 1
        leader = a if a.leader_id == a.member_id else b
        assert len(leader.members) == 2
    finally:
        await c.close()
