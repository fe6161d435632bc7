"""Consumer groups spread over the brokers of a cluster (FindCoordinator), and a group whose
coordinator stops (SIGTERM) carries on at another broker with its committed offsets.

Three brokers; FindCoordinator (v3 single key, v4 batched keys) gives the same, spread
answer on every broker, following ``broker.cluster.coordinators``; a broker that is not a
group's coordinator answers NOT_COORDINATOR. Then confluent-kafka (a member that keeps
running), kafka-python and Java kafka-clients consume in groups coordinated by broker 2,
broker 2 is stopped, and every group goes on from its committed offsets: each record is
consumed exactly once per group.
"""
from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer, Producer
from kafka import KafkaConsumer
from kafka.admin import KafkaAdminClient, NewTopic

import protocol
from broker.cluster.coordinators import coordinator_for
from clients.e2e_helpers import JavaCli, compile_java
from datapath.wire import WireClient

from .kit import KAFKA_PYTHON_GROUP_FLAGS, wait_for

pytestmark = pytest.mark.slow
PARTITIONS = 4
FIND_COORDINATOR, HEARTBEAT = 10, 12


def find(bootstrap: str, keys: list[str], version: int) -> dict[str, tuple[int, int, int]]:
    """key -> (error, node id, port) as one broker answers FindCoordinator."""
    host, port = bootstrap.rsplit(":", 1)
    req_cls, resp_cls = protocol.request_class(FIND_COORDINATOR), \
        protocol.response_class(FIND_COORDINATOR)
    with WireClient(host, int(port)) as c:
        if version >= 4:
            r = c.call(req_cls(key_type=0, coordinator_keys=keys), resp_cls, version)
            return {x.key: (x.error_code, x.node_id, x.port) for x in r.coordinators}
        out = {}
        for k in keys:
            r = c.call(req_cls(key=k, key_type=0), resp_cls, version)
            out[k] = (r.error_code, r.node_id, r.port)
        return out


def group_on(node: int, prefix: str, nodes=(0, 1, 2)) -> str:
    return next(g for i in range(1000) if coordinator_for(g := f"{prefix}-{i}", nodes) == node)


def produce(bootstrap: str, topic: str, start: int, n: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all"})
    for i in range(start, start + n):
        p.produce(topic, value=f"v{i}".encode(), partition=i % PARTITIONS)
    assert p.flush(60) == 0


class Member(threading.Thread):
    """A confluent-kafka group member that keeps consuming (and committing) throughout."""

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        super().__init__(daemon=True)
        self.seen: list[str] = []
        self.stop_ev = threading.Event()
        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                           "auto.offset.reset": "earliest", "enable.auto.commit": False,
                           "session.timeout.ms": 6000, "heartbeat.interval.ms": 300,
                           "topic.metadata.refresh.interval.ms": 1000})
        self.c.subscribe([topic])
        self.start()

    def run(self) -> None:
        while not self.stop_ev.is_set():
            m = self.c.poll(0.2)
            if m is None or m.error():
                continue
            self.seen.append(m.value().decode())
            try:
                self.c.commit(message=m, asynchronous=False)
            except Exception:  # noqa: BLE001 - the coordinator moving: the next commit covers it
                pass

    def finish(self) -> None:
        self.stop_ev.set()
        self.join(30)
        self.c.close()


def kp_consume(bootstrap: list[str], topic: str, group: str, want: int) -> list[str]:
    c = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                      auto_offset_reset="earliest", enable_auto_commit=False,
                      metadata_max_age_ms=1000)
    got: list[str] = []
    deadline = time.monotonic() + 60
    while len(got) < want and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=500).values():
            got.extend(r.value.decode() for r in recs)
    c.poll(timeout_ms=500)   # nothing beyond
    c.commit()
    c.close()
    return got


