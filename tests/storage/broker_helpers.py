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
                timeout: float = 60, start: int = 0, at_least: int = 0,
                stall: float | None = None,
                progress: list[tuple[float, int]] | None = None) -> list[tuple[int, bytes]]:
    """(offset, value) of every record from the start until ``expect`` were read (None: up
    to the high watermark, once it shows at least ``at_least`` records).

    ``at_least``: after a restart the read_committed high watermark (the LSO) stays at the
    start of a producer-state replay that runs in the background, so a watermark read at once
    can show fewer records than were acknowledged; waiting for ``len(acked)`` tells that
    apart from lost records (the wait ends at the deadline and the check then fails).

    ``stall``: give up only after this many seconds without progress (a record read, or the
    high watermark moving while waiting for ``at_least``), with ``timeout`` as the overall
    cap; None: ``timeout`` alone. A slow machine then slows the read down instead of failing
    it, while a read that stopped still fails. ``progress`` (when given) receives
    (seconds since the start, records read) about once a second, for failure messages."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{time.time_ns()}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                  "fetch.max.bytes": 1 << 20})
    t0 = time.monotonic()
    cap = t0 + timeout
    stall_s = timeout if stall is None else stall

    def deadline(last: float) -> float:
        return min(cap, last + stall_s)

    last = t0
    if expect is None:
        tp = TopicPartition(topic, partition)
        seen = None
        while True:
            low, high = c.get_watermark_offsets(tp, timeout=10)
            expect = high - max(low, start)
            now = time.monotonic()
            if expect != seen:
                seen, last = expect, now
            if expect >= at_least or now >= deadline(last):
                break
            time.sleep(0.2)
    c.assign([TopicPartition(topic, partition, start)])
    out: list[tuple[int, bytes]] = []
    last = time.monotonic()
    noted = last
    try:
        while len(out) < expect:
            now = time.monotonic()
            if now >= deadline(last):
                break
            if progress is not None and now - noted >= 1.0:
                progress.append((round(now - t0, 1), len(out)))
                noted = now
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise AssertionError(f"consumer error: {m.error()}")
            out.append((m.offset(), m.value()))
            last = time.monotonic()
    finally:
        c.close()
    if progress is not None:
        progress.append((round(time.monotonic() - t0, 1), len(out)))
    return out


def check_log(records: list[tuple[int, bytes]], acked: list[bytes]) -> None:
    """Offsets contiguous from 0 with no duplicate, every acknowledged value present."""
    offsets = [o for o, _ in records]
    assert offsets == list(range(len(offsets))), "offsets must be contiguous, no duplicates"
    values = {v for _, v in records}
    missing = [v for v in acked if v not in values]
    assert not missing, f"{len(missing)} acknowledged records lost, e.g. {missing[:3]}"
