"""Groups that subscribe right after CreateTopics read the topic (issue 16/17 finding: a
group that never reads).

A broker learns of a topic another broker created at its next metadata poll. Until then its
Metadata answered UNKNOWN_TOPIC_OR_PARTITION, so a consumer joining a group right after
CreateTopics could be assigned nothing and depend on a metadata-triggered rebalance - in
which kafka-python 3.0.12 can hang for good (docs/groups.md: a poll that times out while the
leader's SyncGroup is in flight leaves it never applying the assignment nor heartbeating).
Now a broker asked for a topic it does not know reads the metadata store before answering.

Three brokers (group.initial.rebalance.delay.ms 3000, Kafka's default). (1) Topics created on one broker are in the very next Metadata answer of the
other two, with a leader for every partition. (2) Groups of confluent-kafka (two members) and
kafka-python (one member, short polls) subscribe at once after each CreateTopics, members
bootstrapped on brokers other than the creating one, and read every record.
"""
from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer, Producer
from kafka import KafkaConsumer
from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from datapath.wire import WireClient

from .kit import wait_for

pytestmark = pytest.mark.slow
PARTITIONS = 6
RECORDS = 60


def metadata(client: WireClient, topic: str) -> tuple[int, list[tuple[int, int, int]]]:
    """(topic error, [(partition, error, leader)]) as one broker answers."""
    T = MetadataRequest.MetadataRequestTopic
    r = client.call(MetadataRequest(topics=[T(name=topic)], allow_auto_topic_creation=False,
                                    include_topic_authorized_operations=False),
                    MetadataResponse, 12)
    t = r.topics[0]
    return t.error_code, sorted((p.partition_index, p.error_code, p.leader_id)
                                for p in t.partitions)


def confluent_member(boot: str, topic: str, group: str, got: set, stop: threading.Event
                     ) -> None:
    c = Consumer({"bootstrap.servers": boot, "group.id": group, "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "session.timeout.ms": 10000,
                  "heartbeat.interval.ms": 1000, "topic.metadata.refresh.interval.ms": 2000})
    c.subscribe([topic])
    try:
        while not stop.is_set():
            for m in c.consume(100, timeout=0.2):
                if not m.error():
                    got.add((m.partition(), m.offset()))
    finally:
        c.close()


def kafka_python_member(boot: str, topic: str, group: str, got: set, stop: threading.Event
                        ) -> None:
    c = KafkaConsumer(bootstrap_servers=boot, group_id=group, enable_auto_commit=False,
                      auto_offset_reset="earliest", session_timeout_ms=10000,
                      heartbeat_interval_ms=1000, metadata_max_age_ms=2000)
    c.subscribe([topic])
    try:
        while not stop.is_set():
            for tp, msgs in c.poll(timeout_ms=200).items():   # short polls, as the chaos suite
                got.update((tp.partition, m.offset) for m in msgs)
    finally:
        c.close()


def test_groups_subscribed_right_after_create_topics_read(cluster_factory, metadata_url):
    if not metadata_url.startswith("sqlite"):
        pytest.skip("the same code path on PostgreSQL; SQLite keeps this lean")
    # Kafka's default initial rebalance delay (tests default to 0): kafka-python 3.0.12 sends
    # its first JoinGroup before it asked for the subscribed topic's metadata, so with no
    # delay its leader assigns nothing and a metadata-triggered rebalance follows, in which it
    # can hang whatever the broker answers (docs/groups.md); with the delay it has the
    # metadata when the JoinGroup is answered
    brokers = cluster_factory(3, extra=("--group-initial-rebalance-delay-ms", "3000"))
    boot = ",".join(b.bootstrap for b in brokers)
    clients = [WireClient("127.0.0.1", int(b.bootstrap.rsplit(":", 1)[1])) for b in brokers]
    try:
        wait_for(lambda: all(len(c.call(MetadataRequest(
            topics=[], allow_auto_topic_creation=False,
            include_topic_authorized_operations=False), MetadataResponse, 12).brokers) == 3
            for c in clients), what="every broker lists 3 live brokers")
        # (1) the topic is in the next Metadata answer of every other broker
        for i in range(6):
            topic, creator = f"meta{i}", i % 3
            clients[creator].create_topic(topic, PARTITIONS)
            for j, c in enumerate(clients):
                if j == creator:
                    continue
                err, parts = metadata(c, topic)
                assert err == 0 and len(parts) == PARTITIONS, (topic, j, err, parts)
                assert all(e == 0 and leader >= 0 for _, e, leader in parts), (topic, j, parts)
    finally:
        for c in clients:
            c.close()

    # (2) groups joining right after CreateTopics read every record
    short = []
    for i in range(3):
        topic, creator = f"fresh{i}", i % 3
        others = [b.bootstrap for k, b in enumerate(brokers) if k != creator]
        with WireClient("127.0.0.1", int(brokers[creator].bootstrap.rsplit(":", 1)[1])) as c:
            c.create_topic(topic, PARTITIONS)
        stop = threading.Event()
        ck: set = set()
        kp: set = set()
        threads = [threading.Thread(target=confluent_member,
                                    args=(others[0], topic, f"ck{i}", ck, stop)),
                   threading.Thread(target=confluent_member,
                                    args=(others[1], topic, f"ck{i}", ck, stop)),
                   threading.Thread(target=kafka_python_member,
                                    args=(others[i % 2], topic, f"kp{i}", kp, stop))]
        for t in threads:
            t.start()
        try:
            p = Producer({"bootstrap.servers": boot})
            for n in range(RECORDS):
                p.produce(topic, value=b"v%d" % n, partition=n % PARTITIONS)
            assert p.flush(30) == 0
            end = time.monotonic() + 60
            while time.monotonic() < end and (len(ck) < RECORDS or len(kp) < RECORDS):
                time.sleep(0.2)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        if len(ck) < RECORDS or len(kp) < RECORDS:
            short.append((topic, len(ck), len(kp)))
    assert not short, f"groups that did not read everything (topic, confluent, kafka-python " \
                      f"records read of {RECORDS}): {short}"
