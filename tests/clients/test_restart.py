"""Restarts keep everything acknowledged (issue #2, "Done when" 3).

After a graceful stop (SIGTERM) and after a crash (SIGKILL) the broker must still have every
acknowledged record at its original offset, every committed group offset, every topic, and the
idempotent producer state: a batch retried after the restart is answered with its original
offsets instead of being appended again.
"""
from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.record import MemoryRecordsBuilder
from kafka.structs import OffsetAndMetadata

from clients.e2e_helpers import CLIENT_BROKER_ARGS, kp_poll_records
from datapath.wire import WireClient

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("hard", [False, True],
                                                       ids=["sigterm", "kill9"])]
PRODUCE_VERSION = 9          # flexible encoding, what current clients send
INIT_PID_VERSION = 4
NONE, OUT_OF_ORDER_SEQUENCE_NUMBER = 0, 45


def idempotent_batch(pid: int, epoch: int, seq: int, values: list[bytes]) -> bytes:
    b = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20,
                             producer_id=pid, producer_epoch=epoch, base_sequence=seq)
    now = int(time.time() * 1000)
    for v in values:
        b.append(now, None, v)
    b.close()
    return bytes(b.buffer())


def produce(client: WireClient, topic: str, batch: bytes) -> tuple[int, int]:
    """Send one batch to partition 0 with acks=all; return (error_code, base_offset)."""
    part = client.produce(topic, batch, partition=0, acks=-1, version=PRODUCE_VERSION)
    return part.error_code, part.base_offset


def consume_all(bootstrap: str, topic: str, partitions: int, expected: int) -> list:
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                      auto_offset_reset="earliest", consumer_timeout_ms=3000)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        out = kp_poll_records(c, expected)
        # one more poll: anything beyond `expected` would be a duplicate
        for recs in c.poll(timeout_ms=500).values():
            out.extend(recs)
        return out
    finally:
        c.close()


def test_retried_batch_after_restart_is_deduplicated(broker_factory, hard):
    broker = broker_factory(CLIENT_BROKER_ARGS)
    topic = "idem"
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()

    # raw requests: full control over what is (re)sent, unlike a client library that hides retries
    raw = WireClient(broker.host, broker.port, timeout=30, client_id="raw-restart-test")
    pid, epoch = raw.init_producer_id(INIT_PID_VERSION)
    first = idempotent_batch(pid, epoch, 0, [b"a0", b"a1", b"a2", b"a3", b"a4"])
    second = idempotent_batch(pid, epoch, 5, [b"b0", b"b1", b"b2"])
    assert produce(raw, topic, first) == (NONE, 0)
    assert produce(raw, topic, second) == (NONE, 5)
    raw.close()

    broker.restart(hard=hard)

    raw = WireClient(broker.host, broker.port, timeout=30, client_id="raw-restart-test")
    # the client never saw the acks (say), so it retries the identical batches
    assert produce(raw, topic, second) == (NONE, 5)
    assert produce(raw, topic, first) == (NONE, 0)
    # the sequence continues where it was; a gap is refused
    assert produce(raw, topic, idempotent_batch(pid, epoch, 8, [b"c0"])) == (NONE, 8)
    err, _ = produce(raw, topic, idempotent_batch(pid, epoch, 20, [b"gap"]))
    assert err == OUT_OF_ORDER_SEQUENCE_NUMBER
    raw.close()

    recs = consume_all(broker.bootstrap, topic, 1, 9)
    assert [(r.offset, r.value) for r in recs] == list(enumerate(
        [b"a0", b"a1", b"a2", b"a3", b"a4", b"b0", b"b1", b"b2", b"c0"]))


def test_restart_keeps_records_offsets_topics_and_commits(broker_factory, hard):
    broker = broker_factory(CLIENT_BROKER_ARGS)
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic("explicit", 3, 1, topic_configs={"retention.ms": "7200000"})])
    admin.close()

    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", linger_ms=2)
    acked: dict[tuple[str, int, int], bytes] = {}
    futures = []
    for i in range(150):
        topic = "explicit" if i % 3 else "autocreated"
        v = f"{topic}-{i}".encode()
        futures.append((v, producer.send(topic, value=v)))
    producer.flush(30)
    for v, f in futures:
        md = f.get(30)
        acked[(md.topic, md.partition, md.offset)] = v
    producer.close()

    group = "restart-group"
    committed = {TopicPartition("explicit", 0): 7, TopicPartition("explicit", 2): 3,
                 TopicPartition("autocreated", 0): 11}
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group,
                      enable_auto_commit=False)
    c.assign(list(committed))
    c.commit({tp: OffsetAndMetadata(o, "meta", -1) for tp, o in committed.items()})
    c.close()

    broker.restart(hard=hard)

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        assert {"explicit", "autocreated"} <= set(admin.list_topics())
        descr = {t["name"]: t for t in admin.describe_topics(["explicit"])}
        assert len(descr["explicit"]["partitions"]) == 3
    finally:
        admin.close()

    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group,
                      enable_auto_commit=False)
    try:
        assert {tp: c.committed(tp) for tp in committed} == committed
    finally:
        c.close()

    by_topic: dict[str, int] = {}
    for (t, _, _) in acked:
        by_topic[t] = by_topic.get(t, 0) + 1
    seen: dict[tuple[str, int, int], bytes] = {}
    for t, parts in (("explicit", 3), ("autocreated", 1)):
        for r in consume_all(broker.bootstrap, t, parts, by_topic[t]):
            key = (r.topic, r.partition, r.offset)
            assert key not in seen, f"duplicate {key}"
            seen[key] = r.value
    assert seen == acked

    # the broker keeps working after the restart: a new write lands after the old ones
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
    md = producer.send("autocreated", value=b"after").get(30)
    producer.close()
    assert md.offset == by_topic["autocreated"]


