"""Authorized operations are returned when asked (KIP-430): with no authorizer, every
operation valid for the resource type, as Kafka reports; "not requested" stays null."""
from __future__ import annotations

import pytest
from confluent_kafka import Consumer, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from kafka import KafkaAdminClient

from clients.e2e_helpers import unique

pytestmark = pytest.mark.e2e

CLUSTER = ["ALTER", "ALTER_CONFIGS", "CLUSTER_ACTION", "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS",
           "IDEMPOTENT_WRITE"]
TOPIC = ["ALTER", "ALTER_CONFIGS", "CREATE", "DELETE", "DESCRIBE", "DESCRIBE_CONFIGS", "READ",
         "WRITE"]
GROUP = ["DELETE", "DESCRIBE", "READ"]


@pytest.fixture(scope="module")
def topic_and_group(abroker) -> tuple[str, str]:
    topic, group = unique("ops"), unique("ops-g")
    admin = AdminClient({"bootstrap.servers": abroker.bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    c = Consumer({"bootstrap.servers": abroker.bootstrap, "group.id": group})
    c.commit(offsets=[TopicPartition(topic, 0, 0)], asynchronous=False)
    c.close()
    return topic, group


def names(ops) -> list[str] | None:
    return None if ops is None else sorted(o.name for o in ops)


def test_librdkafka_authorized_operations(abroker, topic_and_group):
    topic, group = topic_and_group
    a = AdminClient({"bootstrap.servers": abroker.bootstrap})
    assert names(a.describe_cluster(include_authorized_operations=True)
                 .result(30).authorized_operations) == CLUSTER
    assert a.describe_cluster().result(30).authorized_operations is None
    assert names(a.describe_topics(TopicCollection([topic]), include_authorized_operations=True)
                 [topic].result(30).authorized_operations) == TOPIC
    assert a.describe_topics(TopicCollection([topic]))[topic].result(30) \
        .authorized_operations is None
    assert names(a.describe_consumer_groups([group], include_authorized_operations=True)
                 [group].result(30).authorized_operations) == GROUP
    assert a.describe_consumer_groups([group])[group].result(30).authorized_operations is None


def test_kafka_python_authorized_operations(abroker, topic_and_group):
    _, group = topic_and_group
    a = KafkaAdminClient(bootstrap_servers=abroker.bootstrap)
    try:
        assert sorted(a.describe_cluster()["authorized_operations"]) == CLUSTER
        got = a.describe_groups([group], include_authorized_operations=True)[group]
        assert sorted(got["authorized_operations"]) == GROUP
    finally:
        a.close()


def test_java_authorized_operations(java_answers):
    for version, out in java_answers.items():
        assert out["cluster_ops"] == CLUSTER, (version, out)
        assert out["topic_ops"] == TOPIC, (version, out)      # 3.9: Metadata, 4.3: KIP-966
        assert out["group_ops"] == GROUP, (version, out)


def test_metadata_authorized_operations_over_the_wire(abroker, topic_and_group):
    """Metadata v8-v10 carries cluster operations, v8+ topic operations (bit sets decoded)."""
    import protocol
    from datapath.wire import WireClient
    from kafka.protocol.metadata import MetadataRequest

    topic, _ = topic_and_group
    c = WireClient(abroker.host, abroker.port, timeout=30, client_id="ops")
    try:
        for v in (8, 10, 12, 13):
            for asked in (True, False):
                kw = {"include_cluster_authorized_operations": asked} if v <= 10 else {}
                req = MetadataRequest(topics=[MetadataRequest.MetadataRequestTopic(name=topic)],
                                      allow_auto_topic_creation=False,
                                      include_topic_authorized_operations=asked, **kw)
                c.send(req, v)
                _, resp = protocol.parse_response(3, v, c.recv_frame())
                ops = resp.topics[0].authorized_operations
                assert (ops == {3, 4, 5, 6, 7, 8, 10, 11}) if asked else ops is None, (v, ops)
                if v <= 10:
                    cops = resp.authorized_operations
                    assert (cops == {5, 7, 8, 9, 10, 11, 12}) if asked else cops is None
    finally:
        c.close()
