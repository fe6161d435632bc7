"""Which broker coordinates a transactional id (and, for transactional offsets, a group).

Kafka hashes a transactional id onto a partition of ``__transaction_state`` whose leader is the
coordinator. Here the state is in the shared metadata store, so any broker can coordinate any
id: the id is hashed (CRC-32, stable across processes) onto the live brokers in node-id order.
When the set of live brokers changes, ids move; the new coordinator reads their state from the
store (and a write of the old one is refused by the row's compare-and-set). Draining brokers
(controlled shutdown) coordinate nothing.
"""
from __future__ import annotations

import zlib
from typing import Any

from protocol import ErrorCode as E


def _node_id(broker: Any) -> int:
    return int(getattr(getattr(broker, "config", None), "node_id", 0))


def coordinator_candidates(broker: Any) -> list[int]:
    """Node ids that may coordinate transactions, in order (this node alone without a cluster)."""
    cluster = getattr(broker, "cluster", None)
    if cluster is None:
        return [_node_id(broker)]
    live = getattr(cluster, "live", {}) or {}
    nodes = sorted(n for n, b in live.items() if getattr(b, "state", "live") == "live")
    return nodes or sorted(live) or [_node_id(broker)]


def _placed(broker: Any, key: str) -> int | None:
    """The cluster's own placement of a coordinator key (broker/cluster/coordinators.py:
    groups and transactional ids share it), None when the cluster has none."""
    place = getattr(getattr(broker, "cluster", None), "coordinator", None)
    return None if place is None else int(place(key))


def transaction_coordinator(broker: Any, transactional_id: str) -> int:
    """The node coordinating ``transactional_id``, -1 while no broker is live."""
    node = _placed(broker, transactional_id)
    if node is not None:
        return node
    nodes = coordinator_candidates(broker)
    if not nodes:
        return -1
    return nodes[zlib.crc32(transactional_id.encode()) % len(nodes)]


def group_coordinator(broker: Any, group_id: str) -> int:
    """The node coordinating consumer group ``group_id`` (transactional offsets are committed
    there)."""
    node = _placed(broker, group_id)
    if node is not None:
        return node
    cluster = getattr(broker, "cluster", None)
    if cluster is None:
        return _node_id(broker)
    return int(cluster.controller_id)


def find_transaction_coordinator(broker: Any, transactional_id: str
                                 ) -> tuple[int, str | None, int, str, int]:
    """FindCoordinator key type 1: (error, message, node, host, port)."""
    node = transaction_coordinator(broker, transactional_id)
    cfg = broker.config
    if node == _node_id(broker):
        return E.NONE, None, node, cfg.advertised_host, cfg.advertised_port
    cluster = getattr(broker, "cluster", None)
    ep = cluster.endpoint(node) if cluster is not None and node >= 0 else None
    if ep is None:
        return E.COORDINATOR_NOT_AVAILABLE, "no live broker coordinates transactions", -1, "", -1
    return E.NONE, None, node, ep[0], ep[1]
