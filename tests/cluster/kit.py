"""Shared helpers for multi-broker tests (tests/cluster, tests/chaos): start brokers that form
one cluster, wait for a condition, ask who leads what, read a topic back.

``ClusterFactory(broker_factory, shared)`` starts brokers with node ids and racks on the
``shared`` flags (one object store, one metadata database); the fixture ``cluster_factory`` in
tests/cluster/conftest.py is one of these on a file:// store.
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

# a short lease and takeover margin: failover in ~3 s instead of ~7 s (tests only)
FAILOVER_FLAGS = ("--cluster-lease-ms", "2000", "--cluster-takeover-margin-ms", "500")
# Kafka's default first-join delay (tests default to 0), for clusters with kafka-python group
# members: kafka-python 3.0.12 sends its first JoinGroup before it has the topic's metadata, so
# with no delay it assigns nothing, rebalances when the metadata arrives, and hangs for good in
# that rebalance if a poll() times out before the SyncGroup answer (docs/groups.md). With the
# delay its first assignment already has the topic. (Seen: test_cluster_grow's kafka-python
# member stalled from its first join, in 2 of about 6 CI runs at load 10.)
KAFKA_PYTHON_GROUP_FLAGS = ("--group-initial-rebalance-delay-ms", "3000")


class ClusterFactory:
    """``factory(n, first_id=0, extra=())`` -> [BrokerProcess] with node ids first_id.. and
    racks r<id>, every one on the ``shared`` flags; call again to add brokers."""

    def __init__(self, broker_factory: Callable[..., Any], shared: Sequence[str]) -> None:
        self.broker_factory = broker_factory
        self.shared = list(shared)

    def __call__(self, n: int, first_id: int = 0, extra: Sequence[str] = (),
                 per_node: Callable[[int], Sequence[str]] | None = None) -> list:
        """``per_node(node_id)`` adds flags for one broker (its own proxies, WAL size...)."""
        return [self.broker_factory(["--node-id", str(i), "--rack", f"r{i}", *self.shared,
                                     *(per_node(i) if per_node else ()), *extra])
                for i in range(first_id, first_id + n)]


def brokers_behind_proxy(broker_factory: Callable[..., Any], tmp_path: Any, metadata_url: str,
                         extra: Sequence[str] = (), n: int = 2) -> tuple[Any, list[Any]]:
    """``n`` brokers (node ids 0.., rack r0..) on one file:// object store and the PostgreSQL
    database of ``metadata_url`` reached through one TcpProxy: (the proxy, the brokers); cut
    the proxy to cut the metadata store for all of them."""
    from tcp_proxy import proxied_url  # noqa: PLC0415 - tests/ is on the path (conftest)

    proxy, url = proxied_url(metadata_url)
    shared = ["--object-store", f"file://{tmp_path}/objects", "--metadata", url, *extra]
    return proxy, [broker_factory(["--node-id", str(i), "--rack", f"r{i}", *shared])
                   for i in range(n)]


def bootstrap(brokers: Sequence[Any]) -> str:
    return ",".join(b.bootstrap for b in brokers)


def wait_for(cond: Callable[[], object], timeout: float = 30.0, what: str = "") -> object:
    """Poll ``cond`` until truthy; an exception counts as not yet (a client may still try
    a broker that just stopped), the last one is reported on timeout."""
    end = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            v = cond()
        except Exception as exc:  # noqa: BLE001
            last, v = exc, None
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or cond} (last error: {last!r})")


def leaders(admin: Any, topic: str) -> dict[int, tuple[int, int]]:
    """partition -> (leader, leader epoch) as Metadata reports them (kafka-python admin)."""
    d = admin.describe_topics([topic])[0]
    return {p["partition_index"]: (p["leader_id"], p["leader_epoch"]) for p in d["partitions"]}


def ask(bootstrap: str, call: Callable[[Any], T], timeout: float = 30.0, what: str = "") -> T:
    """``call(admin)`` on a fresh kafka-python admin bootstrapped on ``bootstrap`` (the brokers
    known to be up) with a short request timeout, retried with another fresh admin until it
    answers. A paused broker (SIGSTOP) keeps its TCP connections open and never answers: an
    admin that learnt of it before the pause may send it any request and wait its whole
    request timeout (30 s by default), so ask only the survivors, and anew each time."""
    from kafka.admin import KafkaAdminClient  # noqa: PLC0415

    def once() -> tuple[T]:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
        try:
            return (call(admin),)
        finally:
            admin.close()
    return wait_for(once, timeout=timeout, what=what or f"an answer from {bootstrap}")[0]


def wait_live(admin: Any, n: int, timeout: float = 30.0) -> None:
    """Until DescribeCluster lists ``n`` brokers."""
    wait_for(lambda: len(admin.describe_cluster()["brokers"]) == n, timeout=timeout,
             what=f"{n} live brokers")


def wait_leaders(admin: Any, topic: str, partitions: int, timeout: float = 30.0) -> dict:
    """Until every partition of ``topic`` has a leader; returns ``leaders()``."""
    return wait_for(lambda: (len(ls := leaders(admin, topic)) == partitions
                             and all(lead >= 0 for lead, _ in ls.values()) and ls),
                    timeout=timeout, what=f"leaders of {topic}")


def read_all(bootstrap: str, topic: str, ends: dict[int, int], timeout: float = 60.0
             ) -> list[tuple[int, int, bytes]]:
    """(partition, offset, value) of every record below ``ends[partition]`` (confluent-kafka,
    no group commits)."""
    from confluent_kafka import Consumer  # noqa: PLC0415
    from confluent_kafka import TopicPartition as CTP  # noqa: PLC0415

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "verify",
                  "enable.auto.commit": False})
    c.assign([CTP(topic, p, 0) for p in ends])
    out: list[tuple[int, int, bytes]] = []
    got: collections.Counter = collections.Counter()
    deadline = time.monotonic() + timeout
    while any(got[p] < ends[p] for p in ends) and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is None or m.error():
            continue
        out.append((m.partition(), m.offset(), m.value()))
        got[m.partition()] = m.offset() + 1
    c.close()
    return out