def test_every_ack_survives_a_stop_under_load(broker_factory, hard):
    """A producer is mid-stream (acks=all, many batches in flight) when the broker is stopped
    or killed: every record it got an acknowledgement for is there after the restart, at the
    acknowledged offset."""
    from confluent_kafka import Producer

    broker = broker_factory(CLIENT_BROKER_ARGS)
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic("load", 2, 1)])
    admin.close()
    acked: dict[tuple[int, int], bytes] = {}
    failed = 0

    def report(err, msg) -> None:
        nonlocal failed
        if err is None:
            acked[(msg.partition(), msg.offset())] = msg.value()
        else:
            failed += 1

    p = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all", "linger.ms": 1,
                  "message.timeout.ms": 5000, "enable.idempotence": False,
                  "reconnect.backoff.max.ms": 200})
    i = 0
    stopped = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            p.produce("load", value=b"r%07d" % i, on_delivery=report)
            i += 1
        except BufferError:
            p.poll(0.01)
        p.poll(0)
        if not stopped and len(acked) >= 3000:
            (broker.kill if hard else broker.stop)()
            stopped = True
            break
    assert stopped, f"only {len(acked)} acks within the time limit"
    p.flush(15)           # everything still in flight fails (broker down) or was acked before
    sent = i
    broker.start()

    seen: dict[tuple[int, int], bytes] = {}
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False,
                      auto_offset_reset="earliest")
    try:
        tps = [TopicPartition("load", part) for part in (0, 1)]
        end = c.end_offsets(tps)
        c.assign(tps)
        c.seek_to_beginning(*tps)
        want = sum(end.values())
        limit = time.monotonic() + 30
        while len(seen) < want and time.monotonic() < limit:
            for recs in c.poll(timeout_ms=500).values():
                for r in recs:
                    seen[(r.partition, r.offset)] = r.value
    finally:
        c.close()
    missing = {k: v for k, v in acked.items() if seen.get(k) != v}
    assert not missing, f"{len(missing)} acknowledged records lost or moved " \
                        f"(sent {sent}, acked {len(acked)}, failed {failed}): " \
                        f"{sorted(missing.items())[:5]}"


def test_restart_with_s3_object_store(broker_factory, s3_endpoint, hard):
    """Same guarantee with the production object store (moto S3): records uploaded to S3
    before the restart are read back, at their offsets, by an unmodified consumer."""
    import uuid

    import boto3
    bucket = f"s3kafka-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint.url, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket=bucket)
    store = (f"s3://{bucket}/kafka?endpoint_url={s3_endpoint.url}&region=us-east-1"
             "&access_key_id=testing&secret_access_key=testing")
    broker = broker_factory([*CLIENT_BROKER_ARGS, "--object-store", store,
                             "--upload-interval-s", "0.2", "--upload-threshold-bytes", "4096"])
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", linger_ms=2)
    futs = [producer.send("s3topic", value=b"s3-%05d" % i) for i in range(500)]
    producer.flush(30)
    acked = {f.get(30).offset: b"s3-%05d" % i for i, f in enumerate(futs)}
    producer.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not s3.list_objects_v2(Bucket=bucket).get("KeyCount"):
        time.sleep(0.1)
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount"), "nothing was uploaded to S3"

    broker.restart(hard=hard)

    recs = consume_all(broker.bootstrap, "s3topic", 1, len(acked))
    assert {r.offset: r.value for r in recs} == acked and len(recs) == len(acked)


def test_librdkafka_idempotent_producer_through_restart(broker_factory, hard):
    """librdkafka with enable.idempotence keeps producing across the restart: every record is
    delivered, exactly once, in order (retried in-flight batches are deduplicated)."""
    from confluent_kafka import Producer

    broker = broker_factory(CLIENT_BROKER_ARGS)
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic("idem-load", 1, 1)])
    admin.close()
    delivered: list[int] = []
    errors: list[str] = []

    def report(err, msg) -> None:
        if err is None:
            delivered.append(msg.offset())
        else:
            errors.append(str(err))

    p = Producer({"bootstrap.servers": broker.bootstrap, "enable.idempotence": True,
                  "linger.ms": 2, "message.timeout.ms": 60000,
                  "reconnect.backoff.max.ms": 200})
    count = 5000

    def send(values: range) -> None:
        for i in values:
            while True:
                try:
                    p.produce("idem-load", value=b"r%05d" % i, partition=0, on_delivery=report)
                    break
                except BufferError:
                    p.poll(0.01)
            p.poll(0)

    send(range(0, 2500))
    while len(delivered) < 1500 and not errors:     # restart with the rest still in flight
        p.poll(0.001)
    broker.restart(hard=hard)
    send(range(2500, count))
    assert p.flush(60) == 0
    assert errors == []
    assert sorted(delivered) == list(range(count))
    recs = consume_all(broker.bootstrap, "idem-load", 1, count)
    assert [r.value for r in recs] == [b"r%05d" % i for i in range(count)]
