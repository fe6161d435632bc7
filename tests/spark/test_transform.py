"""The pipeline's transformations on static DataFrames (no Kafka connector needed).

Expected values come from the generator's own ``summarize`` (plain Python), so these tests check
the Spark code against an independent computation of the same aggregates.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

pytest.importorskip("pyspark")

from generator import make_events, summarize  # noqa: E402
from transform import OUTPUT_VALUE_SCHEMA, aggregate, parse_events, to_kafka_records  # noqa: E402

pytestmark = pytest.mark.slow

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z, a window boundary


def _raw(spark, values: list, binary: bool = True):
    """A DataFrame shaped like the Kafka source's rows (binary value, timestamp)."""
    from pyspark.sql.types import BinaryType, StringType, StructField, StructType, TimestampType

    vtype = BinaryType() if binary else StringType()
    schema = StructType([StructField("value", vtype), StructField("timestamp", TimestampType())])
    ts = datetime.fromtimestamp(T0 / 1000, tz=timezone.utc)
    rows = [((v.encode() if binary and isinstance(v, str) else v), ts) for v in values]
    return spark.createDataFrame(rows, schema)


def _ms(dt: datetime) -> int:
    """Epoch ms of a Spark timestamp (naive datetimes come back in the session zone, UTC)."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def test_parse_events_keeps_valid_and_skips_malformed(spark):
    good = {"event_id": "a", "user": "u1", "kind": "click", "amount_cents": 5, "ts": T0 + 1500}
    values = [
        json.dumps(good),
        "{not json",
        "",
        json.dumps({**good, "event_id": None}),  # no id
        json.dumps({**good, "event_id": "b", "ts": "yesterday"}),  # wrong type
        json.dumps({**good, "event_id": "c", "amount_cents": -3}),  # negative amount
        json.dumps({k: v for k, v in good.items() if k != "kind"}),  # missing field
        json.dumps({**good, "event_id": "d", "extra": [1, 2]}),  # unknown fields are ignored
        None,  # tombstone
    ]
    rows = parse_events(_raw(spark, values)).orderBy("event_id").collect()
    assert [r.event_id for r in rows] == ["a", "d"]
    assert _ms(rows[0].event_time) == T0 + 1500
    assert rows[0].kind == "click" and rows[0].amount_cents == 5 and rows[0].user == "u1"
    assert _ms(rows[0].kafka_timestamp) == T0


def test_parse_events_accepts_string_values_without_timestamp(spark):
    df = spark.createDataFrame([(json.dumps({"event_id": "x", "user": "u", "kind": "view",
                                             "amount_cents": 0, "ts": T0}),)], "value string")
    rows = parse_events(df).collect()
    assert len(rows) == 1 and "kafka_timestamp" not in rows[0].asDict()


def test_aggregate_matches_independent_totals(spark):
    events = list(make_events(600, T0 + 7, step_ms=700, seed=3))  # ~7 minutes, windows cut mid-run
    malformed = ["garbage"] * 5
    raw = _raw(spark, [json.dumps(e) for e in events] + malformed)
    rows = aggregate(parse_events(raw), "1 minute", watermark=None).collect()
    got = {(_ms(r.window_start), r.kind): (r.events, r.amount_cents) for r in rows}
    want = {k: (v["events"], v["amount_cents"]) for k, v in summarize(events, 60_000).items()}
    assert got == want
    for r in rows:
        assert _ms(r.window_end) - _ms(r.window_start) == 60_000
        true_users = {e["user"] for e in events
                      if e["kind"] == r.kind and _ms(r.window_start) <= e["ts"] < _ms(r.window_end)}
        assert 0 < r.users <= len(true_users) + 2  # approx_count_distinct, tiny cardinalities


def test_sliding_windows_count_each_event_in_every_window(spark):
    events = list(make_events(120, T0, step_ms=1000, seed=5, kinds=("view",)))
    raw = _raw(spark, [json.dumps(e) for e in events])
    rows = aggregate(parse_events(raw), "1 minute", slide="30 seconds", watermark=None).collect()
    assert sum(r.events for r in rows) == 2 * len(events)  # every event lies in two windows
    by_start = {_ms(r.window_start): r.events for r in rows}
    assert by_start[T0] == 60 and by_start[T0 + 30_000] == 60 and by_start[T0 - 30_000] == 30


def test_dedupe_drops_repeated_event_ids(spark):
    events = list(make_events(50, T0, step_ms=100, seed=9))
    doubled = [json.dumps(e) for e in events] + [json.dumps(e) for e in events[:20]]
    raw = _raw(spark, doubled)
    plain = aggregate(parse_events(raw), watermark=None).groupBy().sum("events").collect()[0][0]
    deduped = aggregate(parse_events(raw), watermark=None, dedupe=True).groupBy().sum("events").collect()[0][0]
    assert plain == 70 and deduped == 50


def test_kafka_records_have_stable_keys_and_parseable_values(spark):
    from pyspark.sql import functions as F

    events = list(make_events(300, T0, step_ms=500, seed=11))
    aggs = aggregate(parse_events(_raw(spark, [json.dumps(e) for e in events])), watermark=None)
    records = to_kafka_records(aggs)
    assert records.columns == ["key", "value"]
    parsed = records.select("key", F.from_json("value", OUTPUT_VALUE_SCHEMA).alias("v")).select("key", "v.*")
    rows = parsed.collect()
    assert len({r.key for r in rows}) == len(rows)
    want = summarize(events, 60_000)
    for r in rows:
        start = datetime.fromisoformat(r.window_start.replace("Z", "+00:00"))
        assert r.key == f"{r.window_start}|{r.kind}"
        assert want[(_ms(start), r.kind)] == {"events": r.events, "amount_cents": r.amount_cents}
    assert sum(r.events for r in rows) == len(events)
