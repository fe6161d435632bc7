"""Through the broker: records come back from the object store (file:// and S3), and kill -9
at the engine's crash points loses no acknowledged record."""
from __future__ import annotations

import os
import time

import pytest

from broker_helpers import ENGINE_ARGS, check_log, consume_all, create_topic, produce, s3_url

pytestmark = pytest.mark.e2e


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
    b.env = None
    b.start()
    recs = consume_all(b.bootstrap, "c", timeout=60)
    check_log(recs, acked)
    # and the restarted broker keeps going
    more = produce(b.bootstrap, "c", _values(100, "after"))
    recs = consume_all(b.bootstrap, "c", len(recs) + 100)
    check_log(recs, acked + more)