@pytest.mark.parametrize("metadata_url", ["sqlite"], indirect=True)
def test_groups_spread_and_survive_their_coordinator(cluster_factory, java_classpath):
    brokers = cluster_factory(3, extra=KAFKA_PYTHON_GROUP_FLAGS)
    boot = ",".join(b.bootstrap for b in brokers)
    admin = KafkaAdminClient(bootstrap_servers=brokers[0].bootstrap)
    keys = [f"grp-{i}" for i in range(30)]
    expect = {k: coordinator_for(k, [0, 1, 2]) for k in keys}
    wait_for(lambda: all({k: v[1] for k, v in find(b.bootstrap, keys, 4).items()} == expect
                         for b in brokers), what="every broker placing on 3 brokers")

    # 1. spread, identical on every broker, v3 and v4 alike
    assert len(set(expect.values())) == 3
    ports = {i: b.port for i, b in enumerate(brokers)}
    for b in brokers:
        for version in (3, 4):
            got = find(b.bootstrap, keys, version)
            assert got == {k: (0, n, ports[n]) for k, n in expect.items()}, (b.bootstrap, version)

    # 2. a broker that does not coordinate a group says so
    g0 = group_on(0, "probe")
    req_cls, resp_cls = protocol.request_class(HEARTBEAT), protocol.response_class(HEARTBEAT)
    with WireClient("127.0.0.1", brokers[1].port) as c:
        r = c.call(req_cls(group_id=g0, generation_id=1, member_id="m"), resp_cls, 3)
    assert r.error_code == protocol.ErrorCode.NOT_COORDINATOR

    # 3. groups coordinated by broker 2, which then stops
    admin.create_topics([NewTopic("gc", PARTITIONS, 3)])
    produce(boot, "gc", 0, 200)
    g_ck, g_kp, g_java = group_on(2, "ck"), group_on(2, "kp"), group_on(2, "java")
    member = Member(boot, "gc", g_ck)
    first_kp = kp_consume([b.bootstrap for b in brokers], "gc", g_kp, 200)
    version = sorted(java_classpath)[-1]
    cli = JavaCli(version, compile_java(version, java_classpath[version]))
    first_java = cli("consume-group", bootstrap=boot, topic="gc", group=g_java, count=200,
                     timeout_ms=60000, timeout=120)
    wait_for(lambda: len(member.seen) >= 200, timeout=60, what="confluent member: first 200")

    brokers[2].stop()
    # the survivors place the groups on brokers 0 and 1
    wait_for(lambda: all(find(b.bootstrap, [g_ck], 4)[g_ck][1] == coordinator_for(g_ck, [0, 1])
                         for b in brokers[:2]), timeout=15, what="groups moved")
    boot2 = ",".join(b.bootstrap for b in brokers[:2])
    produce(boot2, "gc", 200, 200)

    second_kp = kp_consume([b.bootstrap for b in brokers[:2]], "gc", g_kp, 200)
    second_java = cli("consume-group", bootstrap=boot2, topic="gc", group=g_java, count=200,
                      timeout_ms=60000, timeout=120)
    wait_for(lambda: len(set(member.seen)) >= 400, timeout=60, what="confluent member: all 400")
    member.finish()

    every = sorted(f"v{i}" for i in range(400))
    assert sorted(first_kp + second_kp) == every            # exactly once across the move
    java_vals = [r["v"] for r in first_java["records"] + second_java["records"]]
    assert sorted(java_vals) == every
    assert sorted(set(member.seen)) == every
    ends = {str(p): 100 for p in range(PARTITIONS)}
    assert second_java["committed"] == ends
    admin.close()
    admin = KafkaAdminClient(bootstrap_servers=brokers[0].bootstrap)
    for g in (g_ck, g_kp):
        got = wait_for(lambda g=g: admin.list_group_offsets(g)[g], timeout=15,
                       what=f"offsets of {g}")
        assert {tp.partition: om.offset for tp, om in got.items()} == \
            {p: 100 for p in range(PARTITIONS)}, g
    admin.close()
