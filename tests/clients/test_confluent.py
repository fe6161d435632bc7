"""confluent-kafka (librdkafka), unmodified, against s3kafka."""
from __future__ import annotations

import time

import pytest
from confluent_kafka import (OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer,
                             TopicPartition)
from confluent_kafka.admin import (AdminClient, ConfigResource, NewPartitions, NewTopic,
                                   OffsetSpec, ResourceType)

from clients.e2e_helpers import ACKS, CODECS, group_of_three_then_resume, unique

pytestmark = pytest.mark.e2e
N = 20


def produce(bootstrap: str, topic: str, values: list[str], acks: str, codec: str) -> list:
    """Produce to partition 0 and return the delivery reports (errors raise)."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": acks, "compression.type": codec,
                  "enable.idempotence": acks == "all", "linger.ms": 5})
    reports: list = []
    for v in values:
        p.produce(topic, value=v.encode(), key=v.encode(), partition=0,
                  on_delivery=lambda err, msg: reports.append((err, msg)))
    assert p.flush(30) == 0
    assert [e for e, _ in reports if e is not None] == []
    return [m for _, m in reports]


def consume_partition(bootstrap: str, topic: str, count: int, partition: int = 0) -> list:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("assign"),
                  "enable.auto.commit": False})
    try:
        c.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
        out: list = []
        deadline = time.monotonic() + 30
        while len(out) < count and time.monotonic() < deadline:
            for m in c.consume(500, 0.5):
                if m.error() is None:
                    out.append(m)
        return out
    finally:
        c.close()


def test_produce_every_acks_and_codec(cbroker, topic_name):
    for acks in ACKS:
        for codec in CODECS:
            msgs = produce(cbroker.bootstrap, topic_name,
                           [f"{acks}-{codec}-{i}" for i in range(N)], acks, codec)
            assert len(msgs) == N
            if acks != "0":
                offs = [m.offset() for m in msgs]
                assert offs == sorted(offs) and len(set(offs)) == N
    total = N * len(ACKS) * len(CODECS)
    got = consume_partition(cbroker.bootstrap, topic_name, total)
    assert [m.offset() for m in got] == list(range(total))
    assert {m.value().decode() for m in got} == {
        f"{a}-{c}-{i}" for a in ACKS for c in CODECS for i in range(N)}


class Member:
    """A librdkafka group member with quick session timeouts."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                           "session.timeout.ms": 6000, "heartbeat.interval.ms": 300,
                           "auto.offset.reset": "earliest", "enable.auto.commit": False,
                           "fetch.wait.max.ms": 200})
        self.c.subscribe([topic])

    def poll_once(self) -> list[str]:
        return [m.value().decode() for m in self.c.consume(100, 0.2) if m.error() is None]

    def assignment(self) -> set[int]:
        return {tp.partition for tp in self.c.assignment()}

    def close(self) -> None:
        try:
            self.c.commit(asynchronous=False)
        except KafkaException as e:
            if e.args[0].code() != KafkaError._NO_OFFSET:
                raise
        self.c.close()


def test_group_of_three_rebalances_then_resumes_after_restart(cbroker, topic_name):
    admin = AdminClient({"bootstrap.servers": cbroker.bootstrap})
    admin.create_topics([NewTopic(topic_name, 6, 1)])[topic_name].result(30)
    group_of_three_then_resume(cbroker, topic_name,
                               lambda group: Member(cbroker.bootstrap, group, topic_name))


def test_admin_operations(cbroker, topic_name):
    admin = AdminClient({"bootstrap.servers": cbroker.bootstrap})
    admin.create_topics([NewTopic(topic_name, 2, 1, config={"retention.ms": "3600000"})]
                        )[topic_name].result(30)
    with pytest.raises(KafkaException) as exc:
        admin.create_topics([NewTopic(topic_name, 2, 1)])[topic_name].result(30)
    assert exc.value.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS
    md = admin.list_topics(timeout=30)
    assert len(md.topics[topic_name].partitions) == 2

    admin.create_partitions([NewPartitions(topic_name, 3)])[topic_name].result(30)
    assert len(admin.list_topics(topic_name, timeout=30).topics[topic_name].partitions) == 3

    produce(cbroker.bootstrap, topic_name, [f"v{i}" for i in range(10)], "all", "none")
    tp = TopicPartition(topic_name, 0)
    latest = admin.list_offsets({tp: OffsetSpec.latest()})[tp].result(30)
    earliest = admin.list_offsets({tp: OffsetSpec.earliest()})[tp].result(30)
    assert (earliest.offset, latest.offset) == (0, 10)
    deleted = admin.delete_records([TopicPartition(topic_name, 0, 4)])
    assert deleted[tp].result(30).low_watermark == 4
    assert admin.list_offsets({tp: OffsetSpec.earliest()})[tp].result(30).offset == 4

    res = ConfigResource(ResourceType.TOPIC, topic_name)
    cfg = admin.describe_configs([res])[res].result(30)
    assert cfg["retention.ms"].value == "3600000"
    assert cfg["cleanup.policy"].value == "delete"

    # groups: a committed offset shows up in list/describe and the offsets API
    group = unique("adm")
    c = Consumer({"bootstrap.servers": cbroker.bootstrap, "group.id": group})
    c.commit(offsets=[TopicPartition(topic_name, 0, 6)], asynchronous=False)
    c.close()
    listed = admin.list_consumer_groups().result(30)
    assert group in {g.group_id for g in listed.valid}
    from confluent_kafka import ConsumerGroupTopicPartitions
    offs = admin.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group, [TopicPartition(topic_name, 0)])])[group].result(30)
    assert [(t.partition, t.offset) for t in offs.topic_partitions] == [(0, 6)]
    admin.delete_consumer_groups([group])[group].result(30)

    admin.delete_topics([topic_name])[topic_name].result(30)
    deadline = time.monotonic() + 10
    while topic_name in admin.list_topics(timeout=30).topics and time.monotonic() < deadline:
        time.sleep(0.1)
    assert topic_name not in admin.list_topics(timeout=30).topics
