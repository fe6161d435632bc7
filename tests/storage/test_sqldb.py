"""storage.sqldb on SQLite and a real PostgreSQL: migrations, transactions, compare-and-set."""
from __future__ import annotations

import threading
import time

import pytest

from bench.ports import free_port
from storage import sqldb

STEPS = [(1, "CREATE TABLE t_items (id @ID@, name TEXT NOT NULL, data @BLOB@,"
             " created_ms BIGINT NOT NULL DEFAULT @NOW_MS@);"
             " CREATE TABLE t_owner (k TEXT PRIMARY KEY, owner BIGINT NOT NULL,"
             " epoch BIGINT NOT NULL)")]


def test_migrations_apply_once_and_in_order(metadata_url: str) -> None:
    db = sqldb.connect(metadata_url)
    assert db.migrate("t", STEPS) == 1
    assert db.migrate("t", STEPS) == 1                      # nothing re-applied
    more = STEPS + [(2, "ALTER TABLE t_items ADD COLUMN size BIGINT NOT NULL DEFAULT 0")]
    assert db.migrate("t", more) == 2
    db.close()
    db = sqldb.connect(metadata_url)                        # a restart sees version 2
    assert db.migrate("t", more) == 2
    assert db.query("SELECT component, version FROM schema_migrations ORDER BY version") == [
        ("t", 1), ("t", 2)]
    with db.transaction() as tx:
        new_id = tx.insert_id("INSERT INTO t_items(name, data) VALUES (?, ?) RETURNING id",
                              ("50% off?", b"\x00\xff"))
    assert db.query("SELECT name, data, size FROM t_items WHERE id=?", (new_id,)) == [
        ("50% off?", b"\x00\xff", 0)]
    db.close()


def test_concurrent_starts_migrate_once(metadata_url: str) -> None:
    """Brokers starting together: every one ends at the same version, no error."""
    results: list[object] = []

    def start() -> None:
        try:
            db = sqldb.connect(metadata_url)
            results.append(db.migrate("t", STEPS + [(2, "CREATE INDEX t_items_name ON"
                                                         " t_items(name)")]))
            db.close()
        except Exception as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [2, 2, 2, 2]


def test_transaction_rolls_back_every_row(metadata_url: str) -> None:
    db = sqldb.connect(metadata_url)
    db.migrate("t", STEPS)
    with pytest.raises(RuntimeError):
        with db.transaction() as tx:
            tx.execute("INSERT INTO t_items(name) VALUES (?)", ("a",))
            tx.execute("INSERT INTO t_items(name) VALUES (?)", ("b",))
            raise RuntimeError("boom")
    assert db.query("SELECT name FROM t_items") == []
    db.close()


def test_compare_and_set_fences_a_stale_epoch(metadata_url: str) -> None:
    db = sqldb.connect(metadata_url)
    db.migrate("t", STEPS)
    db.execute("INSERT INTO t_owner VALUES ('p0', 1, 7)")
    with db.transaction() as tx:                            # broker 2 takes over: epoch 8
        tx.compare_and_set("t_owner", {"k": "p0"}, "epoch", 7, {"owner": 2, "epoch": 8})
    with pytest.raises(sqldb.StaleEpoch, match="expected epoch=7, found epoch=8"):
        with db.transaction() as tx:                        # broker 1 still thinks epoch 7
            tx.execute("INSERT INTO t_items(name) VALUES ('stale write')")
            tx.compare_and_set("t_owner", {"k": "p0"}, "epoch", 7, {"owner": 1, "epoch": 8})
    assert db.query("SELECT owner, epoch FROM t_owner") == [(2, 8)]
    assert db.query("SELECT name FROM t_items") == []       # the whole transaction is gone
    db.close()


def test_contended_read_modify_write_loses_nothing(metadata_url: str) -> None:
    """Several connections (as several brokers) increment one counter through ``transact``:
    serialization failures are retried, every increment counts."""
    setup = sqldb.connect(metadata_url)
    setup.migrate("t", STEPS)
    setup.execute("INSERT INTO t_owner VALUES ('n', 0, 0)")
    errors: list[Exception] = []

    def bump(tx: sqldb.Tx) -> None:
        (n,) = tx.query_one("SELECT owner FROM t_owner WHERE k='n'")
        time.sleep(0.001)
        tx.execute("UPDATE t_owner SET owner=? WHERE k='n'", (n + 1,))

    def worker() -> None:
        db = sqldb.connect(metadata_url)
        try:
            for _ in range(20):
                db.transact(bump)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            db.close()

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert setup.query("SELECT owner FROM t_owner WHERE k='n'") == [(60,)]
    setup.close()


def test_unreachable_postgres_is_one_clear_line() -> None:
    port = _closed_port()
    started = time.monotonic()
    with pytest.raises(sqldb.MetadataUnreachable) as info:
        sqldb.connect(f"postgresql://u:secret@127.0.0.1:{port}/meta")
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "refused" in msg.lower()
    assert "secret" not in msg and "\n" not in msg
    assert time.monotonic() - started < 10


def _closed_port() -> int:
    """A port nothing listens on, claimed so no other test process listens there meanwhile."""
    return free_port()


