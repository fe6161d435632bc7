"""The change watch (broker/cluster/changes.py): a committed cluster change wakes every
broker's watch loop at once (PostgreSQL LISTEN/NOTIFY, SQLite a 50 ms version read) instead of
on its next 200 ms poll; a change rolled back wakes nobody on PostgreSQL."""
from __future__ import annotations

import asyncio
import threading
import time

from broker.cluster.changes import ChangeWatch
from broker.cluster.store import ClusterStore


def _wait(ev: threading.Event, timeout: float = 10.0) -> bool:
    return ev.wait(timeout)


def _watching(store: ClusterStore, fired: threading.Event) -> None:
    """Return once the watcher thread sees changes, ``fired`` cleared. PostgreSQL: its LISTEN
    is in place when it fires its first time (changes missed while it was not listening).
    SQLite: it has read the version once when a bump wakes it (bumped again while it does
    not: a bump before its first read is its starting version). A fixed 0.5 s wait was too
    short under load: with a PostgreSQL watcher later than that, its first fire landed after
    the ``fired.clear()`` and the notification of the test's own bump after the check that a
    rolled-back change notifies nobody."""
    if store.db.is_postgres:
        assert _wait(fired), "the PostgreSQL watcher never started listening"
    else:
        deadline = time.monotonic() + 30
        store.bump()
        while not fired.wait(0.5):
            assert time.monotonic() < deadline, "the SQLite watcher never saw a change"
            store.bump()
    fired.clear()


def test_a_committed_change_wakes_the_watcher(metadata_url: str) -> None:
    store = ClusterStore(metadata_url)
    fired = threading.Event()
    w = ChangeWatch(metadata_url, fired.set).start()
    try:
        _watching(store, fired)
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


async def test_sqlite_watch_on_the_loop_wakes_without_a_thread(tmp_path) -> None:
    """``start(loop)`` with SQLite polls on the event loop: a committed change still wakes the
    watcher (on the loop), no thread of its own runs, and stop() closes its connection."""
    url = f"sqlite:///{tmp_path}/meta.db"
    store = ClusterStore(url)
    loop = asyncio.get_running_loop()
    fired = asyncio.Event()
    w = ChangeWatch(url, fired.set).start(loop)
    try:
        assert w.on_loop and w._t is None
        assert not any(t.name == "s3kafka-cluster-changes" for t in threading.enumerate())
        await asyncio.sleep(0.2)               # the first reads: nothing changed yet
        assert not fired.is_set() and w.notified == 0
        await asyncio.to_thread(store.bump)
        await asyncio.wait_for(fired.wait(), 10)
        assert w.notified == 1
        fired.clear()
        await asyncio.to_thread(store.bump)
        await asyncio.wait_for(fired.wait(), 10)
        assert w.notified == 2
    finally:
        w.stop()
        store.close()
    assert w._db is None and w._handle is None
    await asyncio.sleep(0.15)                  # stopped: no further polls reconnect
    assert w._db is None


async def test_sqlite_watch_on_the_loop_survives_a_missing_table(tmp_path) -> None:
    """A read that fails (no cluster tables yet) only skips polls; once the table exists and
    its version moves, the watcher is woken; stop() from another thread waits for the close."""
    url = f"sqlite:///{tmp_path}/meta.db"
    fired = asyncio.Event()
    w = ChangeWatch(url, fired.set).start(asyncio.get_running_loop())
    w_delay_floor = 0.5
    try:
        await asyncio.sleep(0.1)               # polled once: "no such table", backing off
        assert w._db is None and w._delay > w_delay_floor
        store = ClusterStore(url)
        try:
            await asyncio.sleep(w._delay + 0.2)   # reconnected: the version is seen once
            await asyncio.to_thread(store.bump)
            await asyncio.wait_for(fired.wait(), 10)
        finally:
            store.close()
    finally:
        await asyncio.to_thread(w.stop)
    assert w._db is None and w._closed.is_set()
