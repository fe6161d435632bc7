"""Through the broker: records come back from the object store (file:// and S3), and kill -9
at the engine's crash points loses no acknowledged record."""
from __future__ import annotations

import os
import sqlite3
import time

import pytest

from broker_helpers import ENGINE_ARGS, check_log, consume_all, create_topic, produce, s3_url

pytestmark = pytest.mark.e2e


def _prepared_keys(data_dir) -> list[str]:
    db = sqlite3.connect(data_dir / "meta.db")
    try:
        return [r[0] for r in db.execute(
            "SELECT object_key FROM s3_objects WHERE state='prepared'")]
    finally:
        db.close()


def _values(n: int, tag: str = "v") -> list[bytes]:
    return [f"{tag}-{i:06d}-".encode() * 20 for i in range(n)]


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_read_back_from_object_store(kind, broker_factory, request, tmp_path) -> None:
    args = list(ENGINE_ARGS)
    if kind == "s3":
        ep = request.getfixturevalue("s3_endpoint")
        args += ["--object-store", s3_url(ep.url, f"e2e-{os.getpid()}-{time.time_ns()}")]
    b = broker_factory(args)
    create_topic(b.bootstrap, "t")
    acked = produce(b.bootstrap, "t", _values(3000))
    assert len(acked) == 3000
    b.stop()
    # the WAL goes away entirely: what is read back can only come from the object store
    os.unlink(b.data_dir / "wal")
    b.start()
    recs = consume_all(b.bootstrap, "t", 3000)
    check_log(recs, acked)
    if kind == "file":
        assert list((b.data_dir / "objects").rglob("*")), "objects on disk"


@pytest.mark.parametrize("point", ["before_commit", "after_commit", "during_compaction"])
def test_kill9_at_crash_points(point, broker_factory) -> None:
    args = ENGINE_ARGS + ["--compaction-interval-s", "0.5", "--compaction-min-objects", "2",
                          "--cleanup-interval-s", "0.5"]
    env = {"S3KAFKA_CRASH_POINT": point}
    if point != "during_compaction":
        env["S3KAFKA_CRASH_AFTER"] = "3"        # a few uploads succeed first
    b = broker_factory(args, env=env)
    create_topic(b.bootstrap, "c")
    acked: list[bytes] = []
    deadline = time.monotonic() + 60
    n = 0
    while b.running and time.monotonic() < deadline:
        acked += produce(b.bootstrap, "c", _values(200, f"{point}{n}"), timeout=5,
                         stop_on_error=True)
        n += 1
    assert not b.running, "the crash point was reached"
    assert b.proc.returncode == 137
    orphans = _prepared_keys(b.data_dir)
    if point != "after_commit":
        assert any((b.data_dir / "objects" / k).exists() for k in orphans), \
            "the crash left uploaded but uncommitted objects"
    b.env = None
    b.start()
    assert not any((b.data_dir / "objects" / k).exists() for k in orphans), \
        "uncommitted objects are deleted at start"
    recs = consume_all(b.bootstrap, "c", timeout=60, at_least=len(acked))
    check_log(recs, acked)
    # and the restarted broker keeps going
    more = produce(b.bootstrap, "c", _values(100, "after"))
    recs = consume_all(b.bootstrap, "c", len(recs) + 100)
    check_log(recs, acked + more)


def _objects(data_dir) -> set[str]:
    return {str(p) for p in (data_dir / "objects").rglob("*") if p.is_file()}


def test_corrupt_object_fails_its_partition_only(broker_factory) -> None:
    b = broker_factory(ENGINE_ARGS + ["--stream-object-threshold-bytes", "1"])
    create_topic(b.bootstrap, "k", partitions=2)
    acked0 = produce(b.bootstrap, "k", _values(500, "p0"), partition=0)
    b.stop()                                    # p0's data is uploaded, the WAL trimmed
    mine = _objects(b.data_dir)
    assert mine
    b.start()
    acked1 = produce(b.bootstrap, "k", _values(500, "p1"), partition=1)
    b.stop()
    for path in mine:                           # flip bytes inside the data blocks
        raw = bytearray(open(path, "rb").read())
        for i in range(40, len(raw) // 2, 997):
            raw[i] ^= 0x5A
        open(path, "wb").write(bytes(raw))
    b.start()
    check_log(consume_all(b.bootstrap, "k", 500, partition=1), acked1)
    got = consume_all(b.bootstrap, "k", 1, partition=0, timeout=5)
    assert got == [], "a corrupt range is never served"
    assert "corrupt object" in b.log_text()
    assert b.running and acked0
    check_log(consume_all(b.bootstrap, "k", 500, partition=1), acked1)


def test_delete_records_and_compaction_shrink_the_store(broker_factory) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    b = broker_factory(ENGINE_ARGS + ["--stream-object-threshold-bytes", str(1 << 30),
                                      "--cleanup-interval-s", "0.3"])
    create_topic(b.bootstrap, "r")
    acked = []
    for i in range(6):                          # six uploads -> six stream set objects
        acked += produce(b.bootstrap, "r", _values(300, f"r{i}"))
        b.stop()
        b.start()
    n0 = len(_objects(b.data_dir))
    assert n0 >= 6
    admin = AdminClient({"bootstrap.servers": b.bootstrap})
    res = admin.delete_records([TopicPartition("r", 0, 900)])
    for f in res.values():
        f.result(30)
    deadline = time.monotonic() + 30
    while len(_objects(b.data_dir)) > n0 - 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_objects(b.data_dir)) <= n0 - 3, "objects below the new start were deleted"
    tail = consume_all(b.bootstrap, "r", start=900)
    assert [o for o, _ in tail] == list(range(900, 1800))
    assert [v for _, v in tail] == acked[900:]
    # compaction: same records, fewer objects
    n1 = len(_objects(b.data_dir))
    b.stop()
    b.args += ["--compaction-interval-s", "0.5", "--compaction-min-objects", "2"]
    b.start()
    deadline = time.monotonic() + 30
    while len(_objects(b.data_dir)) >= n1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_objects(b.data_dir)) < n1
    tail = consume_all(b.bootstrap, "r", start=900)
    assert [o for o, _ in tail] == list(range(900, 1800))
    assert [v for _, v in tail] == acked[900:]
