"""librdkafka (confluent-kafka) transactional producers against s3kafka.

Commits and aborts across partitions; read_committed consumers never see aborted records and
stop at the last stable offset while a transaction is open; read_uncommitted ones see all.
"""
from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from clients.e2e_helpers import create_topic, unique

pytestmark = pytest.mark.e2e


def txn_producer(bootstrap: str, tid: str, **extra) -> Producer:
    conf = {"bootstrap.servers": bootstrap, "transactional.id": tid, "log_level": 0,
            "linger.ms": 5}
    conf.update(extra)
    p = Producer(conf)
    p.init_transactions(30)
    return p


def consume_all(bootstrap: str, topic: str, partitions: int, isolation: str,
                expect: int | None = None, timeout: float = 20) -> list[str]:
    """Every value of the topic (from the start) as one consumer of ``isolation`` sees it."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("g"),
                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                  "isolation.level": isolation, "log_level": 0})
    c.assign([TopicPartition(topic, i, 0) for i in range(partitions)])
    out: list[str] = []
    deadline = time.monotonic() + timeout
    idle_since = time.monotonic()
    try:
        while time.monotonic() < deadline:
            m = c.poll(0.3)
            if m is None:
                if expect is None and time.monotonic() - idle_since > 3:
                    break
                if expect is not None and len(out) >= expect and time.monotonic() - idle_since > 1:
                    break
                continue
            if m.error():
                continue
            idle_since = time.monotonic()
            out.append(m.value().decode())
    finally:
        c.close()
    return out


def test_commit_and_abort_across_partitions(tbroker):
    topic = unique("rk-txn")
    create_topic(tbroker.bootstrap, topic, 3)
    p = txn_producer(tbroker.bootstrap, unique("rk-tid"))
    p.begin_transaction()
    for i in range(30):
        p.produce(topic, f"c1-{i}".encode(), partition=i % 3)
    p.commit_transaction(30)
    p.begin_transaction()
    for i in range(30):
        p.produce(topic, f"a1-{i}".encode(), partition=i % 3)
    p.flush(30)
    p.abort_transaction(30)
    p.begin_transaction()
    for i in range(30):
        p.produce(topic, f"c2-{i}".encode(), partition=i % 3)
    p.commit_transaction(30)

    committed = consume_all(tbroker.bootstrap, topic, 3, "read_committed", expect=60)
    assert sorted(committed) == sorted([f"c1-{i}" for i in range(30)]
                                       + [f"c2-{i}" for i in range(30)])
    everything = consume_all(tbroker.bootstrap, topic, 3, "read_uncommitted", expect=90)
    assert len(everything) == 90 and any(v.startswith("a1-") for v in everything)


def test_read_committed_stops_at_the_lso(tbroker):
    topic = unique("rk-lso")
    create_topic(tbroker.bootstrap, topic, 1)
    plain = Producer({"bootstrap.servers": tbroker.bootstrap, "log_level": 0})
    plain.produce(topic, b"before")
    plain.flush(10)
    p = txn_producer(tbroker.bootstrap, unique("rk-open"))
    p.begin_transaction()
    p.produce(topic, b"open-txn")
    p.flush(10)
    plain.produce(topic, b"after")  # behind the open transaction: not stable yet
    plain.flush(10)

    c = Consumer({"bootstrap.servers": tbroker.bootstrap, "group.id": unique("g"),
                  "isolation.level": "read_committed", "log_level": 0})
    lo, hi = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
    c.close()
    assert hi == 1  # read_committed ListOffsets latest = the LSO
    assert consume_all(tbroker.bootstrap, topic, 1, "read_committed", expect=1) == ["before"]
    p.commit_transaction(30)
    assert consume_all(tbroker.bootstrap, topic, 1, "read_committed", expect=3) == [
        "before", "open-txn", "after"]


def test_second_instance_fences_the_first(tbroker):
    topic = unique("rk-fence")
    create_topic(tbroker.bootstrap, topic, 1)
    tid = unique("rk-zombie")
    first = txn_producer(tbroker.bootstrap, tid)
    first.begin_transaction()
    first.produce(topic, b"zombie")
    first.flush(10)
    second = txn_producer(tbroker.bootstrap, tid)  # aborts the first one's transaction
    second.begin_transaction()
    second.produce(topic, b"second")
    second.commit_transaction(30)
    with pytest.raises(KafkaException) as info:
        first.commit_transaction(30)
    err = info.value.args[0]
    assert err.fatal() or "fenc" in err.str().lower(), err
    assert consume_all(tbroker.bootstrap, topic, 1, "read_committed", expect=1) == ["second"]
