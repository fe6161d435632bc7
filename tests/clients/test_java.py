"""Unmodified Java kafka-clients 3.9 and 4.3 (compiled with javac) against s3kafka.

Each call starts one JVM running tests/java/KafkaCli.java, which prints a JSON result.
"""
from __future__ import annotations

import time

import pytest

from clients.e2e_helpers import (ACKS, CODECS, create_topic, produce_values, resume_after_restart,
                                 unique)

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("version", ["3.9", "4.3"])]
N = 20


def test_produce_every_acks_and_codec_then_assign_seek(cbroker, java_cli, topic_name, version):
    """Idempotent (acks=all) and plain (0, 1) producers with every codec; assign+seek reads all."""
    java = java_cli[version]
    create_topic(cbroker.bootstrap, topic_name, 1)
    res = java("produce-matrix", bootstrap=cbroker.bootstrap, topic=topic_name, count=N,
               partition=0, acks=",".join(ACKS), compressions=",".join(CODECS))
    for combo, r in res.items():
        assert r["errors"] == [], combo
        assert r["acked"] == N, combo
        offs = r["offsets"]["0"]
        if combo.startswith("0-"):
            assert set(offs) == {-1}, combo          # acks=0: no offsets come back
        else:
            assert offs == sorted(offs) and len(set(offs)) == N, combo
    total = N * len(ACKS) * len(CODECS)
    got = java("consume-assign", bootstrap=cbroker.bootstrap, topic=topic_name, partition=0,
               count=total, timeout_ms=30000)
    values = [r["v"] for r in got["records"]]
    expected = {f"{a}-{c}-{i}" for a in ACKS for c in CODECS for i in range(N)}
    assert len(values) == total and set(values) == expected
    assert [r["o"] for r in got["records"]] == list(range(total))
    assert got["end_offset"] == total and got["beginning_offset"] == 0
    # seek into the middle
    mid = java("consume-assign", bootstrap=cbroker.bootstrap, topic=topic_name, partition=0,
               offset=37, count=3, timeout_ms=30000)
    assert [r["o"] for r in mid["records"]][:3] == [37, 38, 39]


def test_admin_operations(cbroker, java_cli, topic_name, version):
    """AdminClient createTopics/describeTopics/listOffsets/deleteRecords/describeConfigs/deleteTopics."""
    r = java_cli[version]("admin", bootstrap=cbroker.bootstrap, topic=topic_name, partitions=3)
    assert r["create_again"] == "TopicExistsException"
    assert r["listed"] is True
    assert r["describe_partitions"] == 3 and r["describe_leader"] == 0
    assert r["produce"]["acked"] == 10 and r["produce"]["errors"] == []
    assert r["earliest"] == 0 and r["latest"] == 10
    assert r["max_timestamp_offset"] in range(10)
    assert r["for_timestamp_0"] == 0
    assert r["low_watermark"] == 4 and r["earliest_after_delete"] == 4
    assert r["configs"]["retention.ms"] == "3600000"
    assert r["configs"]["cleanup.policy"] == "delete"
    assert r["cluster_nodes"] == 1
    assert r["listed_after_delete"] is False


@pytest.mark.parametrize("assignor", ["range", "cooperative-sticky"])
def test_group_of_three_rebalances_then_resumes_after_restart(cbroker, java_cli, topic_name,
                                                              version, assignor):
    """3 subscribers split 6 partitions (eager or incremental cooperative rebalancing); one
    leaves, two take over; committed offsets survive a broker restart and the group resumes
    exactly after them."""
    java = java_cli[version]
    group = unique("g")
    create_topic(cbroker.bootstrap, topic_name, 6)
    produce_values(cbroker.bootstrap, topic_name, [f"a-{i}" for i in range(60)])
    r = java("group-rebalance", bootstrap=cbroker.bootstrap, topic=topic_name, group=group,
             partitions=6, count=60, timeout_ms=90000, assignor=assignor)
    assert len(r["phase1"]) == 3 and all(r["phase1"])
    assert sorted(p for m in r["phase2"] for p in m) == list(range(6))
    assert r["distinct"] == 60
    committed: list[int] = []

    def consume(count: int) -> list[str]:
        again = java("consume-group", bootstrap=cbroker.bootstrap, topic=topic_name, group=group,
                     count=count, timeout_ms=30000, assignor=assignor)
        committed.append(sum(again["committed"].values()))
        return [rec["v"] for rec in again["records"]]
    resume_after_restart(cbroker, group, topic_name, consume)
    assert committed == [72]


@pytest.mark.parametrize("hard", [False, True], ids=["sigterm", "kill9"])
def test_idempotent_producer_through_broker_restart(broker_factory, java_cli, version, hard):
    """A Java idempotent producer keeps sending while the broker restarts: its retried
    in-flight batches are deduplicated (no duplicates) and nothing acknowledged is lost."""
    from kafka import KafkaConsumer, TopicPartition

    from clients.e2e_helpers import CLIENT_BROKER_ARGS
    broker = broker_factory(CLIENT_BROKER_ARGS)
    topic, count = "through-restart", 1500
    create_topic(broker.bootstrap, topic, 1)
    proc = java_cli[version].start("produce", bootstrap=broker.bootstrap, topic=topic,
                                   count=count, acks="all", partition=0, pace_ms=20,
                                   delivery_timeout_ms=120000)
    tp = TopicPartition(topic, 0)
    probe = KafkaConsumer(bootstrap_servers=broker.bootstrap)
    try:
        while probe.end_offsets([tp])[tp] < 300:        # the producer is well under way
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
    finally:
        probe.close()
    broker.restart(hard=hard)
    res = java_cli[version].finish(proc)
    assert res["errors"] == [] and res["acked"] == count
    offsets = res["offsets"]["0"]
    assert offsets == list(range(count))              # acked in order, no gaps, no repeats
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False)
    try:
        c.assign([tp])
        c.seek_to_beginning(tp)
        values: list[str] = []
        deadline = time.monotonic() + 30
        while len(values) < count and time.monotonic() < deadline:
            for recs in c.poll(timeout_ms=500).values():
                values += [r.value.decode() for r in recs]
        for recs in c.poll(timeout_ms=500).values():
            values += [r.value.decode() for r in recs]
    finally:
        c.close()
    assert values == [f"v-{i}" for i in range(count)]
