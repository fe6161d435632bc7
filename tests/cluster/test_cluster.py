"""Three broker processes on one object store and one metadata database, real clients.

While an idempotent acks=all producer and a consumer group run, a partition is reassigned,
a broker is stopped with SIGTERM (controlled shutdown: its partitions move first) and started
again (it gets its share back). Every acknowledged record must be in the log exactly once at
the offset it was acknowledged with, the group must have consumed them all, and its committed
offsets must survive.
"""
from __future__ import annotations

import collections
import threading
import time

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException
from kafka import TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.protocol.consumer import OffsetForLeaderEpochRequest, OffsetForLeaderEpochResponse

from datapath.wire import WireClient

from .kit import leaders, read_all, wait_for, wait_live
from .timed_load import PARTITIONS, TimedLoad

pytestmark = pytest.mark.slow


class GroupReader:
    """A confluent-kafka consumer in a group, committing as it goes."""

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        self.seen: list[tuple[int, int, bytes]] = []
        self._stop = threading.Event()
        self._c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                            "auto.offset.reset": "earliest", "enable.auto.commit": False,
                            "topic.metadata.refresh.interval.ms": 1000,
                            "session.timeout.ms": 10000})
        self._c.subscribe([topic])
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            m = self._c.poll(0.2)
            if m is None or m.error():
                continue
            self.seen.append((m.partition(), m.offset(), m.value()))
            n += 1
            if n % 50 == 0:
                try:
                    self._c.commit(asynchronous=True)
                except Exception:  # noqa: BLE001 - a commit during a coordinator move
                    pass

    def finish(self) -> None:
        self._stop.set()
        self._t.join(30)
        try:
            self._c.commit(asynchronous=False)
        except KafkaException as e:
            if e.args[0].code() != KafkaError._NO_OFFSET:   # all committed already
                raise
        self._c.close()


def test_three_brokers_move_partitions_under_load(cluster_factory):
    brokers = cluster_factory(3)
    boot = ",".join(b.bootstrap for b in brokers)
    admin = KafkaAdminClient(bootstrap_servers=brokers[0].bootstrap)
    wait_live(admin, 3)
    time.sleep(0.5)       # every broker's view follows the database within a poll interval
    info = admin.describe_cluster()
    assert sorted((b["broker_id"], b["rack"]) for b in info["brokers"]) == \
        [(0, "r0"), (1, "r1"), (2, "r2")]
    admin.create_topics([NewTopic("orders", PARTITIONS, 3)])
    d = wait_for(lambda: leaders(admin, "orders"), what="topic metadata")
    assert collections.Counter(leader for leader, _ in d.values()) == {0: 2, 1: 2, 2: 2}
    parts = admin.describe_topics(["orders"])[0]["partitions"]
    assert all(len(p["replica_nodes"]) == 3 and p["replica_nodes"][0] == p["leader_id"]
               and p["isr_nodes"] == p["replica_nodes"] for p in parts)

    load = TimedLoad(boot, "orders", keyed=True)
    reader = GroupReader(boot, "orders", "g1")
    wait_for(lambda: len(load.acked) > 300, what="first acknowledged records")

    # 1. reassign a partition to another broker: it moves at epoch + 1
    before = leaders(admin, "orders")
    old, epoch = before[0]
    target = (old + 1) % 3
    admin.alter_partition_reassignments({TopicPartition("orders", 0): [target]})
    wait_for(lambda: leaders(admin, "orders")[0] == (target, epoch + 1), what="move of p0")
    n = len(load.acked)
    wait_for(lambda: any(p == 0 for p, *_ in load.acked[n:]), what="acks on the new leader")

    # 2. SIGTERM a broker (not the controller): its partitions move before it exits
    victim = brokers[1]
    victim.stop()
    # (the answering broker's view follows the metadata database within a poll interval)
    wait_for(lambda: all(leader in (0, 2) for leader, _ in leaders(admin, "orders").values()),
             timeout=5, what="no partition led by the stopped broker")
    n = len(load.acked)
    wait_for(lambda: len(load.acked) > n + 300, what="produce after controlled shutdown")

    # 3. start it again: it gets its share back
    victim.start()
    wait_for(lambda: collections.Counter(
        leader for leader, _ in leaders(admin, "orders").values()).get(1, 0) >= 2,
        what="broker 1 leading partitions again")
    n = len(load.acked)
    wait_for(lambda: len(load.acked) > n + 300, what="produce after the rejoin")

    load.stop()
    assert not load.errors, load.errors[:5]
    acked = sorted((p, off, v) for p, off, v, _ in load.acked)
    ends = {p: 0 for p in range(PARTITIONS)}
    for p, off, _ in acked:
        ends[p] = max(ends[p], off + 1)
    log = sorted(read_all(boot, "orders", ends))
    # every acknowledged record exactly once, at the offset it was acknowledged with
    assert log == acked, (len(log), len(acked))
    # the group saw every record (at least once: a rebalance may replay a little)
    try:
        wait_for(lambda: {r[2] for r in reader.seen} >= {r[2] for r in acked}, timeout=30,
                 what="group consumer catching up")
    except AssertionError:
        top = {p: max((o for q, o, _ in reader.seen if q == p), default=-1)
               for p in range(PARTITIONS)}
        missing = {r for r in acked if r[2] not in {x[2] for x in reader.seen}}
        raise AssertionError(f"group consumer: seen up to {top}, ends {ends}, "
                             f"{len(missing)} missing, first {sorted(missing)[:5]}")
    reader.finish()
    committed = admin.list_group_offsets("g1")["g1"]
    offsets = {tp.partition: om["offset"] if isinstance(om, dict) else om.offset
               for tp, om in committed.items()}
    assert offsets == ends
    admin.close()

    # 4. SIGTERM the controller (also the group coordinator): another broker takes over the
    # controller lease and the groups; the committed offsets are still there
    brokers[0].stop()
    admin = KafkaAdminClient(bootstrap_servers=brokers[2].bootstrap)
    wait_for(lambda: admin.describe_cluster()["controller_id"] in (1, 2), what="new controller")
    wait_for(lambda: all(leader in (1, 2) for leader, _ in leaders(admin, "orders").values()),
             timeout=5, what="partitions off the stopped controller")

    def committed_now() -> dict[int, int] | None:
        try:
            got = admin.list_group_offsets("g1")["g1"]
        except Exception:  # noqa: BLE001 - coordinator being elected: ask again
            return None
        return {tp.partition: om.offset for tp, om in got.items()}
    assert wait_for(committed_now, timeout=15, what="offsets from the new coordinator") == ends
    admin.close()


