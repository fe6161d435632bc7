"""The event generator against a real broker: what it writes is what the job's tests expect."""
from __future__ import annotations

import json
import uuid

import pytest

from generator import main, make_events, parse_time_ms, summarize

T0 = 1_767_225_600_000


def test_events_are_deterministic_and_continue():
    a = list(make_events(10, T0, seed=4))
    assert a == list(make_events(10, T0, seed=4))
    more = list(make_events(5, T0, seed=4, first_index=10))
    assert [e["event_id"] for e in more] == [f"e{i}" for i in range(10, 15)]
    assert more[0]["ts"] == T0 + 10 * 100
    assert all(e["amount_cents"] > 0 for e in a + more if e["kind"] == "purchase")
    totals = summarize(a + more, 1000)
    assert sum(v["events"] for v in totals.values()) == 15


def test_parse_time_ms_accepts_epoch_and_iso():
    assert parse_time_ms(str(T0)) == T0
    assert parse_time_ms("2026-01-01T00:00:00Z") == T0
    assert parse_time_ms("2026-01-01T00:00:00") == T0


@pytest.mark.e2e
def test_generator_writes_keyed_timestamped_records(spark_broker, capsys):
    from kafka import KafkaConsumer, TopicPartition

    topic = f"gen-{uuid.uuid4().hex[:8]}"
    rc = main(["--bootstrap-servers", spark_broker.bootstrap, "--topic", topic, "--partitions", "2", "--count", "200",
               "--start-time", str(T0), "--step-ms", "1000", "--malformed-every", "50", "--summary"])
    assert rc == 0
    summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sum(s["events"] for s in summary) == 200

    consumer = KafkaConsumer(bootstrap_servers=spark_broker.bootstrap, enable_auto_commit=False, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        assert len(tps) == 2
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        assert sum(end.values()) == 204  # 200 events + 4 malformed records
        records = []
        while any(consumer.position(tp) < end[tp] for tp in tps):
            for batch in consumer.poll(timeout_ms=5000).values():
                records.extend(batch)
        # the record timestamp is the event time, so time lookups select by event time
        cut = T0 + 150_000
        found = consumer.offsets_for_times({tp: cut for tp in tps})
    finally:
        consumer.close()
    events = [json.loads(r.value) for r in records if r.key != b"garbage"]
    assert sorted(e["event_id"] for e in events) == sorted(f"e{i}" for i in range(200))
    for r in records:
        if r.key != b"garbage":
            e = json.loads(r.value)
            assert r.timestamp == e["ts"] and r.key.decode() == e["user"]
    for tp in tps:
        in_tp = sorted((r.offset, r.timestamp) for r in records if r.partition == tp.partition)
        first_at_or_after = next(off for off, ts in in_tp if ts >= cut)
        assert found[tp] is not None and found[tp].offset == first_at_or_after
