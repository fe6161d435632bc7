"""Being told at once that the cluster changed, instead of finding out on the next poll.

Every change another broker must act on (a move requested, a partition handed over, a broker
fenced, a takeover finished) bumps ``cluster_state.version`` in its transaction. A watch round
every 200 ms found it: a move waited up to two such rounds (the leader noticing the request, the
new leader noticing the hand-over), a failover one more (the taker noticing the fence), and on
a loaded machine the rounds ran late. ``ChangeWatch`` runs one daemon thread with its own
connection that wakes the room's watch loop as soon as the version moves:

- PostgreSQL: ``LISTEN s3kafka_cluster``; ``ClusterStore._bump`` sends ``pg_notify`` in the
  same transaction, so the notification arrives when (and only if) the change commits;
- SQLite (brokers of one host): a read of the one-row version every 50 ms on a connection of
  its own (a WAL-mode read: it never waits for writers).

The watch loop still polls every 200 ms (leases are observed on that clock, and a missed
notification - a reconnect - costs one poll at most). Nothing here decides anything: it only
shortens the wait before the next round.
"""
from __future__ import annotations

import logging
import sqlite3
import threading
from typing import Callable

from storage import sqldb

log = logging.getLogger("broker.cluster")

CHANNEL = "s3kafka_cluster"
SQLITE_POLL_S = 0.05


class ChangeWatch:
    """``ChangeWatch(url, on_change).start()``; ``on_change()`` is called from the thread
    (make it thread-safe, e.g. ``loop.call_soon_threadsafe``); ``stop()`` ends it."""

    def __init__(self, url: str, on_change: Callable[[], None]) -> None:
        self.url = url
        self.on_change = on_change
        self._stop = threading.Event()
        self._t: threading.Thread | None = None
        self.notified = 0          # changes seen (tests, logs)

    def start(self) -> "ChangeWatch":
        run = self._run_pg if sqldb.is_postgres_url(self.url) else self._run_sqlite
        self._t = threading.Thread(target=self._guard, args=(run,), daemon=True,
                                   name="s3kafka-cluster-changes")
        self._t.start()
        return self

    def stop(self, timeout_s: float = 3.0) -> None:
        """End the thread and wait for it (bounded: a PostgreSQL connect in progress may take
        its connect timeout), so its connection is closed before the broker exits - an open
        SQLite connection at exit leaves the database's -wal file un-checkpointed. Blocking:
        call it from a worker thread."""
        self._stop.set()
        t = self._t
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)
            if t.is_alive():
                log.info("cluster change watch still closing after %.1f s; left behind",
                         timeout_s)

    def _fire(self) -> None:
        self.notified += 1
        try:
            self.on_change()
        except RuntimeError:        # the loop closed (broker stopping)
            self._stop.set()

    def _guard(self, run: Callable[[], None]) -> None:
        delay = 0.5
        while not self._stop.is_set():
            try:
                run()
                delay = 0.5
            except Exception as e:  # noqa: BLE001 - database away: the 200 ms poll carries on
                log.debug("cluster change watch reconnects in %.1fs: %s", delay, e)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)

    def _run_pg(self) -> None:
        import psycopg  # noqa: PLC0415 - only with PostgreSQL metadata

        with psycopg.connect(self.url, autocommit=True, connect_timeout=5,
                             **sqldb.pg_connect_options(self.url)) as conn:
            conn.execute(f"LISTEN {CHANNEL}")
            self._fire()            # anything that changed while not listening
            while not self._stop.is_set():
                got = False
                for _ in conn.notifies(timeout=1.0):
                    got = True
                    break           # one wake per burst; drain the rest below
                if got:
                    for _ in conn.notifies(timeout=0.0):
                        pass
                    self._fire()

    def _run_sqlite(self) -> None:
        path = sqldb.sqlite_path(self.url)
        if path == ":memory:":
            self._stop.set()        # a private database: nobody else changes it
            return
        db = sqlite3.connect(path, timeout=1, check_same_thread=False)
        try:
            last = None
            while not self._stop.is_set():
                row = db.execute("SELECT version FROM cluster_state WHERE id = 1").fetchone()
                v = row[0] if row else None
                if v != last:
                    if last is not None:
                        self._fire()
                    last = v
                self._stop.wait(SQLITE_POLL_S)
        finally:
            db.close()
