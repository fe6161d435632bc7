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
  its own (a WAL-mode read: it never waits for writers). A broker runs it on its event loop
  (``start(loop)``: a timer, a ~5 us read that never waits - a busy database skips a poll);
  a thread of its own woke 20 times a second and took the interpreter lock from the loop
  each time: 40-60 ms of CPU a second on the 2-core test VM, idle or under load (about
  0.04 ms per MiB of the raw produce benchmark, bench/HISTORY.md session 17). Without a
  loop (tests, tools) it still polls from a thread.

The watch loop still polls every 200 ms (leases are observed on that clock, and a missed
notification - a reconnect - costs one poll at most). Nothing here decides anything: it only
shortens the wait before the next round.
"""
from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from typing import Callable

from storage import sqldb

log = logging.getLogger("broker.cluster")

CHANNEL = "s3kafka_cluster"
SQLITE_POLL_S = 0.05
VERSION_SQL = "SELECT version FROM cluster_state WHERE id = 1"
_UNSEEN = object()


class ChangeWatch:
    """``ChangeWatch(url, on_change).start()``; ``on_change()`` is called from the thread
    (make it thread-safe, e.g. ``loop.call_soon_threadsafe``); ``stop()`` ends it.
    ``start(loop)`` with SQLite polls on that loop instead (``on_change`` runs there)."""

    def __init__(self, url: str, on_change: Callable[[], None]) -> None:
        self.url = url
        self.on_change = on_change
        self._stop = threading.Event()
        self._t: threading.Thread | None = None
        self.notified = 0          # changes seen (tests, logs)
        # SQLite on an event loop: the timer, its connection, the last version seen
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._db: sqlite3.Connection | None = None
        self._last: object = _UNSEEN
        self._delay = 0.5
        self._closed = threading.Event()

    @property
    def on_loop(self) -> bool:
        """True when the watch polls on an event loop (no thread of its own)."""
        return self._loop is not None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> "ChangeWatch":
        if loop is not None and not sqldb.is_postgres_url(self.url):
            if sqldb.sqlite_path(self.url) != ":memory:":   # private: nobody else changes it
                self._loop = loop
                self._handle = loop.call_soon(self._poll)
            return self
        run = self._run_pg if sqldb.is_postgres_url(self.url) else self._run_sqlite
        self._t = threading.Thread(target=self._guard, args=(run,), daemon=True,
                                   name="s3kafka-cluster-changes")
        self._t.start()
        return self

    def stop(self, timeout_s: float = 3.0) -> None:
        """End the thread and wait for it (bounded: a PostgreSQL connect in progress may take
        its connect timeout), so its connection is closed before the broker exits - an open
        SQLite connection at exit leaves the database's -wal file un-checkpointed. Blocking:
        call it from a worker thread (or, polling on a loop, from that loop's thread)."""
        self._stop.set()
        loop = self._loop
        if loop is not None:
            try:
                if loop.is_closed():
                    self._close_on_loop()     # nothing runs there any more
                elif _on_thread_of(loop):
                    self._close_on_loop()
                else:
                    loop.call_soon_threadsafe(self._close_on_loop)
                    self._closed.wait(timeout_s)
            except RuntimeError:              # the loop closed meanwhile
                self._close_on_loop()
            return
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

    def _poll(self) -> None:
        """One version read on the loop, then the next poll. Never waits: the connection has
        no busy timeout, and a read that fails (database busy, file gone) only skips polls
        (the watch loop's own 200 ms round still runs), reconnecting with a growing delay."""
        self._handle = None
        if self._stop.is_set():
            return
        delay = SQLITE_POLL_S
        try:
            if self._db is None:
                self._db = sqlite3.connect(sqldb.sqlite_path(self.url), timeout=0,
                                           check_same_thread=False, isolation_level=None)
            rows = self._db.execute(VERSION_SQL).fetchall()   # all: no read left open
            v = rows[0][0] if rows else None
            if v != self._last:
                if self._last is not _UNSEEN:
                    self._fire()
                self._last = v
            self._delay = 0.5
        except sqlite3.Error as e:
            log.debug("cluster change watch read failed (retry in %.1fs): %s", self._delay, e)
            self._close_db()
            delay, self._delay = self._delay, min(self._delay * 2, 5.0)
        if not self._stop.is_set() and self._loop is not None:
            self._handle = self._loop.call_later(delay, self._poll)

    def _close_on_loop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._close_db()
        self._closed.set()

    def _close_db(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:
                pass

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


def _on_thread_of(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the caller runs on ``loop``'s thread (the loop is running here)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
