"""Produce/consume through unmodified client libraries against a running broker."""
from __future__ import annotations

import asyncio
import uuid

import pytest

from .wire import WireClient

pytestmark = pytest.mark.e2e


def _topic(prefix: str = "dpc") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _create(broker, name: str, configs: dict[str, str] | None = None, partitions: int = 1) -> str:
    with WireClient(broker.host, broker.port) as c:
        c.create_topic(name, partitions=partitions, configs=configs)
    return name


@pytest.mark.parametrize("acks", [0, 1, "all"])
def test_kafka_python_acks(module_broker, acks):
    from kafka import KafkaConsumer, KafkaProducer

    t = _create(module_broker, _topic())
    prod = KafkaProducer(bootstrap_servers=module_broker.bootstrap, acks=acks,
                         enable_idempotence=False, linger_ms=5)
    futs = [prod.send(t, value=b"m%d" % i) for i in range(20)]
    prod.flush(30)
    if acks != 0:
        offsets = [f.get(30).offset for f in futs]
        assert offsets == list(range(20))
    prod.close(10)
    cons = KafkaConsumer(t, bootstrap_servers=module_broker.bootstrap,
                         auto_offset_reset="earliest", enable_auto_commit=False,
                         consumer_timeout_ms=15000, group_id=None)
    values = []
    for msg in cons:
        values.append(msg.value)
        if len(values) == 20:
            break
    cons.close()
    assert values == [b"m%d" % i for i in range(20)]


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_confluent_kafka_codecs(module_broker, codec):
    from confluent_kafka import Consumer, Producer

    t = _create(module_broker, _topic())
    p = Producer({"bootstrap.servers": module_broker.bootstrap, "compression.type": codec,
                  "enable.idempotence": True, "linger.ms": 5})
    for i in range(50):
        p.produce(t, value=b"value-%d" % i * 3, key=b"k%d" % i)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": module_broker.bootstrap, "group.id": _topic("g"),
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([t])
    got = []
    for _ in range(300):
        m = c.poll(0.2)
        if m is None:
            if len(got) >= 50:
                break
            continue
        assert m.error() is None, m.error()
        got.append((m.offset(), m.key(), m.value()))
        if len(got) == 50:
            break
    c.close()
    assert got == [(i, b"k%d" % i, b"value-%d" % i * 3) for i in range(50)]


def test_confluent_log_append_time_and_offsets_for_times(module_broker):
    from confluent_kafka import (TIMESTAMP_LOG_APPEND_TIME, Consumer, Producer,
                                 TopicPartition)

    t = _create(module_broker, _topic(), configs={"message.timestamp.type": "LogAppendTime"})
    p = Producer({"bootstrap.servers": module_broker.bootstrap})
    for i in range(5):
        p.produce(t, value=b"x%d" % i, timestamp=1000 + i)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": module_broker.bootstrap, "group.id": _topic("g"),
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.assign([TopicPartition(t, 0, 0)])
    msgs = []
    for _ in range(100):
        m = c.poll(0.2)
        if m is not None and m.error() is None:
            msgs.append(m)
        if len(msgs) == 5:
            break
    assert len(msgs) == 5
    ts_type, ts = msgs[0].timestamp()
    assert ts_type == TIMESTAMP_LOG_APPEND_TIME and ts > 1_600_000_000_000
    # the broker's time, not the producer's 1000+i, is what ListOffsets indexes
    (found,) = c.offsets_for_times([TopicPartition(t, 0, ts)], timeout=10)
    assert found.offset == 0
    (none,) = c.offsets_for_times([TopicPartition(t, 0, ts + 10**9)], timeout=10)
    assert none.offset == -1
    lo, hi = c.get_watermark_offsets(TopicPartition(t, 0), timeout=10)
    assert (lo, hi) == (0, 5)
    c.close()


def test_kafka_python_idempotent_and_offsets_for_times(module_broker):
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    t = _create(module_broker, _topic())
    prod = KafkaProducer(bootstrap_servers=module_broker.bootstrap, enable_idempotence=True,
                         acks="all")
    for i in range(10):
        prod.send(t, value=b"i%d" % i, timestamp_ms=10_000 + i * 100)
    prod.flush(30)
    prod.close(10)
    cons = KafkaConsumer(bootstrap_servers=module_broker.bootstrap, enable_auto_commit=False)
    tp = TopicPartition(t, 0)
    res = cons.offsets_for_times({tp: 10_250})
    assert res[tp].offset == 3 and res[tp].timestamp == 10_300
    assert cons.beginning_offsets([tp])[tp] == 0
    assert cons.end_offsets([tp])[tp] == 10
    cons.close()


