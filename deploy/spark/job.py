"""The s3kafka Spark pipeline: JSON events in, windowed aggregates out (Kafka topic + Parquet).

Run it with the standard Kafka connector, e.g.::

    spark-submit --packages org.apache.spark:spark-sql-kafka-0-10_2.13:4.3.0 deploy/spark/job.py \
        --bootstrap-servers 127.0.0.1:9092 --input-topic events --output-topic event-aggregates \
        --output-path /tmp/agg --checkpoint-location /tmp/agg-ckpt

Streaming mode runs two queries over the same source, each with its own checkpoint under
``--checkpoint-location`` (``kafka/`` and ``parquet/``): Spark's file sink is exactly-once on its
own, the Kafka sink is at-least-once, and one failing sink must not hold back the other.
A restarted job resumes from the checkpointed offsets and state; starting-offset flags only
apply to a query's first run (that is how Spark's Kafka source works). See docs/spark.md.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

# the job is launched as a script (spark-submit deploy/spark/job.py): its directory holds transform
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transform import aggregate, parse_events, to_kafka_records  # noqa: E402

log = logging.getLogger("s3kafka.spark.job")

AVAILABLE_NOW = "available-now"


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags; every Kafka source knob a user needs has its own flag."""
    p = argparse.ArgumentParser(
        prog="job.py", description="Windowed aggregation of JSON events from s3kafka (Spark Structured Streaming)"
    )
    src = p.add_argument_group("source")
    src.add_argument("--bootstrap-servers", default="127.0.0.1:9092", help="s3kafka bootstrap servers (host:port,...)")
    src.add_argument("--input-topic", default="events", help="topic(s) to read, comma separated (Kafka 'subscribe')")
    src.add_argument("--subscribe-pattern", default=None, help="read topics matching this Java regex instead")
    src.add_argument(
        "--input-path",
        default=None,
        help="read JSON-lines files from this directory instead of Kafka (replaying an archive)",
    )
    src.add_argument(
        "--starting-offsets",
        default=None,
        help="'earliest', 'latest' (streaming default) or JSON like {\"events\":{\"0\":42,\"1\":-2}}",
    )
    src.add_argument(
        "--starting-offsets-by-timestamp",
        default=None,
        help="JSON like {\"events\":{\"0\":1700000000000}}: first offset with timestamp >= the value",
    )
    src.add_argument("--starting-timestamp", default=None, help="epoch ms applied to every partition")
    src.add_argument(
        "--starting-offsets-by-timestamp-strategy",
        choices=["error", "latest"],
        default=None,
        help="what to do when no offset matches the starting timestamp (Spark default: error)",
    )
    src.add_argument("--ending-offsets", default=None, help="batch mode only: 'latest' (default) or JSON")
    src.add_argument("--ending-offsets-by-timestamp", default=None, help="batch mode only: JSON of epoch ms")
    src.add_argument("--ending-timestamp", default=None, help="batch mode only: epoch ms for every partition")
    src.add_argument(
        "--isolation-level",
        choices=["read_uncommitted", "read_committed"],
        default=None,
        help="kafka.isolation.level (Kafka default: read_uncommitted)",
    )
    src.add_argument("--max-offsets-per-trigger", type=int, default=None, help="rate limit per micro-batch")
    src.add_argument(
        "--fail-on-data-loss",
        choices=["true", "false"],
        default="true",
        help="fail when offsets were deleted (retention) before being read",
    )
    src.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Kafka source/sink option, verbatim (e.g. kafka.security.protocol=SASL_SSL); repeatable",
    )
    agg = p.add_argument_group("aggregation")
    agg.add_argument("--window", default="1 minute", help="event-time window length")
    agg.add_argument("--slide", default=None, help="slide for overlapping windows (default: tumbling)")
    agg.add_argument("--watermark", default="30 seconds", help="how late an event may arrive (streaming)")
    agg.add_argument("--dedupe", action="store_true", help="drop repeated event_id values within the watermark")
    out = p.add_argument_group("sinks")
    out.add_argument("--output-topic", default="event-aggregates", help="topic for aggregates; '' to disable")
    out.add_argument("--output-path", default=None, help="directory for Parquet aggregates (omit to disable)")
    out.add_argument("--checkpoint-location", default=None, help="checkpoint directory (required when streaming)")
    run = p.add_argument_group("run")
    run.add_argument("--mode", choices=["streaming", "batch"], default="streaming")
    run.add_argument(
        "--trigger",
        default="10 seconds",
        help=f"micro-batch interval, or '{AVAILABLE_NOW}' to process what is there and stop",
    )
    run.add_argument("--timeout", type=float, default=None, help="stop the streaming queries after this many s")
    run.add_argument("--shuffle-partitions", type=int, default=4, help="spark.sql.shuffle.partitions")
    run.add_argument(
        "--spark-conf", action="append", default=[], metavar="KEY=VALUE", help="extra Spark config; repeatable"
    )
    return p


def _pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    """Parse repeated KEY=VALUE flags."""
    result: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} expects KEY=VALUE, got {item!r}")
        result[key.strip()] = value
    return result


