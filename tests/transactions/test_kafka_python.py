"""kafka-python transactional producers (with send_offsets_to_transaction) and read_committed
consumers of kafka-python and aiokafka against s3kafka."""
from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from clients.e2e_helpers import create_topic, unique

pytestmark = pytest.mark.e2e


def read_all(bootstrap: str, topic: str, partitions: int, isolation: str,
             idle_s: float = 2.0) -> list[str]:
    c = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation,
                      enable_auto_commit=False, consumer_timeout_ms=int(idle_s * 1000),
                      fetch_max_wait_ms=200)
    tps = [TopicPartition(topic, i) for i in range(partitions)]
    c.assign(tps)
    c.seek_to_beginning(*tps)
    try:
        return [m.value.decode() for m in c]
    finally:
        c.close()


def test_kafka_python_commit_abort_and_offsets(tbroker):
    topic = unique("kp-txn")
    create_topic(tbroker.bootstrap, topic, 2)
    group = unique("kp-group")
    p = KafkaProducer(bootstrap_servers=tbroker.bootstrap, transactional_id=unique("kp-tid"))
    try:
        p.init_transactions()
        p.begin_transaction()
        for i in range(10):
            p.send(topic, f"c-{i}".encode(), partition=i % 2)
        p.send_offsets_to_transaction({TopicPartition(topic, 0): _meta(7)}, group)
        p.commit_transaction()
        p.begin_transaction()
        for i in range(10):
            p.send(topic, f"a-{i}".encode(), partition=i % 2)
        p.send_offsets_to_transaction({TopicPartition(topic, 0): _meta(99)}, group)
        p.flush()
        p.abort_transaction()
    finally:
        p.close(timeout=10)
    assert sorted(read_all(tbroker.bootstrap, topic, 2, "read_committed")) == sorted(
        f"c-{i}" for i in range(10))
    assert len(read_all(tbroker.bootstrap, topic, 2, "read_uncommitted")) == 20
    c = KafkaConsumer(bootstrap_servers=tbroker.bootstrap, group_id=group,
                      enable_auto_commit=False)
    try:
        # the committed transaction's offset is the group's; the aborted one's never was
        assert c.committed(TopicPartition(topic, 0)) == 7
    finally:
        c.close()


def _meta(offset: int):
    from kafka.structs import OffsetAndMetadata
    try:
        return OffsetAndMetadata(offset, "", -1)
    except TypeError:
        return OffsetAndMetadata(offset, "")


def test_kafka_python_read_committed_stops_at_lso(tbroker):
    topic = unique("kp-lso")
    create_topic(tbroker.bootstrap, topic, 1)
    p = KafkaProducer(bootstrap_servers=tbroker.bootstrap, transactional_id=unique("kp-open"))
    try:
        p.init_transactions()
        p.begin_transaction()
        p.send(topic, b"pending")
        p.flush()
        c = KafkaConsumer(bootstrap_servers=tbroker.bootstrap, isolation_level="read_committed")
        try:
            tp = TopicPartition(topic, 0)
            assert c.end_offsets([tp])[tp] == 0  # the LSO, not the high watermark (1)
        finally:
            c.close()
        assert read_all(tbroker.bootstrap, topic, 1, "read_committed", idle_s=1.5) == []
        p.commit_transaction()
    finally:
        p.close(timeout=10)
    assert read_all(tbroker.bootstrap, topic, 1, "read_committed") == ["pending"]
