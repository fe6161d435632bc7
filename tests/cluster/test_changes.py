"""The change watch (broker/cluster/changes.py): a committed cluster change wakes every
broker's watch loop at once (PostgreSQL LISTEN/NOTIFY, SQLite a 50 ms version read) instead of
on its next 200 ms poll; a change rolled back wakes nobody on PostgreSQL."""
from __future__ import annotations

import threading
import time

from broker.cluster.changes import ChangeWatch
from broker.cluster.store import ClusterStore


def _wait(ev: threading.Event, timeout: float = 10.0) -> bool:
    return ev.wait(timeout)


def test_a_committed_change_wakes_the_watcher(metadata_url: str) -> None:
    store = ClusterStore(metadata_url)
    fired = threading.Event()
    w = ChangeWatch(metadata_url, fired.set).start()
    try:
        # the PostgreSQL watcher fires once when it starts listening (changes missed while
        # it was not); wait for that, then for a real change
        time.sleep(0.5)
        fired.clear()
        before = w.notified
        store.bump()
        assert _wait(fired), "no wake-up after a committed change"
        assert w.notified > before
        if store.db.is_postgres:
            fired.clear()

            def rolled_back(db) -> None:
                store._bump(db)
                raise RuntimeError("roll back")
            try:
                store._tx(rolled_back)
            except RuntimeError:
                pass
            assert not fired.wait(1.0), "a rolled back change notified"
            store.bump()
            assert _wait(fired)
    finally:
        w.stop()
        store.close()
