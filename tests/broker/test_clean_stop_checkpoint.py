"""A clean stop (SIGTERM) closes every connection to the SQLite metadata database, so SQLite
checkpoints its write-ahead log and removes the -wal file: the database file alone holds
everything (a copy or a read-only check of it after a stop sees the whole state)."""
from __future__ import annotations

import pathlib
import time

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

pytestmark = pytest.mark.e2e


def _wal_bytes(db: pathlib.Path) -> int:
    wal = db.with_name(db.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_sigterm_stop_leaves_the_sqlite_wal_checkpointed(broker_factory):
    """Every store's connection and the cluster room's change watch (a thread polling the
    database on its own connection) are closed by the time the process exits."""
    broker = broker_factory(["--group-initial-rebalance-delay-ms", "0"])
    db = broker.data_dir / "meta.db"
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic("ck", 3, 1)])
    admin.close()
    assert db.exists()
    assert _wal_bytes(db) > 0          # the running broker's changes are in the -wal file
    broker.stop()
    text = broker.log_text()
    assert "broker stopped" in text, text[-2000:]
    assert _wal_bytes(db) == 0, f"{db}-wal left with {_wal_bytes(db)} bytes after a clean stop"


def test_change_watch_stop_ends_its_thread_and_connection(metadata_url: str) -> None:
    """ChangeWatch.stop() returns once its thread has ended (its connection closed): before,
    it only set a flag and the thread could still hold its connection when the broker exited."""
    from broker.cluster.changes import ChangeWatch
    from broker.cluster.store import ClusterStore

    store = ClusterStore(metadata_url)          # creates the tables the watch reads
    try:
        w = ChangeWatch(metadata_url, lambda: None).start()
        time.sleep(0.3)                         # connected, inside its wait
        t0 = time.monotonic()
        w.stop()
        assert w._t is not None and not w._t.is_alive()
        assert time.monotonic() - t0 < 3.0
    finally:
        store.close()
