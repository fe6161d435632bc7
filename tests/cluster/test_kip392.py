"""KIP-392, fetch from the closest replica, on 3 brokers in 3 racks (r0, r1, r2).

A consumer with client.rack=rN is sent by each partition's leader to broker N (the leader's
Fetch answer names it as preferred_read_replica), broker N serves what is in the object
store (its log says so), and at the end of the uploaded data the consumer goes back to the
leader for the tail: every record is read exactly once. Wire-level: the leader's redirect,
the follower's records and its pointer back to the leader, ListOffsets on a follower.
"""
from __future__ import annotations

import sqlite3
import time

import pytest

from bench.ports import free_port
from confluent_kafka import Consumer, Producer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.protocol.consumer import (FetchResponse, OffsetForLeaderEpochRequest,
                                     OffsetForLeaderEpochResponse)

from clients.e2e_helpers import JavaCli, compile_java
from datapath.wire import WireClient, metric_at

from .kit import leaders, wait_for

pytestmark = pytest.mark.slow
PARTS = 3
NOT_LEADER = 6


def produce(boot: str, start: int, n: int) -> None:
    p = Producer({"bootstrap.servers": boot, "enable.idempotence": True, "acks": "all"})
    for i in range(start, start + n):
        p.produce("near", value=f"v{i}".encode(), partition=i % PARTS)
    assert p.flush(60) == 0


def uploaded(db: str) -> int:
    """Records of the topic committed to the object store (the metadata database's view)."""
    with sqlite3.connect(db) as c:
        return sum(r[0] for r in c.execute("SELECT end_offset FROM s3_streams"))


def follower_log(broker, topic: str = "near") -> set[int]:
    text = broker.log_path.read_text(errors="replace")
    return {int(line.split("partition=")[1].split()[0]) for line in text.splitlines()
            if "serving fetches as a follower" in line and f"topic={topic} " in line}


