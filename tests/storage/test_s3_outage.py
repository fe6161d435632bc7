"""S3 unreachable for 30 s while producers run: retriable errors or slow acks, no loss, reads
keep being served from the cache, and everything recovers on its own."""
from __future__ import annotations

import os
import threading
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from broker_helpers import ENGINE_ARGS, check_log, consume_all, create_topic, s3_url
from tcp_proxy import TcpProxy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_s3_outage_30s(broker_factory, s3_endpoint) -> None:
    host, port = s3_endpoint.url.rsplit(":", 1)
    proxy = TcpProxy(host.split("//")[1], int(port))
    url = s3_url(s3_endpoint.url, f"outage-{os.getpid()}-{time.time_ns()}")
    url = url.replace(s3_endpoint.url, proxy.url) + "&connect_timeout=1&read_timeout=3&max_attempts=2"
    args = ENGINE_ARGS + ["--object-store", url, "--log-cache-bytes", str(3 << 20)]
    b = broker_factory(args)
    create_topic(b.bootstrap, "o")
    acked: list[bytes] = []
    errors: list[str] = []
    stop = threading.Event()

    def run() -> None:
        p = Producer({"bootstrap.servers": b.bootstrap, "acks": "all", "linger.ms": 5,
                      "message.timeout.ms": 300000, "retries": 2147483647})

        def cb(err, msg) -> None:
            (errors.append(str(err)) if err else acked.append(msg.value()))
        i = 0
        while not stop.is_set():
            try:
                p.produce("o", f"o-{i:07d}-".encode() * 50, partition=0, on_delivery=cb)
                i += 1
            except BufferError:
                pass
            p.poll(0.002)
        p.flush(120)

    t = threading.Thread(target=run)
    t.start()
    try:
        time.sleep(3)
        proxy.cut()
        time.sleep(10)
        during = len(acked)
        # reads of the tail are served from the cache while the store is away
        c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": "w"})
        low, high = c.get_watermark_offsets(TopicPartition("o", 0), timeout=10)
        c.close()
        assert high >= during > 0
        recs = consume_all(b.bootstrap, "o", 200, timeout=20, start=high - 200)
        assert [o for o, _ in recs] == list(range(high - 200, high))
        time.sleep(20)
        proxy.restore()
        time.sleep(10)
    finally:
        stop.set()
        t.join(180)
        proxy.restore()
    assert not errors, errors[:3]
    assert len(acked) > during, "producers recovered after the outage"
    b.stop()
    os.unlink(b.data_dir / "wal")          # everything must now be in the object store
    b.start()
    # a read that keeps progressing may take long on a loaded machine (the CI once read this
    # log for 120 s without reaching the tail); fail once it stops for a minute
    progress: list[tuple[float, int]] = []
    recs = consume_all(b.bootstrap, "o", timeout=600, stall=60, at_least=len(acked),
                       progress=progress)
    print("read progress (s, records):", progress[::5] + progress[-1:])
    assert len(recs) >= len(acked), f"read stopped: (s, records) {progress[::5] + progress[-1:]}"
    check_log(recs, acked)
    log = b.log_text()
    assert "upload failed" in log
    # once per episode, not per retry: one start and one end line for the outage
    assert log.count("episode=object_store_failing state=started") >= 1
    assert "episode=object_store_failing state=ended" in log