def source_options(args: argparse.Namespace) -> dict[str, str]:
    """Options for ``spark.read(Stream).format("kafka")`` from the flags."""
    opts: dict[str, str] = {"kafka.bootstrap.servers": args.bootstrap_servers}
    if args.subscribe_pattern:
        opts["subscribePattern"] = args.subscribe_pattern
    else:
        opts["subscribe"] = args.input_topic
    chosen = [
        f
        for f in (args.starting_offsets, args.starting_offsets_by_timestamp, args.starting_timestamp)
        if f is not None
    ]
    if len(chosen) > 1:
        raise SystemExit("give only one of --starting-offsets, --starting-offsets-by-timestamp, --starting-timestamp")
    optional = {
        "startingOffsets": args.starting_offsets,
        "startingOffsetsByTimestamp": args.starting_offsets_by_timestamp,
        "startingTimestamp": args.starting_timestamp,
        "startingOffsetsByTimestampStrategy": args.starting_offsets_by_timestamp_strategy,
        "kafka.isolation.level": args.isolation_level,
        "failOnDataLoss": args.fail_on_data_loss,
    }
    if args.mode == "batch":
        optional["endingOffsets"] = args.ending_offsets
        optional["endingOffsetsByTimestamp"] = args.ending_offsets_by_timestamp
        optional["endingTimestamp"] = args.ending_timestamp
    elif any(x is not None for x in (args.ending_offsets, args.ending_offsets_by_timestamp, args.ending_timestamp)):
        raise SystemExit("ending offsets/timestamps only apply to --mode batch")
    if args.max_offsets_per_trigger is not None and args.mode == "streaming":
        optional["maxOffsetsPerTrigger"] = str(args.max_offsets_per_trigger)
    opts.update({k: v for k, v in optional.items() if v is not None})
    opts.update({k: v for k, v in _pairs(args.option, "--option").items() if not k.startswith("sink.")})
    return opts


def sink_options(args: argparse.Namespace) -> dict[str, str]:
    """Options for Spark's Kafka sink; ``--option sink.KEY=VALUE`` reaches only the sink."""
    opts = {"kafka.bootstrap.servers": args.bootstrap_servers, "topic": args.output_topic}
    for key, value in _pairs(args.option, "--option").items():
        if key.startswith("sink."):
            opts[key[len("sink.") :]] = value
        elif key.startswith("kafka.") and key != "kafka.isolation.level":
            opts[key] = value  # security settings etc. apply to both ends
    return opts


def _read(spark, args: argparse.Namespace, streaming: bool):
    """The raw source DataFrame: Kafka records, or JSON lines from --input-path."""
    reader = spark.readStream if streaming else spark.read
    if args.input_path:
        return reader.format("text").load(args.input_path)
    return reader.format("kafka").options(**source_options(args)).load()


def run_batch(spark, args: argparse.Namespace) -> None:
    """One batch query over a bounded offset range (no watermark: every window is final)."""
    raw = _read(spark, args, streaming=False)
    aggs = aggregate(parse_events(raw), args.window, args.slide, watermark=None, dedupe=args.dedupe).cache()
    if args.output_path:
        aggs.write.mode("overwrite").parquet(args.output_path)
    if args.output_topic:
        to_kafka_records(aggs).write.format("kafka").options(**sink_options(args)).save()
    log.info("batch done: %d aggregate rows", aggs.count())


def start_streaming(spark, args: argparse.Namespace) -> list:
    """Start the streaming queries (Kafka sink and/or Parquet sink) and return them."""
    if not args.checkpoint_location:
        raise SystemExit("--checkpoint-location is required in streaming mode")
    if not args.output_path and not args.output_topic:
        raise SystemExit("nothing to write: give --output-path and/or --output-topic")
    aggs = aggregate(parse_events(_read(spark, args, streaming=True)), args.window, args.slide, args.watermark,
                     args.dedupe)
    ckpt = args.checkpoint_location.rstrip("/")

    def with_trigger(writer):
        if args.trigger == AVAILABLE_NOW:
            return writer.trigger(availableNow=True)
        return writer.trigger(processingTime=args.trigger)

    queries = []
    if args.output_topic:
        writer = (
            to_kafka_records(aggs)
            .writeStream.queryName("aggregates_to_kafka")
            .format("kafka")
            .options(**sink_options(args))
            .option("checkpointLocation", f"{ckpt}/kafka")
            .outputMode("append")
        )
        queries.append(with_trigger(writer).start())
    if args.output_path:
        writer = (
            aggs.writeStream.queryName("aggregates_to_parquet")
            .format("parquet")
            .option("path", args.output_path)
            .option("checkpointLocation", f"{ckpt}/parquet")
            .outputMode("append")
        )
        queries.append(with_trigger(writer).start())
    return queries


def await_queries(queries: list, timeout: float | None, stop_event: threading.Event) -> None:
    """Wait until every query ends (available-now), the timeout passes or a stop is requested.

    Polls in short steps so SIGTERM/SIGINT stop the queries cleanly (their checkpoints stay
    consistent and the next run resumes where this one stopped). Re-raises a query's failure.
    """
    waited = 0.0
    while not stop_event.is_set():
        if all(not q.isActive for q in queries):
            break
        if timeout is not None and waited >= timeout:
            break
        for q in queries:
            if q.isActive:
                q.awaitTermination(0.5)
        waited += 0.5
    for q in queries:
        if q.isActive:
            q.stop()
    for q in queries:
        if q.exception() is not None:
            raise RuntimeError(f"query {q.name} failed: {q.exception()}")


def build_session(args: argparse.Namespace):
    """A SparkSession (local[*] when launched with plain python) with UTC times for stable windows."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("s3kafka-pipeline")
    builder = builder.config("spark.sql.session.timeZone", "UTC")
    builder = builder.config("spark.sql.shuffle.partitions", str(args.shuffle_partitions))
    for key, value in _pairs(args.spark_conf, "--spark-conf").items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def run(spark, args: argparse.Namespace) -> None:
    """Run the pipeline on an existing session (the tests call this in-process)."""
    if args.mode == "batch":
        run_batch(spark, args)
        return
    stop_event = threading.Event()
    queries = start_streaming(spark, args)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop_event.set())
    try:
        await_queries(queries, args.timeout, stop_event)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for spark-submit / python."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    spark = build_session(args)
    try:
        run(spark, args)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