@pytest.mark.parametrize("metadata_url", ["sqlite"], indirect=True)
def test_consumers_fetch_from_their_rack(cluster_factory, metadata_url, java_classpath):
    mports = [free_port() for _ in range(3)]
    brokers = cluster_factory(3, per_node=lambda n: ["--metrics-listen",
                                                     f"127.0.0.1:{mports[n]}"])
    boot = ",".join(b.bootstrap for b in brokers)
    admin = KafkaAdminClient(bootstrap_servers=brokers[0].bootstrap)
    wait_for(lambda: len(admin.describe_cluster()["brokers"]) == 3, what="3 live brokers")
    time.sleep(0.5)
    admin.create_topics([NewTopic("near", PARTS, 3)])
    led = wait_for(lambda: (lambda d: d if len(d) == PARTS and {n for n, _ in d.values()}
                            == {0, 1, 2} else None)(leaders(admin, "near")),
                   what="one partition led by each broker")
    owner = {n: p for p, (n, _) in led.items()}             # broker -> the partition it leads
    produce(boot, 0, 300)
    db = metadata_url[len("sqlite:///"):]
    wait_for(lambda: uploaded(db) >= 300, what="records uploaded to the object store")

    # -- wire level: the leader of partition P0 (broker 0) sends a consumer of rack r2 to
    # broker 2; broker 2 serves the records, then points back to the leader
    p0 = owner[0]
    with WireClient("127.0.0.1", brokers[0].port) as c:
        req = c.fetch_request("near", 0, partition=p0)
        req.rack_id = "r2"
        pd = c.call(req, FetchResponse, 12).responses[0].partitions[0]
        assert (pd.error_code, pd.preferred_read_replica, pd.records) == (0, 2, None) or \
            (pd.error_code, pd.preferred_read_replica, len(pd.records or b"")) == (0, 2, 0)
        req.rack_id = "r0"          # a consumer in the leader's own rack stays there
        pd = c.call(req, FetchResponse, 12).responses[0].partitions[0]
        assert pd.preferred_read_replica == -1 and pd.records
    with WireClient("127.0.0.1", brokers[2].port) as c:
        req = c.fetch_request("near", 0, partition=p0)
        pd = c.call(req, FetchResponse, 12).responses[0].partitions[0]
        assert pd.error_code == NOT_LEADER              # no rack: not a KIP-392 consumer
        req.rack_id = "r2"
        pd = c.call(req, FetchResponse, 12).responses[0].partitions[0]
        assert pd.error_code == 0 and pd.records and pd.preferred_read_replica == -1
        assert pd.high_watermark == 100
        req = c.fetch_request("near", 100, partition=p0)
        req.rack_id = "r2"
        pd = c.call(req, FetchResponse, 12).responses[0].partitions[0]
        assert (pd.error_code, pd.preferred_read_replica) == (0, 0)   # the tail: the leader
        # ListOffsets and OffsetForLeaderEpoch stay with the leader, as in Kafka
        assert c.list_offsets("near", -1, partition=p0).error_code == NOT_LEADER
        OT = OffsetForLeaderEpochRequest.OffsetForLeaderTopic
        req = OffsetForLeaderEpochRequest(replica_id=-1, topics=[OT(topic="near", partitions=[
            OT.OffsetForLeaderPartition(partition=p0, current_leader_epoch=-1,
                                        leader_epoch=0)])])
        r = c.call(req, OffsetForLeaderEpochResponse, 4).topics[0].partitions[0]
        assert r.error_code == NOT_LEADER
    with WireClient("127.0.0.1", brokers[0].port) as c:
        assert c.list_offsets("near", -1, partition=p0).offset == 100

    # -- confluent-kafka in rack r2: partitions led by 0 and 1 are read from broker 2
    c = Consumer({"bootstrap.servers": boot, "group.id": "near-ck", "client.rack": "r2",
                  "isolation.level": "read_uncommitted", "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "topic.metadata.refresh.interval.ms": 1000})
    c.assign([TopicPartition("near", p, 0) for p in range(PARTS)])
    seen: list[tuple[int, int, bytes]] = []

    def take(n: int) -> bool:
        for m in c.consume(100, 0.5):
            if not m.error():
                seen.append((m.partition(), m.offset(), m.value()))
        return len(seen) >= n
    wait_for(lambda: take(300), timeout=60, what="confluent consumer: 300 records")
    assert follower_log(brokers[2]) == {owner[0], owner[1]}
    assert metric_at(mports[2], "s3kafka_follower_fetch_bytes_total") > 0
    assert metric_at(mports[0], "s3kafka_fetch_redirects_total") > 0
    assert metric_at(mports[0], "s3kafka_follower_fetch_bytes_total") == 0
    # the tail (not uploaded yet) comes from the leaders
    produce(boot, 300, 60)
    wait_for(lambda: take(360), timeout=60, what="confluent consumer: the tail")
    c.close()
    assert sorted(v for _, _, v in seen) == sorted(f"v{i}".encode() for i in range(360))
    assert len({(p, o) for p, o, _ in seen}) == len(seen) == 360

    # -- Java kafka-clients in rack r1, a group: partitions led by 0 and 2 come from broker 1
    wait_for(lambda: uploaded(db) >= 360, what="the tail uploaded too")
    version = sorted(java_classpath)[-1]
    cli = JavaCli(version, compile_java(version, java_classpath[version]))
    out = cli("consume-group", bootstrap=boot, topic="near", group="near-java", count=360,
              client_rack="r1", timeout_ms=60000, timeout=120)
    got = [(r["p"], r["o"], r["v"]) for r in out["records"]]
    assert sorted(v for _, _, v in got) == sorted(f"v{i}" for i in range(360))
    assert len(set(got)) == len(got)
    assert follower_log(brokers[1]) == {owner[0], owner[2]}
    assert follower_log(brokers[0]) == set()
    admin.close()