def test_second_broker_with_the_same_node_id_is_refused(cluster_factory, broker_factory):
    (first,) = cluster_factory(1)
    with pytest.raises(RuntimeError) as exc:
        broker_factory(["--node-id", "0", *cluster_factory.shared])
    text = str(exc.value)
    assert "exited with 2" in text
    assert "node id 0 is already used by a live broker at " + first.bootstrap in text
    assert "Traceback" not in text
    # the first one keeps serving, alone in its cluster
    admin = KafkaAdminClient(bootstrap_servers=first.bootstrap)
    assert [b["broker_id"] for b in admin.describe_cluster()["brokers"]] == [0]
    admin.close()


def test_kafka_python_follows_a_move(cluster_factory):
    """kafka-python producer and group consumer across a reassignment: NOT_LEADER answers
    send them to the new leader; nothing lost, nothing twice."""
    from kafka import KafkaConsumer, KafkaProducer  # noqa: PLC0415

    brokers = cluster_factory(2)
    boot = [b.bootstrap for b in brokers]
    admin = KafkaAdminClient(bootstrap_servers=boot[0])
    wait_live(admin, 2)
    time.sleep(0.5)       # every broker's view follows the database within a poll interval
    admin.create_topics([NewTopic("kp", 2, 2)])
    p = KafkaProducer(bootstrap_servers=boot, acks="all", enable_idempotence=True,
                      metadata_max_age_ms=1000)
    for i in range(200):
        p.send("kp", value=f"a{i}".encode(), partition=i % 2)
    p.flush()
    old = leaders(admin, "kp")
    for part, (leader, epoch) in old.items():
        admin.alter_partition_reassignments({TopicPartition("kp", part): [1 - leader]})
    wait_for(lambda: all(leaders(admin, "kp")[q] == (1 - l, e + 1) for q, (l, e) in old.items()),
             what="both partitions moved")
    for i in range(200, 400):
        p.send("kp", value=f"a{i}".encode(), partition=i % 2).get(timeout=30)
    p.close()
    c = KafkaConsumer("kp", bootstrap_servers=boot, group_id="kp-g",
                      auto_offset_reset="earliest", consumer_timeout_ms=8000)
    got = [(m.partition, m.offset, m.value) for m in c]
    c.close()
    assert sorted(v for _, _, v in got) == sorted(f"a{i}".encode() for i in range(400))
    for part in (0, 1):
        offs = [o for q, o, _ in got if q == part]
        assert offs == list(range(200)), part
    # stored batches carry leader epoch 0 whichever leader wrote them, so a consumer that
    # read past the move asks for epoch 0: its end must not be where epoch 1 began (100), or
    # the consumer takes it for a truncation and seeks back (chaos suite: commits went back)
    now = leaders(admin, "kp")
    OT = OffsetForLeaderEpochRequest.OffsetForLeaderTopic
    for part, (leader, epoch) in now.items():
        b = brokers[leader]
        with WireClient(b.host, b.port) as w:
            req = OffsetForLeaderEpochRequest(replica_id=-1, topics=[OT(topic="kp", partitions=[
                OT.OffsetForLeaderPartition(partition=part, current_leader_epoch=epoch,
                                            leader_epoch=0)])])
            r = w.call(req, OffsetForLeaderEpochResponse, 4).topics[0].partitions[0]
        assert (r.error_code, r.leader_epoch, r.end_offset) == (0, 0, 200), (part, r)
    admin.close()
