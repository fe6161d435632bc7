"""Pure DataFrame transformations of the s3kafka Spark pipeline.

Kept apart from the job so they can be tested on static DataFrames without the Kafka connector:
the same functions run unchanged on a streaming DataFrame read from s3kafka. Only built-in Spark
SQL functions are used (no Python UDFs), so executors never need this module.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

#: The JSON events the generator writes and the job reads (one JSON object per Kafka record value).
EVENT_SCHEMA = StructType(
    [
        StructField("event_id", StringType()),
        StructField("user", StringType()),
        StructField("kind", StringType()),
        # integer cents keep sums exact, whatever the order Spark adds them in
        StructField("amount_cents", LongType()),
        # event time in epoch milliseconds; windows are computed on it, not on the Kafka timestamp
        StructField("ts", LongType()),
    ]
)

#: Columns of the aggregate rows written to Parquet and (as JSON) to the output topic.
AGGREGATE_COLUMNS = ["window_start", "window_end", "kind", "events", "amount_cents", "users"]


def parse_events(raw: DataFrame) -> DataFrame:
    """Turn raw records (a ``value`` column, binary or string) into typed events.

    Malformed JSON, missing fields and negative amounts are dropped rather than failing the
    query: one bad record from a producer must not stop a streaming pipeline. A Kafka
    ``timestamp`` column, when present, is carried along as ``kafka_timestamp``.
    """
    text = F.col("value").cast("string")
    parsed = F.from_json(text, EVENT_SCHEMA, {"mode": "PERMISSIVE"})
    cols: list[Column] = [parsed.alias("e")]
    if "timestamp" in raw.columns:
        cols.append(F.col("timestamp").alias("kafka_timestamp"))
    events = raw.select(*cols).select(
        "e.event_id",
        "e.user",
        "e.kind",
        "e.amount_cents",
        F.timestamp_millis(F.col("e.ts")).alias("event_time"),
        *(["kafka_timestamp"] if "timestamp" in raw.columns else []),
    )
    return events.where(
        F.col("event_id").isNotNull()
        & F.col("kind").isNotNull()
        & F.col("event_time").isNotNull()
        & F.col("amount_cents").isNotNull()
        & (F.col("amount_cents") >= 0)
    )


def aggregate(
    events: DataFrame,
    window: str = "1 minute",
    slide: str | None = None,
    watermark: str | None = "30 seconds",
    dedupe: bool = False,
) -> DataFrame:
    """Count events and sum amounts per event-time window and kind.

    With a watermark (streaming), a window is emitted once in append mode when the watermark
    passes its end, so a sink sees each (window, kind) exactly once; events later than the
    watermark are dropped. ``dedupe`` drops repeated ``event_id`` values (a producer retrying
    without idempotence) within the watermark.
    """
    if watermark:
        events = events.withWatermark("event_time", watermark)
    if dedupe:
        if watermark:
            events = events.dropDuplicatesWithinWatermark(["event_id"])
        else:
            events = events.dropDuplicates(["event_id"])
    win = F.window("event_time", window, slide) if slide else F.window("event_time", window)
    grouped = events.groupBy(win.alias("window"), F.col("kind")).agg(
        F.count(F.lit(1)).alias("events"),
        F.sum("amount_cents").alias("amount_cents"),
        # approximate on purpose: exact distinct counts in streaming state grow without bound
        F.approx_count_distinct("user").alias("users"),
    )
    return grouped.select(
        F.col("window.start").alias("window_start"),
        F.col("window.end").alias("window_end"),
        "kind",
        "events",
        F.col("amount_cents").cast("long").alias("amount_cents"),
        F.col("users").cast("long").alias("users"),
    )


def to_kafka_records(aggregates: DataFrame) -> DataFrame:
    """Shape aggregate rows for Spark's Kafka sink: string ``key`` and JSON ``value``.

    The key (window start + kind) is stable, so a compacted output topic keeps one record per
    window and a consumer can drop duplicates an at-least-once sink may write after a failure.
    """
    ts_fmt = "yyyy-MM-dd'T'HH:mm:ss'Z'"
    start = F.date_format("window_start", ts_fmt)
    end = F.date_format("window_end", ts_fmt)
    return aggregates.select(
        F.concat_ws("|", start, F.col("kind")).alias("key"),
        F.to_json(
            F.struct(
                start.alias("window_start"),
                end.alias("window_end"),
                F.col("kind"),
                F.col("events"),
                F.col("amount_cents"),
                F.col("users"),
            )
        ).alias("value"),
    )


#: Schema of the JSON values written to the output topic, for consumers that parse them back.
OUTPUT_VALUE_SCHEMA = StructType(
    [
        StructField("window_start", StringType()),
        StructField("window_end", StringType()),
        StructField("kind", StringType()),
        StructField("events", LongType()),
        StructField("amount_cents", LongType()),
        StructField("users", LongType()),
    ]
)
