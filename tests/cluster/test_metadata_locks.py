"""A broker paused inside a metadata transaction (SIGSTOP, a frozen VM) holds its row locks.

Seen in the 30-minute chaos run of session 18: a broker SIGSTOPped while its transaction had
updated the controller row (every controller renews it each second) or bumped cluster_state
blocked every other broker's cluster transactions until SIGCONT, 30 s later. Their heartbeat
loops waited behind those transactions, so their own leases lapsed (answers withheld, one
healthy broker fenced) and nobody could fence the paused broker (its fence bumps cluster_state
too). Now PostgreSQL ends a session idle inside a transaction after
``sqldb.IDLE_IN_TRANSACTION_MS``, and lease renewals run on a connection and a thread of their
own, apart from the controller election. Real PostgreSQL, real broker processes.
"""
from __future__ import annotations

import re
import threading
import time

import pytest

from storage import sqldb
from .kit import FAILOVER_FLAGS
from .timed_load import TimedLoad, create_topic

pytestmark = pytest.mark.e2e


def test_a_session_idle_inside_a_transaction_loses_its_locks(postgres, monkeypatch) -> None:
    """A connection whose client stops between two statements of a transaction (as a paused
    broker's does) is ended by the server after IDLE_IN_TRANSACTION_MS: another session's
    update of the same row goes through then, not when the paused one wakes; the paused one
    finds its connection lost (its transaction rolled back), and the next call reconnects."""
    monkeypatch.setattr(sqldb, "IDLE_IN_TRANSACTION_MS", 500, raising=False)
    url = postgres.new_database()
    paused, other = sqldb.connect(url), sqldb.connect(url)
    try:
        paused.execute("CREATE TABLE t (id INT PRIMARY KEY, v INT)")
        paused.execute("INSERT INTO t VALUES (1, 0)")
        done = threading.Event()
        with pytest.raises(Exception) as lost:   # noqa: PT011 - its message is checked below
            with paused.transaction() as tx:
                tx.execute("UPDATE t SET v = v + 1 WHERE id = 1")
                t = threading.Thread(target=lambda: (other.transact(
                    lambda o: o.execute("UPDATE t SET v = v + 10 WHERE id = 1")), done.set()))
                t.start()
                # "paused" for 8 s inside the transaction: the other update must not wait
                assert done.wait(8.0), "an update waited for a session idle in its transaction"
                tx.execute("UPDATE t SET v = v + 100 WHERE id = 1")
        # the server ended the session (rolled its transaction back): one line, retriable
        assert "idle-in-transaction timeout" in str(lost.value), repr(lost.value)
        t.join(5)
        assert paused.query("SELECT v FROM t") == [(10,)] == other.query("SELECT v FROM t")
    finally:
        paused.close()
        other.close()


@pytest.mark.slow
def test_a_metadata_lock_held_past_the_lease_lapses_no_lease(broker_factory, tmp_path,
                                                              postgres) -> None:
    """Another session holds the controller row and cluster_state locked for three leases
    (what a controller paused inside its renewal transaction does): the brokers' elections
    and watch rounds wait, but their leases keep being renewed - no broker's lease lapses,
    none is fenced, and produce acknowledgements keep coming during the hold."""
    import psycopg  # noqa: PLC0415

    url = postgres.new_database()
    shared = ["--object-store", f"file://{tmp_path}/objects", "--metadata", url,
              *FAILOVER_FLAGS, "--upload-interval-s", "2"]
    brokers = [broker_factory(["--node-id", str(i), "--rack", f"r{i}", *shared])
               for i in range(2)]
    boot = ",".join(b.bootstrap for b in brokers)
    create_topic(boot, "locks", live=2)
    load = TimedLoad(boot, "locks")
    hold_s = 3 * 2.0                              # three leases (FAILOVER_FLAGS: 2 s)
    try:
        load.wait_every_partition()
        with psycopg.connect(url, autocommit=True) as lock:
            with lock.transaction():
                lock.execute("UPDATE cluster_controller SET lease_until_ms = lease_until_ms "
                             "WHERE id = 1")
                lock.execute("UPDATE cluster_state SET version = version WHERE id = 1")
                t_hold = time.monotonic()
                time.sleep(hold_s)
                t_end = time.monotonic()
        late = [t for *_, t in list(load.acked) if t_hold + 4.0 < t < t_end]
        time.sleep(2.0)
        logs = "\n".join(b.log_text() for b in brokers)
        assert all(b.running for b in brokers), logs[-3000:]
        assert "lease lapsed" not in logs, re.findall(r".*lease lapsed.*", logs)
        assert "broker fenced" not in logs, re.findall(r".*broker fenced.*", logs)
        # acknowledged past two leases into the hold (withheld while a lease has lapsed)
        assert late, "no produce acknowledged in the last 2 s of the hold"
    finally:
        load.stop()
    assert not load.errors, load.errors[:5]
