"""Which broker coordinates a transactional id (and, for transactional offsets, a group).

Kafka hashes a transactional id onto a partition of ``__transaction_state`` whose leader is the
coordinator. Here the state is in the shared metadata store, so only the placement is needed,
and it is the cluster's one placement for coordinator keys (``ClusterRoom.coordinator``,
broker/cluster/coordinators.py), shared with consumer groups: a group and a transactional id
are placed by the same function over the same live, not draining brokers. When that set
changes, ids move; the new coordinator reads their state from the store (and a write of the
old one is refused by the row's compare-and-set). Without a cluster this broker coordinates
everything.
"""
from __future__ import annotations

from typing import Any


def _node_id(broker: Any) -> int:
    return int(getattr(getattr(broker, "config", None), "node_id", 0))


def coordinator_of(broker: Any, key: str) -> int:
    """The node coordinating ``key`` (a transactional id or a group id); -1 while no broker
    is live."""
    cluster = getattr(broker, "cluster", None)
    if cluster is None:
        return _node_id(broker)
    return int(cluster.coordinator(key))


def transaction_coordinator(broker: Any, transactional_id: str) -> int:
    """The node coordinating ``transactional_id``."""
    return coordinator_of(broker, transactional_id)


def group_coordinator(broker: Any, group_id: str) -> int:
    """The node coordinating consumer group ``group_id`` (transactional offsets are committed
    there)."""
    return coordinator_of(broker, group_id)