def test_aiokafka_round_trip(module_broker):
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    t = _create(module_broker, _topic())

    async def run() -> list[bytes]:
        prod = AIOKafkaProducer(bootstrap_servers=module_broker.bootstrap, acks="all",
                                compression_type="gzip")
        await prod.start()
        try:
            for i in range(10):
                await prod.send_and_wait(t, b"a%d" % i)
        finally:
            await prod.stop()
        cons = AIOKafkaConsumer(t, bootstrap_servers=module_broker.bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
        await cons.start()
        out: list[bytes] = []
        try:
            while len(out) < 10:
                batch = await asyncio.wait_for(cons.getmany(timeout_ms=1000), 30)
                for msgs in batch.values():
                    out.extend(m.value for m in msgs)
        finally:
            await cons.stop()
        return out

    assert asyncio.run(run()) == [b"a%d" % i for i in range(10)]


def test_confluent_admin_list_offsets_and_delete_records(module_broker):
    from confluent_kafka import Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    t = _create(module_broker, _topic())
    p = Producer({"bootstrap.servers": module_broker.bootstrap})
    for i in range(6):
        p.produce(t, value=b"d%d" % i, timestamp=5000 + i * 10)
        p.flush(30)  # one batch per record: DeleteRecords then cuts between batches
    admin = AdminClient({"bootstrap.servers": module_broker.bootstrap})
    tp = TopicPartition(t, 0)

    def offsets(spec) -> int:
        return admin.list_offsets({tp: spec})[tp].result(30).offset

    assert offsets(OffsetSpec.earliest()) == 0
    assert offsets(OffsetSpec.latest()) == 6
    assert offsets(OffsetSpec.for_timestamp(5025)) == 3
    assert offsets(OffsetSpec.max_timestamp()) == 5
    res = admin.delete_records([TopicPartition(t, 0, 4)])[TopicPartition(t, 0, 4)].result(30)
    assert res.low_watermark == 4
    assert offsets(OffsetSpec.earliest()) == 4


def test_kafka_python_admin_delete_records(module_broker):
    from kafka import KafkaAdminClient, KafkaProducer, TopicPartition

    t = _create(module_broker, _topic())
    prod = KafkaProducer(bootstrap_servers=module_broker.bootstrap, linger_ms=0)
    for i in range(4):
        prod.send(t, b"r%d" % i).get(30)
    prod.close(10)
    admin = KafkaAdminClient(bootstrap_servers=module_broker.bootstrap)
    tp = TopicPartition(t, 0)
    res = admin.delete_records({tp: 2})
    assert res[tp]["low_watermark"] == 2
    assert admin.list_partition_offsets({tp: -2})[tp].offset == 2
    assert admin.list_partition_offsets({tp: -1})[tp].offset == 4
    admin.close()


@pytest.mark.parametrize("hard", [False, True], ids=["sigterm", "kill9"])
def test_idempotent_librdkafka_producer_across_restart(broker_factory, hard):
    """One producer instance keeps its producer id and sequences across a broker restart:
    the broker's restored state accepts the continuation and nothing is duplicated."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from .conftest import SMALL_WAL

    broker = broker_factory(SMALL_WAL)
    t = _create(broker, _topic())
    errors: list = []
    p = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True,
                  "linger.ms": 5, "message.timeout.ms": 60000,
                  "reconnect.backoff.max.ms": 500})

    def report(err, msg):
        if err is not None:
            errors.append(err)

    for i in range(100):
        p.produce(t, value=b"before-%d" % i, on_delivery=report)
    assert p.flush(30) == 0
    broker.restart(hard=hard)
    for i in range(100):
        p.produce(t, value=b"after-%d" % i, on_delivery=report)
    assert p.flush(60) == 0
    assert errors == []
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": _topic("g"),
                  "enable.auto.commit": False})
    c.assign([TopicPartition(t, 0, 0)])
    values = []
    for _ in range(300):
        for m in c.consume(200, 0.2):
            if m.error() is None:
                values.append(m.value())
        if len(values) >= 200:
            break
    c.close()
    assert values == [b"before-%d" % i for i in range(100)] + [b"after-%d" % i for i in range(100)]


def test_kill9_during_idempotent_produce_loses_and_duplicates_nothing(broker_factory):
    """kill -9 while batches are in flight: after restart the producer's retries are either
    deduplicated (the batch was durable) or appended (it was not) - every acknowledged value
    is there exactly once, in order."""
    import threading

    from confluent_kafka import Consumer, Producer, TopicPartition

    from .conftest import SMALL_WAL

    broker = broker_factory(SMALL_WAL)
    t = _create(broker, _topic())
    acked: list[bytes] = []
    errors: list = []
    lock = threading.Lock()

    def report(err, msg):
        with lock:
            (errors if err is not None else acked).append(err or msg.value())

    p = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True,
                  "linger.ms": 2, "batch.num.messages": 50, "message.timeout.ms": 120000,
                  "reconnect.backoff.max.ms": 500})
    n = 3000
    for i in range(n):
        p.produce(t, value=b"v-%05d" % i, on_delivery=report)
        p.poll(0)
        if i == n // 3:
            p.flush(30)  # some acknowledged data before the crash
        if i == n // 2:
            broker.kill()  # the rest of the first half is in flight or queued
            broker.start()
    assert p.flush(120) == 0
    assert errors == []
    assert sorted(acked) == [b"v-%05d" % i for i in range(n)]
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": _topic("g"),
                  "enable.auto.commit": False})
    c.assign([TopicPartition(t, 0, 0)])
    values: list[bytes] = []
    for _ in range(600):
        for m in c.consume(1000, 0.2):
            if m.error() is None:
                values.append(m.value())
        if len(values) >= n:
            break
    c.close()
    assert values == [b"v-%05d" % i for i in range(n)]
