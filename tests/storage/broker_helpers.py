"""Broker-level helpers for the storage tests: produce with acks, consume everything back."""
from __future__ import annotations

import time

import boto3
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

ENGINE_ARGS = ["--wal-capacity", str(32 << 20), "--upload-interval-s", "0.3",
               "--upload-threshold-bytes", str(64 << 10), "--log-cache-bytes", str(8 << 20),
               "--object-block-bytes", str(16 << 10), "--stream-object-threshold-bytes",
               str(256 << 10), "--backpressure-timeout-s", "1"]


def s3_url(endpoint: str, bucket: str) -> str:
    """Create the bucket on the endpoint and return the engine's s3:// URL for it."""
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    return (f"s3://{bucket}/kafka?endpoint_url={endpoint}&region=us-east-1"
            "&access_key_id=testing&secret_access_key=testing")


def create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(30)


def produce(bootstrap: str, topic: str, values: list[bytes], partition: int = 0,
            stop_on_error: bool = False, timeout: float = 60) -> list[bytes]:
    """Produce with acks=all; returns the values the broker acknowledged."""
    acked: list[bytes] = []
    errors: list[KafkaError] = []

    def cb(err, msg) -> None:
        if err is None:
            acked.append(msg.value())
        else:
            errors.append(err)

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                  "message.timeout.ms": int(timeout * 1000), "retries": 2147483647,
                  "reconnect.backoff.max.ms": 200})
    for v in values:
        while True:
            try:
                p.produce(topic, v, partition=partition, on_delivery=cb)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
        if stop_on_error and errors:
            break
    p.flush(timeout + 5)
    return acked


def consume_all(bootstrap: str, topic: str, expect: int | None = None, partition: int = 0,
                timeout: float = 60, start: int = 0,
                at_least: int = 0) -> list[tuple[int, bytes]]:
    """(offset, value) of every record from the start until ``expect`` were read (None: up
    to the high watermark, once it shows at least ``at_least`` records).

    ``at_least``: after a restart the read_committed high watermark (the LSO) stays at the
    start of a producer-state replay that runs in the background, so a watermark read at once
    can show fewer records than were acknowledged; waiting for ``len(acked)`` tells that
    apart from lost records (the wait ends at the deadline and the check then fails)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{time.time_ns()}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                  "fetch.max.bytes": 1 << 20})
    deadline = time.monotonic() + timeout
    if expect is None:
        tp = TopicPartition(topic, partition)
        while True:
            low, high = c.get_watermark_offsets(tp, timeout=10)
            expect = high - max(low, start)
            if expect >= at_least or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    c.assign([TopicPartition(topic, partition, start)])
    out: list[tuple[int, bytes]] = []
    try:
        while len(out) < expect and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise AssertionError(f"consumer error: {m.error()}")
            out.append((m.offset(), m.value()))
    finally:
        c.close()
    return out


def check_log(records: list[tuple[int, bytes]], acked: list[bytes]) -> None:
    """Offsets contiguous from 0 with no duplicate, every acknowledged value present."""
    offsets = [o for o, _ in records]
    assert offsets == list(range(len(offsets))), "offsets must be contiguous, no duplicates"
    values = {v for _, v in records}
    missing = [v for v in acked if v not in values]
    assert not missing, f"{len(missing)} acknowledged records lost, e.g. {missing[:3]}"
