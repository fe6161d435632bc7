"""A broker with ``--metadata postgresql://...``: real clients, restarts, and a clear error when
the server cannot be reached."""
from __future__ import annotations

import subprocess
import sys
import time

import psycopg
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from conftest import REPO, free_port

pytestmark = pytest.mark.e2e
ARGS = ["--group-min-session-timeout-ms", "1000", "--group-initial-rebalance-delay-ms", "0"]


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> dict[tuple[int, int], bytes]:
    acked: dict[tuple[int, int], bytes] = {}

    def report(err, msg) -> None:
        assert err is None, err
        acked[(msg.partition(), msg.offset())] = msg.value()

    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                  "linger.ms": 2})
    for i, v in enumerate(values):
        p.produce(topic, value=v, partition=i % 2, on_delivery=report)
    assert p.flush(30) == 0
    return acked


def _consume(bootstrap: str, group: str, topic: str, count: int) -> dict[tuple[int, int], bytes]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "session.timeout.ms": 6000})
    c.subscribe([topic])
    got: dict[tuple[int, int], bytes] = {}
    deadline = time.monotonic() + 60
    try:
        while len(got) < count and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            key = (m.partition(), m.offset())
            assert key not in got, f"duplicate {key}"
            got[key] = m.value()
        c.commit(asynchronous=False)
    finally:
        c.close()
    return got


def test_broker_on_postgres_keeps_topics_offsets_and_commits(broker_factory, postgres):
    url = postgres.new_database()
    broker = broker_factory([*ARGS, "--metadata", url])
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic("pgt", num_partitions=2, replication_factor=1,
                                  config={"retention.ms": "7200000"})])["pgt"].result(30)
    first = _produce(broker.bootstrap, "pgt", [b"a%03d" % i for i in range(100)])
    assert _consume(broker.bootstrap, "pg-group", "pgt", 100) == first

    broker.restart(hard=True)                      # kill -9: nothing but what was committed

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    md = admin.list_topics(timeout=30)
    assert len(md.topics["pgt"].partitions) == 2
    cfg = admin.describe_configs([_topic_resource("pgt")])
    (res,) = cfg.values()
    assert res.result(30)["retention.ms"].value == "7200000"
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "pg-group"})
    committed = {tp.partition: tp.offset for tp in c.committed(
        [TopicPartition("pgt", 0), TopicPartition("pgt", 1)], timeout=30)}
    c.close()
    assert committed == {0: 50, 1: 50}
    # new records land after the old ones; the group resumes exactly where it committed
    second = _produce(broker.bootstrap, "pgt", [b"b%03d" % i for i in range(20)])
    assert sorted(second) == [(p, o) for p in (0, 1) for o in range(50, 60)]
    assert _consume(broker.bootstrap, "pg-group", "pgt", 20) == second

    # everything lives in PostgreSQL: no SQLite file next to the data
    assert not (broker.data_dir / "meta.db").exists()
    with psycopg.connect(url) as conn:
        counts = {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in (
            "kafka_topics", "kafka_partitions", "kafka_group_offsets", "kafka_producer_ids",
            "s3_streams", "kafka_cluster")}
        components = {r[0] for r in conn.execute("SELECT component FROM schema_migrations")}
    # pgt (2 partitions) and the internal __consumer_offsets (1) every broker keeps
    assert counts["kafka_topics"] == 2 and counts["kafka_partitions"] == 3
    assert counts["kafka_group_offsets"] == 2 and counts["kafka_cluster"] == 2  # id, store
    assert components == {"engine", "kafka", "groups", "producers", "transactions", "cluster"}


def _topic_resource(name: str):
    from confluent_kafka.admin import ConfigResource, ResourceType  # noqa: PLC0415

    return ConfigResource(ResourceType.TOPIC, name)


def test_unreachable_postgres_fails_start_with_one_line(tmp_path):
    port = free_port()                             # nothing listens there
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--listen", f"127.0.0.1:{free_port()}",
         "--data-dir", str(tmp_path / "data"), "--wal-capacity", str(64 << 20),
         "--metadata", f"postgresql://s3kafka:hunter2@127.0.0.1:{port}/meta"],
        cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    lines = [ln for ln in text.splitlines() if f"127.0.0.1:{port}" in ln]
    assert lines and "cannot reach PostgreSQL metadata" in lines[0], text
    assert "refused" in lines[0].lower()
    assert "Traceback" not in text and "hunter2" not in text
    assert time.monotonic() - started < 30


def test_bad_metadata_url_is_a_configuration_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--data-dir", str(tmp_path),
         "--metadata", "mysql://h/db"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "metadata must be sqlite:///PATH or postgresql://" in out.stderr


def test_second_broker_on_another_object_store_is_refused(broker_factory, postgres, tmp_path):
    url = postgres.new_database()
    first = broker_factory([*ARGS, "--metadata", url])          # objects in its data dir
    first.stop()
    out = subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--listen", f"127.0.0.1:{free_port()}",
         "--data-dir", str(tmp_path / "other"), "--node-id", "1", "--wal-capacity",
         str(64 << 20), "--metadata", url],
        cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    (line,) = [ln for ln in text.splitlines() if "cannot start" in ln]
    assert f"--object-store file://{tmp_path / 'other' / 'objects'} is not this cluster's" \
           f" object store file://{first.data_dir / 'objects'}" in line
    assert "Traceback" not in text
