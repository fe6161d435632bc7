"""Kafka's topic answers (issue 18): keyless records refused by compacted topics; the internal
__consumer_offsets listed as internal, not creatable, not writable; deleted nothing else."""
from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka import errors as kerrors
from kafka.admin import NewTopic as KNewTopic

from clients.e2e_helpers import unique

pytestmark = pytest.mark.e2e


def create(bootstrap: str, name: str, configs: dict[str, str]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, 1, 1, config=configs)])[name].result(30)


def deliver(bootstrap: str, topic: str, key: bytes | None) -> KafkaError | None:
    p = Producer({"bootstrap.servers": bootstrap, "message.timeout.ms": 20_000})
    errs: list = []
    p.produce(topic, value=b"v", key=key, on_delivery=lambda err, msg: errs.append(err))
    assert p.flush(30) == 0
    return errs[0]


def test_librdkafka_keyless_record_refused_by_compacted_topic(abroker):
    compacted, plain = unique("compact"), unique("plain")
    create(abroker.bootstrap, compacted, {"cleanup.policy": "compact"})
    create(abroker.bootstrap, plain, {})
    err = deliver(abroker.bootstrap, compacted, None)
    assert err is not None and err.code() == KafkaError.INVALID_RECORD, err
    assert deliver(abroker.bootstrap, compacted, b"k") is None
    assert deliver(abroker.bootstrap, plain, None) is None
    create(abroker.bootstrap, unique("both"), {"cleanup.policy": "compact,delete"})


def test_kafka_python_keyless_record_refused_by_compacted_topic(abroker):
    compacted = unique("kcompact")
    create(abroker.bootstrap, compacted, {"cleanup.policy": "delete,compact"})
    p = KafkaProducer(bootstrap_servers=abroker.bootstrap, retries=0)
    try:
        with pytest.raises(kerrors.InvalidRecordError):
            p.send(compacted, value=b"v").get(timeout=30)
        assert p.send(compacted, key=b"k", value=b"v").get(timeout=30)
    finally:
        p.close(timeout=10)
    p = KafkaProducer(bootstrap_servers=abroker.bootstrap, compression_type="gzip", retries=0)
    try:   # compressed batches are looked into as well
        with pytest.raises(kerrors.InvalidRecordError):
            p.send(compacted, value=b"v").get(timeout=30)
    finally:
        p.close(timeout=10)


def test_java_compacted_and_internal_topic_answers(java_answers):
    for version, out in java_answers.items():
        assert out["compact_keyless"] == "InvalidRecordException", (version, out)
        assert out["compact_keyed"] == "ok", (version, out)
        assert out["produce_internal"] == "InvalidTopicException", (version, out)
        assert out["create_consumer_offsets"] == "TopicExistsException", (version, out)
        assert out["create_transaction_state"] == "InvalidRequestException", (version, out)
        assert out["list_internal"] is True and out["list_default"] is False, (version, out)


def test_librdkafka_internal_topics(abroker):
    admin = AdminClient({"bootstrap.servers": abroker.bootstrap})
    md = admin.list_topics(timeout=30)
    assert "__consumer_offsets" in md.topics and md.topics["__consumer_offsets"].error is None
    futures = admin.create_topics([NewTopic("__consumer_offsets", 1, 1),
                                   NewTopic("__transaction_state", 1, 1)])
    with pytest.raises(Exception) as exists:
        futures["__consumer_offsets"].result(30)
    assert exists.value.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS
    with pytest.raises(Exception) as invalid:
        futures["__transaction_state"].result(30)
    assert invalid.value.args[0].code() == KafkaError.INVALID_REQUEST
    err = deliver(abroker.bootstrap, "__consumer_offsets", b"k")
    assert err is not None and err.code() == KafkaError.TOPIC_EXCEPTION, err
    err = deliver(abroker.bootstrap, "__transaction_state", b"k")
    assert err is not None and err.code() == KafkaError.TOPIC_EXCEPTION, err
    assert "__transaction_state" not in admin.list_topics(timeout=30).topics   # not auto-created


def test_regex_subscriptions_are_not_confused_by_internal_topics(abroker):
    topic = unique("rx")
    assert deliver(abroker.bootstrap, topic, b"k") is None
    # librdkafka's regex matches internal topics too (as against Kafka): it reads nothing there
    c = Consumer({"bootstrap.servers": abroker.bootstrap, "group.id": unique("rx-g"),
                  "auto.offset.reset": "earliest"})
    c.subscribe([f"^({topic}|__consumer_offsets)$"])
    got, deadline = [], time.monotonic() + 30
    try:
        while time.monotonic() < deadline and not got:
            m = c.poll(0.5)
            if m is not None:
                got.append((m.topic(), m.error()))
    finally:
        c.close()
    assert got == [(topic, None)]
    # kafka-python (like Java) leaves internal topics out of pattern subscriptions and topics()
    k = KafkaConsumer(bootstrap_servers=abroker.bootstrap, group_id=unique("rx-k"),
                      auto_offset_reset="earliest", consumer_timeout_ms=15_000)
    try:
        k.subscribe(pattern="^(__consumer_offsets|" + topic + ")$")
        assert next(k).topic == topic
        assert {tp.topic for tp in k.assignment()} == {topic}
        assert "__consumer_offsets" not in k.topics()
    finally:
        k.close()
    kadmin = KafkaAdminClient(bootstrap_servers=abroker.bootstrap)
    try:
        [desc] = kadmin.describe_topics(["__consumer_offsets"])
        assert desc["is_internal"] is True and desc["error_code"] == 0
        with pytest.raises(kerrors.TopicAlreadyExistsError):
            kadmin.create_topics([KNewTopic("__consumer_offsets", 1, 1)])
    finally:
        kadmin.close()
