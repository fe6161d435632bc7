"""Misconfigured clusters get one clear line: brokers pointed at different object stores,
SQLite metadata shared by brokers of several hosts.

Brokers sharing one SQLite file (one host): a broker joining live brokers with another
object store is refused; a broker alone in its cluster may move its store (its data dir, holding
a file:// store, may have moved). The other misconfigurations of issue 16 are tested beside
their code: another object store on PostgreSQL and an unreachable PostgreSQL URL in
tests/broker/test_broker_postgres.py, two brokers with one node id in test_cluster.py.
"""
from __future__ import annotations

import pathlib
import sqlite3
import time

import pytest
from kafka.admin import KafkaAdminClient

pytestmark = pytest.mark.slow


def test_broker_on_another_object_store_is_refused(broker_factory, tmp_path: pathlib.Path):
    meta = ["--metadata", f"sqlite:///{tmp_path}/meta.db"]
    first = broker_factory(["--node-id", "0", "--object-store", f"file://{tmp_path}/a", *meta])
    with pytest.raises(RuntimeError) as exc:
        broker_factory(["--node-id", "1", "--object-store", f"file://{tmp_path}/b", *meta])
    text = str(exc.value)
    assert "exited with 1" in text and "Traceback" not in text, text
    (line,) = [ln for ln in text.splitlines() if "cannot start" in ln]
    assert f"--object-store file://{tmp_path}/b is not this cluster's object store " \
           f"file://{tmp_path}/a" in line, line
    # the first one keeps serving, alone in its cluster
    admin = KafkaAdminClient(bootstrap_servers=first.bootstrap)
    assert [b["broker_id"] for b in admin.describe_cluster()["brokers"]] == [0]
    admin.close()

    # alone, a broker may move its store: the record follows it
    first.stop()
    moved = broker_factory(["--node-id", "0", "--object-store", f"file://{tmp_path}/b", *meta,
                            "--data-dir", str(first.data_dir)])
    moved.stop()


def test_sqlite_shared_with_a_broker_of_another_host_is_refused(broker_factory,
                                                                tmp_path: pathlib.Path):
    """SQLite metadata serves the brokers of one host (one file, local locks): a broker that
    finds a live broker of another host registered in it refuses to start."""
    meta = ["--metadata", f"sqlite:///{tmp_path}/meta.db", "--object-store",
            f"file://{tmp_path}/objects"]
    first = broker_factory(["--node-id", "0", *meta])
    first.stop()
    # a broker of another host (as its registration would look) holds a live lease
    db = sqlite3.connect(tmp_path / "meta.db")
    with db:
        db.execute("INSERT INTO cluster_brokers(node_id, host, port, rack, instance, state, "
                   "lease_until_ms, home) VALUES (7, 'elsewhere', 9092, NULL, 'x', 'live', ?, "
                   "'otherhost:/var/lib/s3kafka/wal')", (int(time.time() * 1000) + 3600_000,))
    db.close()
    with pytest.raises(RuntimeError) as exc:
        broker_factory(["--node-id", "1", *meta])
    text = str(exc.value)
    assert "exited with 2" in text and "Traceback" not in text, text
    (line,) = [ln for ln in text.splitlines() if "cannot start" in ln]
    assert f"--metadata sqlite:///{tmp_path}/meta.db is shared with live broker 7 on host " \
           "otherhost: SQLite metadata serves brokers of one host only; use --metadata " \
           "postgresql://" in line, line
