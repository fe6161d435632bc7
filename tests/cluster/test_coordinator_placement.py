"""The placement of group / transaction coordinators over live brokers (pure functions)."""
from __future__ import annotations

from broker.cluster.coordinators import SLOTS, Placement, coordinator_for, java_string_hash, \
    slot_of


def test_java_string_hash_matches_java():
    # values of String.hashCode() in Java
    assert java_string_hash("") == 0
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("my-group") == -1906497762
    assert java_string_hash("polygenelubricants") == -2147483648   # Integer.MIN_VALUE
    assert java_string_hash("\u00e9t\u00e9") == 227742     # non-ASCII: UTF-16 code units
    assert slot_of("polygenelubricants") == 0
    assert all(0 <= slot_of(f"g{i}") < SLOTS for i in range(500))


def test_every_broker_gets_a_share_and_all_agree():
    keys = [f"group-{i}" for i in range(600)]
    nodes = [0, 1, 2]
    owners = [coordinator_for(k, nodes) for k in keys]
    assert set(owners) == {0, 1, 2}
    counts = {n: owners.count(n) for n in nodes}
    assert min(counts.values()) > 100, counts    # roughly a third each
    p = Placement(reversed(nodes))
    assert [p.node_for(k) for k in keys] == owners   # order of the node set is irrelevant
    assert coordinator_for("g", []) == -1 and Placement([]).node_for("g") == -1


def test_membership_change_moves_only_the_affected_keys():
    keys = [f"k{i}" for i in range(2000)]
    before = {k: coordinator_for(k, [0, 1, 2]) for k in keys}
    # broker 1 leaves: only its keys move, to the others
    after = {k: coordinator_for(k, [0, 2]) for k in keys}
    for k in keys:
        if before[k] != 1:
            assert after[k] == before[k]
        else:
            assert after[k] in (0, 2)
    # broker 3 joins: keys only move to it
    grown = {k: coordinator_for(k, [0, 1, 2, 3]) for k in keys}
    moved = [k for k in keys if grown[k] != before[k]]
    assert moved and all(grown[k] == 3 for k in moved)
    assert len(moved) < len(keys) / 2
