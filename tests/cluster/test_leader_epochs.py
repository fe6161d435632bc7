"""Real leader epochs in stored batches (issue 16): each batch carries the epoch of the leader
that appended it, so OffsetForLeaderEpoch answers from the real epoch history and consumers
that follow a partition across two moves never see a false truncation (which makes Java,
librdkafka and kafka-python seek back and read records again).

Two brokers, one partition moved twice (epochs 0 -> 1 -> 2) while a Java group consumer and a
confluent-kafka group consumer read along: each reads every offset exactly once, and sees
the epoch of the leader that wrote it; OffsetForLeaderEpoch gives each epoch's end.
"""
from __future__ import annotations

import pathlib
import threading
import time

import pytest
from confluent_kafka import Consumer, Producer
from kafka import TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.protocol.consumer import OffsetForLeaderEpochRequest, OffsetForLeaderEpochResponse

from clients.e2e_helpers import JavaCli, compile_java
from datapath.wire import WireClient

from .kit import leaders, wait_for, wait_live

pytestmark = pytest.mark.slow

TOPIC = "ep"
PER_EPOCH = 100


@pytest.fixture
def metadata_url(tmp_path: pathlib.Path) -> str:
    """SQLite only: the epoch history lives in the same tables on both backends, and
    tests/cluster/test_cluster.py covers PostgreSQL."""
    return f"sqlite:///{tmp_path}/meta.db"


class Reader:
    """A confluent-kafka group consumer recording (offset, leader epoch) of every record."""

    def __init__(self, bootstrap: str) -> None:
        self.seen: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._c = Consumer({"bootstrap.servers": bootstrap, "group.id": "ep-c",
                            "auto.offset.reset": "earliest", "enable.auto.commit": True,
                            "auto.commit.interval.ms": 200,
                            "topic.metadata.refresh.interval.ms": 1000})
        self._c.subscribe([TOPIC])
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            m = self._c.poll(0.2)
            if m is not None and not m.error():
                self.seen.append((m.offset(), m.leader_epoch()))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(30)
        self._c.close()


def _end_of(broker, epoch: int, current: int) -> tuple[int, int, int]:
    OT = OffsetForLeaderEpochRequest.OffsetForLeaderTopic
    with WireClient(broker.host, broker.port) as w:
        req = OffsetForLeaderEpochRequest(replica_id=-1, topics=[OT(topic=TOPIC, partitions=[
            OT.OffsetForLeaderPartition(partition=0, current_leader_epoch=current,
                                        leader_epoch=epoch)])])
        r = w.call(req, OffsetForLeaderEpochResponse, 4).topics[0].partitions[0]
    return r.error_code, r.leader_epoch, r.end_offset


def test_batches_carry_the_leader_epoch_across_two_moves(cluster_factory, java_classpath):
    version = sorted(java_classpath)[-1]
    cli = JavaCli(version, compile_java(version, java_classpath[version]))
    brokers = cluster_factory(2)
    boot = ",".join(b.bootstrap for b in brokers)
    admin = KafkaAdminClient(bootstrap_servers=boot)
    wait_live(admin, 2)
    time.sleep(0.5)       # every broker's view follows the database within a poll interval
    admin.create_topics([NewTopic(TOPIC, 1, 2)])
    wait_for(lambda: leaders(admin, TOPIC).get(0, (-1, -1))[0] >= 0, what="a leader")
    java = cli.start("consume-group", bootstrap=boot, topic=TOPIC, group="ep-j",
                     count=3 * PER_EPOCH, timeout_ms=150000)
    reader = Reader(boot)
    p = Producer({"bootstrap.servers": boot, "enable.idempotence": True, "acks": "all",
                  "linger.ms": 5, "topic.metadata.refresh.interval.ms": 1000})
    try:
        for epoch in range(3):
            if epoch:
                leader, e = leaders(admin, TOPIC)[0]
                assert e == epoch - 1
                admin.alter_partition_reassignments({TopicPartition(TOPIC, 0): [1 - leader]})
                wait_for(lambda: leaders(admin, TOPIC)[0] == (1 - leader, epoch),
                         what=f"the move to epoch {epoch}")
            for i in range(PER_EPOCH):
                p.produce(TOPIC, value=f"e{epoch}-{i}".encode(), partition=0)
            assert p.flush(60) == 0
            # the readers follow each epoch before the next move (their position is then
            # validated against the epoch they last fetched)
            wait_for(lambda: len(reader.seen) >= (epoch + 1) * PER_EPOCH, timeout=60,
                     what=f"confluent-kafka reading epoch {epoch}")
        java_out = cli.finish(java, timeout=180)
    finally:
        reader.stop()
        if java.poll() is None:
            java.kill()
    n = 3 * PER_EPOCH
    # every offset once (a false truncation seeks back: the same offsets again)
    assert [o for o, _ in reader.seen] == list(range(n)), reader.seen[:5]
    want = [o // PER_EPOCH for o in range(n)]
    assert [e for _, e in reader.seen] == want, "librdkafka saw other leader epochs"
    jrecs = java_out["records"]
    assert sorted(r["o"] for r in jrecs) == list(range(n)), len(jrecs)
    assert [r["e"] for r in sorted(jrecs, key=lambda r: r["o"])] == want
    assert java_out["committed"] == {"0": n}
    leader, current = leaders(admin, TOPIC)[0]
    assert current == 2
    b = brokers[leader]
    assert _end_of(b, 1, current) == (0, 1, 2 * PER_EPOCH)   # where epoch 2 began
    assert _end_of(b, 2, current) == (0, 2, n)               # the latest: the log end
    assert _end_of(b, 0, current) == (0, 0, n)   # epoch 0: batches from before stamping
    assert _end_of(b, 3, current)[0] != 0 or _end_of(b, 3, current)[2] == -1
    admin.close()
