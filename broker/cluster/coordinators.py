"""Which broker coordinates a consumer group or a transactional id.

Kafka hashes the key onto a partition of ``__consumer_offsets`` (or ``__transaction_state``)
and the leader of that partition coordinates it. Here group state and committed offsets live
in the shared metadata database, so only the *placement* is needed: the key is hashed onto
one of ``SLOTS`` slots (Java's ``String.hashCode``, as Kafka does, so a key lands on the same
slot number Kafka would give it), and each slot belongs to one of the live brokers by
rendezvous (highest random weight) hashing. When a broker joins or leaves only the slots it
gains or loses change owner (about 1/n of them); every other key keeps its coordinator.

Every broker computes the same answer from the same set of live node ids, without any
coordination; during the poll interval after a membership change two brokers may briefly
disagree, and the one that thinks it is not the coordinator answers NOT_COORDINATOR (clients
look the coordinator up again).

API (used by FindCoordinator, the group handlers and the transaction coordinator)::

    slot_of(key) -> int                      # 0 <= slot < SLOTS
    coordinator_for(key, nodes) -> int       # node id, or -1 when ``nodes`` is empty
    Placement(nodes).node_for(key) -> int    # the same with a per-node-set slot table

``ClusterRoom.coordinator(key)`` applies it to the brokers that are live and not draining.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

SLOTS = 50          # like the default partition count of __consumer_offsets


def java_string_hash(key: str) -> int:
    """Java's ``String.hashCode`` (signed 32 bit) over UTF-16 code units."""
    h = 0
    data = key.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + ((data[i] << 8) | data[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def slot_of(key: str, slots: int = SLOTS) -> int:
    """The slot of a group id / transactional id: ``abs(hashCode) % slots`` (Kafka's
    ``Utils.abs``: masks the sign bit, so Integer.MIN_VALUE maps to 0 too)."""
    return (java_string_hash(key) & 0x7FFFFFFF) % slots


def _weight(slot: int, node: int) -> bytes:
    return hashlib.blake2b(f"{slot}:{node}".encode(), digest_size=8).digest()


def node_for_slot(slot: int, nodes: Iterable[int]) -> int:
    """Rendezvous hashing: the node with the highest weight for this slot; -1 if none."""
    best, best_w = -1, b""
    for n in nodes:
        w = _weight(slot, n)
        if w > best_w or (w == best_w and n < best):
            best, best_w = n, w
    return best


class Placement:
    """The slot -> node table for one set of live nodes (computed once per membership)."""

    def __init__(self, nodes: Iterable[int], slots: int = SLOTS) -> None:
        self.nodes = frozenset(nodes)
        self.slots = slots
        ordered = sorted(self.nodes)
        self.table = [node_for_slot(s, ordered) for s in range(slots)]

    def node_for(self, key: str) -> int:
        """The coordinator of ``key``; -1 when there is no live node."""
        return self.table[slot_of(key, self.slots)]


def coordinator_for(key: str, nodes: Iterable[int], slots: int = SLOTS) -> int:
    """The node id coordinating ``key`` among ``nodes`` (-1 when empty)."""
    return node_for_slot(slot_of(key, slots), sorted(set(nodes)))
