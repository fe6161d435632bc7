"""Random interleavings of group operations: the coordinator never raises and keeps its
invariants (leader is a member, static ids map to members, parked calls all get answers)."""
from __future__ import annotations

import asyncio
import random

import pytest

from broker.groups import GroupCoordinator, GroupState
from protocol import ErrorCode as E

from .test_coordinator import PROTOS


def check_invariants(c: GroupCoordinator) -> None:
    for g in c.groups.values():
        for iid, mid in g.static_members.items():
            assert g.members[mid].instance_id == iid
        if g.state in (GroupState.COMPLETING_REBALANCE, GroupState.STABLE):
            assert g.leader_id in g.members
        if g.state == GroupState.EMPTY:
            assert not g.members
        assert g.state != GroupState.DEAD


@pytest.mark.parametrize("seed", range(8))
async def test_random_operations(tmp_path, seed):
    rnd = random.Random(seed)
    c = GroupCoordinator(str(tmp_path / "m.db"), min_session_timeout_ms=1)
    await c.start()
    tasks: list[asyncio.Task] = []
    known: list[tuple[str, str | None]] = [("", None)]
    try:
        for _ in range(300):
            group = rnd.choice(["g1", "g2"])
            gen = rnd.choice([-1, 0, 1, 2, 3, 4])
            mid, iid = rnd.choice(known)
            if rnd.random() < 0.3:
                iid = rnd.choice([None, "i1", "i2"])
            op = rnd.randrange(7)
            if op == 0:
                protos = PROTOS if rnd.random() < 0.9 else [("other", b"")]

                async def do_join(group=group, mid=mid, iid=iid, protos=protos):
                    r = await c.join_group(group, mid, iid, "c", "h", rnd.choice([5, 50, 5000]),
                                           rnd.choice([5, 50, 5000]), "consumer", protos, rnd.random() < 0.5)
                    if r.member_id:
                        known.append((r.member_id, iid))
                    return r
                tasks.append(asyncio.ensure_future(do_join()))
            elif op == 1:
                assign = {m: b"x" for m, _ in known if rnd.random() < 0.5}
                tasks.append(asyncio.ensure_future(c.sync_group(group, gen, mid, iid, None, None, assign)))
            elif op == 2:
                assert c.heartbeat(group, gen, mid, iid) in set(E)
            elif op == 3:
                c.leave_group(group, [(mid, iid)])
            elif op == 4:
                tasks.append(asyncio.ensure_future(c.commit_offsets(group, gen, mid, iid, [("t", 0, 5, -1, "")])))
            elif op == 5:
                tasks.append(asyncio.ensure_future(c.delete_groups([group])))
            else:
                c.describe_group(group)
                c.list_groups()
                c.fetch_offsets(group, None)
            await asyncio.sleep(rnd.choice([0, 0, 0.001, 0.01]))
            check_invariants(c)
    finally:
        await c.close()
    done, pending = await asyncio.wait(tasks, timeout=30) if tasks else (set(), set())
    assert not pending, "every parked call is answered by close()"
    for t in done:
        t.result()  # no exceptions
