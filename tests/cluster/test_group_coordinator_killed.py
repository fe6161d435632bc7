"""A group whose coordinator's broker is killed (kill -9) carries on (issue 16 / 17).

Three brokers with a short lease. A confluent-kafka and a kafka-python group (both
coordinated by broker 2) consume continuously with short polls and synchronous commits;
broker 2 is killed with kill -9, its WAL is taken over and its groups are placed on the
survivors, and both groups read every record produced before and after the kill (the
chaos suite saw a kafka-python member stop for good around such a kill: docs/FINDINGS.md,
docs/groups.md). Then the committed offsets are the log ends.
"""
from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer
from kafka import KafkaConsumer
from kafka.admin import KafkaAdminClient, NewTopic

from broker.cluster.coordinators import coordinator_for

from .kit import FAILOVER_FLAGS, KAFKA_PYTHON_GROUP_FLAGS, ask, wait_for, wait_leaders, wait_live
from .test_group_coordinators import PARTITIONS, find, group_on, produce

pytestmark = pytest.mark.slow
TOPIC = "gk"


class CkMember(threading.Thread):
    """confluent-kafka: consumes and commits each batch synchronously until stopped."""

    def __init__(self, boot: str, group: str) -> None:
        super().__init__(daemon=True)
        self.group, self.seen, self.stop_ev = group, set(), threading.Event()
        self.c = Consumer({"bootstrap.servers": boot, "group.id": group,
                           "auto.offset.reset": "earliest", "enable.auto.commit": False,
                           "session.timeout.ms": 10000, "heartbeat.interval.ms": 1000,
                           "topic.metadata.refresh.interval.ms": 1000})
        self.c.subscribe([TOPIC])
        self.start()

    def run(self) -> None:
        while not self.stop_ev.is_set():
            msgs = [m for m in self.c.consume(100, timeout=0.2) if not m.error()]
            self.seen.update(m.value().decode() for m in msgs)
            if msgs:
                try:
                    self.c.commit(asynchronous=False)
                except Exception:  # noqa: BLE001 - coordinator moving: the next one covers it
                    pass
        self.c.close()


class KpMember(threading.Thread):
    """kafka-python: polls 200 ms at a time and commits each batch synchronously."""

    def __init__(self, boot: str, group: str) -> None:
        super().__init__(daemon=True)
        self.group, self.seen, self.stop_ev = group, set(), threading.Event()
        self.boot = boot
        self.start()

    def run(self) -> None:
        c = KafkaConsumer(bootstrap_servers=self.boot, group_id=self.group,
                          auto_offset_reset="earliest", enable_auto_commit=False,
                          session_timeout_ms=10000, heartbeat_interval_ms=1000,
                          metadata_max_age_ms=1000, request_timeout_ms=20000)
        c.subscribe([TOPIC])
        while not self.stop_ev.is_set():
            try:
                batches = c.poll(timeout_ms=200)
            except Exception:  # noqa: BLE001 - e.g. CommitFailed after a move: poll again
                continue
            for recs in batches.values():
                self.seen.update(r.value.decode() for r in recs)
            if batches:
                try:
                    c.commit()
                except Exception:  # noqa: BLE001
                    pass
        c.close()


def test_groups_carry_on_after_their_coordinator_is_killed(cluster_factory, metadata_url):
    if not metadata_url.startswith("sqlite"):
        pytest.skip("the same paths on PostgreSQL; SQLite keeps this lean")
    brokers = cluster_factory(3, extra=(*FAILOVER_FLAGS, *KAFKA_PYTHON_GROUP_FLAGS))
    boot = ",".join(b.bootstrap for b in brokers)
    admin = KafkaAdminClient(bootstrap_servers=boot)
    wait_live(admin, 3)
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])
    wait_leaders(admin, TOPIC, PARTITIONS)
    admin.close()
    g_ck, g_kp = group_on(2, "ck"), group_on(2, "kp")
    wait_for(lambda: all(find(b.bootstrap, [g_ck, g_kp], 4)[g_kp][1] == 2 for b in brokers),
             what="every broker placing the groups on broker 2")
    members = [CkMember(boot, g_ck), KpMember(boot, g_kp)]
    try:
        produce(boot, TOPIC, 0, 200)
        first = {f"v{i}" for i in range(200)}
        wait_for(lambda: all(first <= m.seen for m in members), timeout=60,
                 what="both groups read the first 200")
        brokers[2].kill()
        survivors = ",".join(b.bootstrap for b in brokers[:2])
        wait_for(lambda: all(find(b.bootstrap, [g_kp], 4)[g_kp][1] == coordinator_for(g_kp, [0, 1])
                             for b in brokers[:2]), timeout=30, what="groups placed anew")
        produce(survivors, TOPIC, 200, 200)
        every = {f"v{i}" for i in range(400)}
        try:
            wait_for(lambda: all(every <= m.seen for m in members), timeout=90,
                     what="both groups read all 400 after the kill")
        except AssertionError as e:
            raise AssertionError(f"{e}; read: " + ", ".join(
                f"{m.group} {len(m.seen & every)}" for m in members)) from None
        time.sleep(1.0)        # the last commits
    finally:
        for m in members:
            m.stop_ev.set()
        for m in members:
            m.join(30)
    for g in (g_ck, g_kp):
        got = ask(survivors, lambda a, g=g: a.list_group_offsets(g)[g], what=f"offsets of {g}")
        assert {tp.partition: om.offset for tp, om in got.items()} == \
            {p: 100 for p in range(PARTITIONS)}, g