def test_lost_postgres_connection_is_reopened(postgres) -> None:
    """The server drops the broker's connection (restart, failover, idle kill): the next
    calls reconnect; a transaction that was open when it broke is rerun, never half-applied."""
    import psycopg  # noqa: PLC0415

    url = postgres.new_database()
    db = sqldb.connect(url)
    db.migrate("t", STEPS)
    db.execute("INSERT INTO t_owner VALUES ('n', 0, 0)")

    def kill(conn_db: sqldb.Database) -> None:
        (pid,) = conn_db.query_one("SELECT pg_backend_pid()")
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    kill(db)
    assert db.query("SELECT owner FROM t_owner") == [(0,)]          # reconnected, retried
    kill(db)
    db.execute("UPDATE t_owner SET owner=5 WHERE k='n'")
    runs = []

    def body(tx: sqldb.Tx) -> None:
        runs.append(1)
        tx.execute("INSERT INTO t_items(name) VALUES ('x')")
        if len(runs) == 1:
            kill(db)                                      # dies in the middle of the body
        tx.execute("UPDATE t_owner SET owner=owner+1 WHERE k='n'")

    db.transact(body)
    assert len(runs) == 2
    assert db.query("SELECT count(*) FROM t_items") == [(1,)]
    assert db.query("SELECT owner FROM t_owner") == [(6,)]
    db.close()


def test_postgres_connections_carry_keepalives_and_a_user_timeout(postgres, monkeypatch) -> None:
    """A dropped route fails a call within about the lease: libpq gets keepalives and
    tcp_user_timeout from configure_timeouts (the broker's lease) unless the URL sets them."""
    for name in ("TCP_USER_TIMEOUT_MS", "KEEPALIVES_IDLE_S", "CALL_TIMEOUT_S"):
        monkeypatch.setattr(sqldb, name, getattr(sqldb, name))   # restored afterwards
    sqldb.configure_timeouts(3000)
    assert sqldb.CALL_TIMEOUT_S == 5.0
    url = postgres.new_database()
    db = sqldb.connect(url)
    dsn = db._b._db.info.dsn
    for part in ("keepalives=1", "keepalives_idle=1", "keepalives_interval=1",
                 "keepalives_count=3", "tcp_user_timeout=3000"):
        assert part in dsn, dsn
    db.close()
    db = sqldb.connect(url + "?tcp_user_timeout=12345")
    assert "tcp_user_timeout=12345" in db._b._db.info.dsn
    db.close()


def test_a_call_running_past_the_deadline_is_cut_and_reported_unreachable(postgres,
                                                                          monkeypatch) -> None:
    """The call watch (for routes a proxy still acknowledges) cuts a call running longer than
    CALL_TIMEOUT_S: the caller gets MetadataUnreachable (one line), the outage episode starts,
    and the next call reconnects and ends it."""
    monkeypatch.setattr(sqldb, "CALL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(sqldb, "OUTAGE_END_QUIET_S", 0.0)
    sqldb.outage.clear()
    db = sqldb.connect(postgres.new_database())
    try:
        t0 = time.monotonic()
        with pytest.raises(sqldb.MetadataUnreachable) as info:
            db.query("SELECT pg_sleep(30)")
        assert time.monotonic() - t0 < 10
        assert "\n" not in str(info.value)
        assert sqldb.outage.active
        assert db.query("SELECT 1") == [(1,)]
        assert not sqldb.outage.active
    finally:
        sqldb.outage.clear()
        db.close()


def test_a_commit_that_need_not_be_durable_is_seen_at_once_and_not_flushed(
        metadata_url: str) -> None:
    """``transact(durable=False)`` (lease renewals): the rows are committed and another
    connection reads them at once; on SQLite that one commit runs at synchronous=NORMAL (no
    flush of the disk) and the connection is back at FULL after it, also after a body that
    failed. PostgreSQL keeps its synchronous commit (cluster/store.py says why)."""
    db = sqldb.connect(metadata_url)
    other = sqldb.connect(metadata_url)
    db.migrate("t", STEPS)
    sqlite = not db.is_postgres
    seen: list[tuple] = []

    def body(tx: sqldb.Tx) -> None:
        tx.execute("INSERT INTO t_items(name) VALUES (?)", ("lease",))
        if sqlite:
            seen.extend(tx.query("PRAGMA synchronous"))

    db.transact(body, durable=False)
    assert other.query("SELECT name FROM t_items") == [("lease",)]
    if sqlite:
        assert seen == [(1,)]                               # NORMAL for that commit
        assert db.query("PRAGMA synchronous") == [(2,)]     # FULL again

        def fails(tx: sqldb.Tx) -> None:
            tx.execute("INSERT INTO t_items(name) VALUES (?)", ("lost",))
            raise RuntimeError("boom")
        with pytest.raises(RuntimeError):
            db.transact(fails, durable=False)
        assert db.query("PRAGMA synchronous") == [(2,)]
        seen.clear()
        db.transact(body)                                   # the default stays durable
        assert seen == [(2,)]
    assert sorted(other.query("SELECT name FROM t_items")) == [("lease",)] * (2 if sqlite else 1)
    db.close()
    other.close()
