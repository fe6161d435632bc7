"""The job's flags and its streaming run: watermark, append output, restart from checkpoint.

The streaming test reads JSON-lines files (``--input-path``) instead of Kafka, since the connector
jars are not available here; everything after the source (parsing, windowing, watermark, state,
the Parquet sink and its checkpoint) is the same code the Kafka pipeline runs.
"""
from __future__ import annotations

import json
import pathlib
from datetime import timezone

import pytest

from generator import make_events, summarize
from job import build_parser, run, sink_options, source_options

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def _args(*flags: str):
    return build_parser().parse_args(list(flags))


def test_source_options_streaming_defaults():
    opts = source_options(_args("--bootstrap-servers", "h:1", "--input-topic", "a,b"))
    assert opts == {"kafka.bootstrap.servers": "h:1", "subscribe": "a,b", "failOnDataLoss": "true"}


def test_source_options_by_timestamp_and_isolation():
    by_ts = json.dumps({"events": {"0": T0, "1": T0 + 5}})
    opts = source_options(_args("--starting-offsets-by-timestamp", by_ts, "--isolation-level", "read_committed",
                                "--starting-offsets-by-timestamp-strategy", "latest",
                                "--max-offsets-per-trigger", "500", "--option", "minPartitions=4",
                                "--option", "sink.kafka.linger.ms=5"))
    assert opts["startingOffsetsByTimestamp"] == by_ts
    assert opts["startingOffsetsByTimestampStrategy"] == "latest"
    assert opts["kafka.isolation.level"] == "read_committed"
    assert opts["maxOffsetsPerTrigger"] == "500" and opts["minPartitions"] == "4"
    assert "sink.kafka.linger.ms" not in opts and "startingOffsets" not in opts


def test_source_options_batch_and_pattern():
    opts = source_options(_args("--mode", "batch", "--subscribe-pattern", "ev.*", "--starting-timestamp",
                                str(T0), "--ending-offsets", "latest", "--max-offsets-per-trigger", "9"))
    assert opts["subscribePattern"] == "ev.*" and "subscribe" not in opts
    assert opts["startingTimestamp"] == str(T0) and opts["endingOffsets"] == "latest"
    assert "maxOffsetsPerTrigger" not in opts  # not a batch option


@pytest.mark.parametrize("flags", [
    ("--starting-offsets", "earliest", "--starting-timestamp", "1"),
    ("--ending-offsets", "latest",),  # streaming has no end
    ("--option", "no-equals-sign"),
])
def test_contradictory_flags_are_refused(flags):
    with pytest.raises(SystemExit):
        source_options(_args(*flags))


def test_sink_options_route_prefixed_options():
    opts = sink_options(_args("--output-topic", "out", "--option", "sink.kafka.acks=all",
                              "--option", "kafka.security.protocol=PLAINTEXT",
                              "--isolation-level", "read_committed"))
    assert opts == {"kafka.bootstrap.servers": "127.0.0.1:9092", "topic": "out", "kafka.acks": "all",
                    "kafka.security.protocol": "PLAINTEXT"}


def _write_events(directory: pathlib.Path, name: str, events: list[dict], junk: int = 0) -> None:
    lines = [json.dumps(e) for e in events] + ["{broken"] * junk
    tmp = directory / f".{name}.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.rename(directory / f"{name}.json")  # atomic: the file source never sees half a file


def _parquet_totals(spark, path: pathlib.Path) -> tuple[dict, int]:
    rows = spark.read.parquet(str(path)).collect()
    totals = {}
    for r in rows:
        start = r.window_start.replace(tzinfo=timezone.utc)
        totals[(int(start.timestamp() * 1000), r.kind)] = {"events": r.events, "amount_cents": r.amount_cents}
    return totals, len(rows)


@pytest.mark.slow
def test_streaming_restart_from_checkpoint_counts_every_event_once(spark, tmp_path):
    """Three runs of the job over growing input: every closed window appears once, exactly right."""
    spark.conf.set("spark.sql.shuffle.partitions", "2")
    inp, out, ckpt = tmp_path / "in", tmp_path / "out", tmp_path / "ckpt"
    inp.mkdir()
    flags = ["--input-path", str(inp), "--output-topic", "", "--output-path", str(out),
             "--checkpoint-location", str(ckpt), "--trigger", "available-now", "--window", "1 minute",
             "--watermark", "30 seconds"]
    first = list(make_events(300, T0, step_ms=600, seed=21))  # minutes 0..3
    second = list(make_events(300, T0, step_ms=600, seed=21, first_index=300))  # minutes 3..6
    _write_events(inp, "part-1", first, junk=3)
    run(spark, _args(*flags))
    totals1, n1 = _parquet_totals(spark, out)
    # only windows the watermark has passed are final and written
    assert totals1 and len(totals1) == n1
    for key, value in totals1.items():
        assert summarize(first, 60_000)[key] == value

    _write_events(inp, "part-2", second)
    run(spark, _args(*flags))
    # a far-later event moves the watermark past every window; an event older than the
    # current watermark is late and must be dropped, not counted
    flush = {"event_id": "flush", "user": "u0", "kind": "view", "amount_cents": 0, "ts": T0 + 3_600_000}
    late = {"event_id": "late", "user": "u0", "kind": "purchase", "amount_cents": 999, "ts": T0 + 1000}
    _write_events(inp, "part-3", [flush, late])
    run(spark, _args(*flags))
    run(spark, _args(*flags))  # a run with no new input changes nothing

    totals, n = _parquet_totals(spark, out)
    assert n == len(totals), "a (window, kind) row was written twice"
    assert totals == summarize(first + second, 60_000)


@pytest.mark.slow
def test_batch_mode_writes_every_window(spark, tmp_path):
    """Batch mode has no watermark: every window, including the newest, is final at once."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    events = list(make_events(200, T0, step_ms=1000, seed=31))
    _write_events(inp, "part-1", events, junk=2)
    run(spark, _args("--mode", "batch", "--input-path", str(inp), "--output-topic", "", "--output-path", str(out)))
    totals, n = _parquet_totals(spark, out)
    assert n == len(totals) and totals == summarize(events, 60_000)
    # a second batch run replaces the output instead of appending to it
    run(spark, _args("--mode", "batch", "--input-path", str(inp), "--output-topic", "", "--output-path", str(out)))
    assert _parquet_totals(spark, out) == (totals, n)


@pytest.mark.slow
def test_streaming_timeout_stops_a_running_query(spark, tmp_path):
    """With a processing-time trigger the job runs until --timeout, then stops cleanly."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    _write_events(inp, "part-1", list(make_events(50, T0, step_ms=1000, seed=2)))
    flush = {"event_id": "f", "user": "u0", "kind": "view", "amount_cents": 0, "ts": T0 + 3_600_000}
    _write_events(inp, "part-2", [flush])
    run(spark, _args("--input-path", str(inp), "--output-topic", "", "--output-path", str(out),
                     "--checkpoint-location", str(tmp_path / "ckpt"), "--trigger", "1 second", "--timeout", "8"))
    assert not [q for q in spark.streams.active]
    assert (tmp_path / "ckpt" / "parquet" / "offsets").is_dir()
