"""The cluster grows from 2 to 3 brokers while Java kafka-clients (idempotent acks=all
producer, consumer group) and a confluent-kafka producer run.

The joining broker gets its share of partitions (moves, no data copy); the Java clients follow
the moves (NOT_LEADER answers, OffsetForLeaderEpoch after each epoch bump: a false truncation
would reset or duplicate); every acknowledged record is in the log exactly once at the offset
it was acknowledged with, the Java group read each exactly once in order, and its committed
offsets are read back from the new broker. SQLite only: the metadata store is exercised on
both backends by test_cluster.py, and PostgreSQL would double this test's time.
"""
from __future__ import annotations

import collections
import pathlib
import threading
import time

import pytest
from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient, NewTopic

from clients.e2e_helpers import CLIENT_BROKER_ARGS, JavaCli, compile_java

from .kit import leaders, read_all, wait_for

pytestmark = pytest.mark.slow

PARTITIONS = 6
JAVA_COUNT = 3000


@pytest.fixture
def metadata_url(tmp_path: pathlib.Path) -> str:
    """SQLite only (see the module docstring)."""
    return f"sqlite:///{tmp_path}/meta.db"


class PacedProducer:
    """confluent-kafka idempotent acks=all producer: ``count`` records "c-i", paced."""

    def __init__(self, bootstrap: str, topic: str, count: int, per_s: float) -> None:
        self.acked: list[tuple[int, int, bytes]] = []
        self.errors: list[str] = []
        self._p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                            "acks": "all", "linger.ms": 5, "message.timeout.ms": 60000,
                            "topic.metadata.refresh.interval.ms": 1000})
        self._t = threading.Thread(target=self._run, args=(topic, count, per_s), daemon=True)
        self._t.start()

    def _cb(self, err, msg) -> None:
        if err is not None:
            self.errors.append(str(err))
        else:
            self.acked.append((msg.partition(), msg.offset(), msg.value()))

    def _run(self, topic: str, count: int, per_s: float) -> None:
        for i in range(count):
            self._p.produce(topic, key=f"c{i}".encode(), value=f"c-{i}".encode(),
                            on_delivery=self._cb)
            if i % 10 == 9:
                self._p.poll(0)
                time.sleep(10 / per_s)   # poll() returns early when callbacks are served
        self._p.flush(60)

    def join(self) -> None:
        self._t.join(90)


def test_cluster_grows_from_two_to_three_under_java_clients(cluster_factory, java_classpath):
    version = sorted(java_classpath)[-1]
    cli = JavaCli(version, compile_java(version, java_classpath[version]))
    brokers = cluster_factory(2, extra=tuple(CLIENT_BROKER_ARGS))
    boot = ",".join(b.bootstrap for b in brokers)
    admin = KafkaAdminClient(bootstrap_servers=brokers[0].bootstrap)
    wait_for(lambda: len(admin.describe_cluster()["brokers"]) == 2, what="2 live brokers")
    time.sleep(0.5)       # every broker's view follows the database within a poll interval
    admin.create_topics([NewTopic("grow", PARTITIONS, 2)])
    wait_for(lambda: collections.Counter(
        leader for leader, _ in leaders(admin, "grow").values()) == {0: 3, 1: 3},
        what="6 partitions on 2 brokers")

    c_count = 1500
    total = JAVA_COUNT + c_count
    jconsumer = cli.start("consume-group", bootstrap=boot, topic="grow", group="jg",
                          count=total, timeout_ms=90000)
    jproducer = cli.start("produce", bootstrap=boot, topic="grow", count=JAVA_COUNT,
                          prefix="j", pace_ms=40, delivery_timeout_ms=60000)
    cprod = PacedProducer(boot, "grow", c_count, per_s=100)
    try:
        wait_for(lambda: len(cprod.acked) > 200, what="first confluent acks")

        # the third broker joins: the controller moves partitions to it until balanced
        (third,) = cluster_factory(1, first_id=2, extra=tuple(CLIENT_BROKER_ARGS))
        boot3 = boot + "," + third.bootstrap
        # balanced by count over all partitions (__consumer_offsets' one counts too): the
        # new broker takes 2 of the 7, the others keep 3 and 2
        # (the admin client may ask any broker; each follows the database within a poll)
        def balanced() -> dict[int, tuple[int, int]] | None:
            now = leaders(admin, "grow")
            led = collections.Counter(leader for leader, _ in now.values())
            return now if led.get(2) == 2 and set(led) == {0, 1, 2} else None
        now = wait_for(balanced, what="leaders on all 3 brokers")
        moved = {p for p, (leader, _) in now.items() if leader == 2}
        assert all(epoch >= 1 for p, (_, epoch) in now.items() if p in moved), now
        n = len(cprod.acked)
        wait_for(lambda: any(p in moved for p, _, _ in cprod.acked[n:]),
                 what=f"acks from the joined broker (acked {n}, then {len(cprod.acked)}, "
                      f"errors {cprod.errors[:3]})")
        assert jproducer.poll() is None, "the Java producer finished before the join: no test"

        jprod = cli.finish(jproducer, timeout=90)
        cprod.join()
        jcons = cli.finish(jconsumer, timeout=120)
    finally:
        for proc in (jproducer, jconsumer):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert jprod["errors"] == [] and jprod["acked"] == JAVA_COUNT, jprod["errors"][:5]
    assert not cprod.errors and len(cprod.acked) == c_count, cprod.errors[:5]
    ends = {p: 0 for p in range(PARTITIONS)}
    for p, offs in jprod["offsets"].items():
        ends[int(p)] = max(ends[int(p)], max(offs) + 1)
    for p, off, _ in cprod.acked:
        ends[p] = max(ends[p], off + 1)
    assert sum(ends.values()) == total

    # the log: every acknowledged record exactly once, at its acknowledged offset
    log = sorted(read_all(boot3, "grow", ends))
    assert len(log) == total and len({v for _, _, v in log}) == total
    assert [r for r in log if r[2].startswith(b"c-")] == sorted(cprod.acked)
    for p in range(PARTITIONS):
        java = [(o, int(v[2:])) for q, o, v in log if q == p and v.startswith(b"j-")]
        assert sorted(o for o, _ in java) == sorted(jprod["offsets"].get(str(p), [])), p
        seq = [i for _, i in java]
        assert seq == sorted(seq), f"Java records out of order in partition {p}"

    # the Java group read each record exactly once, in offset order per partition
    got = [(r["p"], r["o"], r["v"].encode()) for r in jcons["records"]]
    assert sorted(got) == log, (len(got), total)
    for p in range(PARTITIONS):
        offs = [o for q, o, _ in got if q == p]
        assert offs == list(range(ends[p])), f"partition {p}: not read once in order"
    assert {int(p): o for p, o in jcons["committed"].items()} == ends

    # committed offsets survive: read through the broker that joined
    admin.close()
    admin = KafkaAdminClient(bootstrap_servers=third.bootstrap)
    committed = admin.list_group_offsets("jg")["jg"]
    assert {tp.partition: om.offset for tp, om in committed.items()} == ends
    admin.close()
