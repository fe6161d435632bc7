"""A partition handed to a broker while it starts continues at the log's end.

A starting broker loads its view of every stream (engine start), registers as live, then reads
the cluster and opens the partitions it leads. The controller may hand it a partition in
between: the broker's view then predates the hand-over. Opening that view (as the topic load
did) put new records at the view's end, over offsets the previous leader had acknowledged
(found as a fatal OUT_OF_ORDER_SEQUENCE in test_cluster.py, once in ~100 runs). Here the
window is held open with the ``cluster_registered`` pause point (storage/crash.py).
"""
from __future__ import annotations

import pytest
from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient, NewTopic

from .kit import leaders, read_all, wait_for, wait_live

pytestmark = pytest.mark.slow

PARTITIONS = 2
NOT_UPLOADED = ("--upload-interval-s", "3600")   # records stay in the WAL until a hand-over


def produce(bootstrap: str, start: int, n: int) -> list[tuple[int, int, bytes]]:
    """``n`` acks=all values ``v<i>`` round-robin over the partitions; (partition, offset,
    value) of each acknowledged one."""
    acked: list[tuple[int, int, bytes]] = []
    errors: list[str] = []

    def cb(err, msg) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            acked.append((msg.partition(), msg.offset(), msg.value()))

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5,
                  "enable.idempotence": False, "message.timeout.ms": 60000,
                  "topic.metadata.refresh.interval.ms": 500})
    for i in range(start, start + n):
        p.produce("t", value=f"v{i}".encode(), partition=i % PARTITIONS, on_delivery=cb)
    assert p.flush(90) == 0 and not errors, errors[:5]
    return acked


def test_a_partition_handed_over_while_a_broker_starts_continues_at_the_log_end(
        cluster_factory, broker_factory, metadata_url):
    if not metadata_url.startswith("sqlite"):
        pytest.skip("the same start-up path on PostgreSQL; SQLite keeps this lean")
    (a,) = cluster_factory(1, extra=NOT_UPLOADED)
    admin = KafkaAdminClient(bootstrap_servers=a.bootstrap)
    wait_live(admin, 1)
    admin.create_topics([NewTopic("t", PARTITIONS, 1)])
    wait_for(lambda: all(ld == 0 for ld, _ in leaders(admin, "t").values()), what="leaders")
    before = produce(a.bootstrap, 0, 200)     # in broker 0's WAL only: nothing committed

    # broker 1 loads its (empty) view of the streams, registers, and is held 4 s while the
    # controller moves a partition to it (release: upload, hand-over at the log end)
    b = broker_factory([*cluster_factory.shared, "--node-id", "1", "--rack", "r1",
                        *NOT_UPLOADED],
                       env={"S3KAFKA_PAUSE_POINT": "cluster_registered", "S3KAFKA_PAUSE_S": "4"})
    assert "pause point cluster_registered reached" in b.log_text()
    moved = wait_for(lambda: {p for p, (ld, _) in leaders(admin, "t").items() if ld == 1},
                     what="a partition led by the broker that joined")
    assert "partition moved topic=t" in a.log_text()

    boot = f"{a.bootstrap},{b.bootstrap}"
    after = produce(boot, 200, 200)
    ends = {p: sum(1 for q, _, _ in before if q == p) for p in range(PARTITIONS)}
    for p in moved:
        first = min(off for q, off, _ in after if q == p)
        assert first == ends[p], f"partition {p} continued at {first}, its log ended at {ends[p]}"
    acked = before + after
    for p, off, _ in acked:
        ends[p] = max(ends[p], off + 1)
    log = read_all(boot, "t", ends)
    assert sorted(log) == sorted(acked)        # every acknowledged value, at its offset, once
    admin.close()
