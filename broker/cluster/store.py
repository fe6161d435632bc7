"""The cluster's tables in the shared metadata database: brokers, controller, assignments.

Standard SQL only (``?`` placeholders, INSERT ... ON CONFLICT), so the same statements run on
SQLite (several processes on one file: WAL journal mode, busy timeout) and PostgreSQL. Every
change another broker must notice bumps ``cluster_state.version`` in the same transaction, so
watchers poll one row and reload the rest only when it moved. Changes a stale broker could
make are compare-and-set on an epoch (controller epoch, partition leader epoch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from storage import sqldb
from storage.metastore import WAL_ACTIVE, WAL_TAKING_OVER

from .changes import CHANNEL as CHANGES_CHANNEL

STEPS: list[sqldb.Step] = [(1, """
CREATE TABLE IF NOT EXISTS cluster_brokers (
    node_id BIGINT PRIMARY KEY, host TEXT NOT NULL, port INTEGER NOT NULL, rack TEXT,
    instance TEXT NOT NULL, state TEXT NOT NULL, lease_until_ms BIGINT NOT NULL,
    home TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cluster_controller (
    id INTEGER PRIMARY KEY, node_id BIGINT NOT NULL, epoch BIGINT NOT NULL,
    lease_until_ms BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS cluster_state (id INTEGER PRIMARY KEY, version BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS cluster_assignments (
    topic_id TEXT NOT NULL, partition_index INTEGER NOT NULL, leader BIGINT NOT NULL,
    leader_epoch BIGINT NOT NULL, replicas INTEGER NOT NULL, state TEXT NOT NULL,
    target BIGINT NOT NULL, PRIMARY KEY (topic_id, partition_index));
CREATE TABLE IF NOT EXISTS cluster_leader_epochs (
    topic_id TEXT NOT NULL, partition_index INTEGER NOT NULL, leader_epoch BIGINT NOT NULL,
    start_offset BIGINT NOT NULL, PRIMARY KEY (topic_id, partition_index, leader_epoch));
INSERT INTO cluster_state(id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING
"""), (2, """
ALTER TABLE cluster_brokers ADD COLUMN node_epoch BIGINT NOT NULL DEFAULT 0;
ALTER TABLE cluster_brokers ADD COLUMN taker BIGINT NOT NULL DEFAULT -1;
ALTER TABLE cluster_brokers ADD COLUMN takeover_epoch BIGINT NOT NULL DEFAULT 0
"""), (3, """
ALTER TABLE cluster_brokers ADD COLUMN listeners TEXT NOT NULL DEFAULT ''
"""), (4, """
ALTER TABLE cluster_brokers ADD COLUMN lease_ms BIGINT NOT NULL DEFAULT 0
""")]

ACTIVE, MOVING = "active", "moving"
LIVE, DRAINING, STOPPED = "live", "draining", "stopped"
# failover: the lease lapsed, the node epoch was bumped and ``taker`` recovers its WAL
# (FENCED); once that returned its partitions were reassigned (TAKEN_OVER). Both end when
# the node registers again (with its bumped epoch).
FENCED, TAKEN_OVER = "fenced", "taken_over"


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class BrokerRow:
    node_id: int
    host: str
    port: int
    rack: str | None
    instance: str
    state: str
    lease_until_ms: int
    node_epoch: int = 0
    taker: int = -1
    takeover_epoch: int = 0
    home: str = ""          # "host:WAL path" (SQLite metadata: one host only)
    listeners: str = ""       # advertised named listeners, NAME://host:port,... (listeners.py)
    lease_ms: int = 0        # the broker's own lease length (0: registered before step 4)


@dataclass
class Assignment:
    topic_id: str
    partition: int
    leader: int
    leader_epoch: int
    replicas: int
    state: str
    target: int


class NodeIdInUse(Exception):
    """Another live broker registered this node id."""


class ClusterStore:
    """Blocking calls (run them in a thread) on one ``storage.sqldb`` connection (SQLite or
    PostgreSQL); every multi-row change is one transaction."""

    def __init__(self, url: str) -> None:
        self.db = sqldb.connect(url)
        self.db.migrate("cluster", STEPS)
        # lease renewals on a connection of their own: on the shared one they queued behind
        # any cluster transaction waiting for a row lock (another broker paused inside its
        # transaction), so this broker's lease lapsed too and a healthy broker was fenced.
        # (SQLite: one writer at a time anyway, and a transaction there cannot be cut short.)
        self._beat_db = sqldb.connect(url) if self.db.is_postgres else self.db

    def _tx(self, body: Any, durable: bool = True) -> Any:
        """Run ``body(tx)`` in one transaction (retried on PostgreSQL serialization failures);
        ``durable``: as ``sqldb.Database.transact``."""
        return self.db.transact(body, durable)

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        return self.db.query(sql, args)

    def _bump(self, db: Any) -> None:
        db.execute("UPDATE cluster_state SET version = version + 1 WHERE id = 1")
        if self.db.is_postgres:
            # delivered to every LISTENing broker when (and only if) this transaction
            # commits: they act at once instead of on their next poll (changes.py)
            db.query(f"SELECT pg_notify('{CHANGES_CHANNEL}', '')")

    def version(self) -> int:
        return int(self._query("SELECT version FROM cluster_state WHERE id = 1")[0][0])

    def bump(self) -> None:
        def body(db: Any) -> Any:
            self._bump(db)
        return self._tx(body)

    # ---- membership ---------------------------------------------------------------------
    def register(self, node_id: int, host: str, port: int, rack: str | None, instance: str,
                 lease_ms: int, home: str, node_epoch: int | None = None,
                 listeners: str = "") -> None:
        """Insert or take over this node id's row; NodeIdInUse while another instance holds a
        live lease, unless it has the same ``home`` (host and WAL: the same broker restarted
        after a crash; the WAL's lock proves the old process is gone)."""
        now = now_ms()
        def body(db: Any) -> Any:
            row = db.query_one("SELECT host, port, instance, state, lease_until_ms, home, "
                               "node_epoch FROM cluster_brokers WHERE node_id = ?", (node_id,))
            if row is not None and node_epoch is not None and (
                    row[3] == FENCED or (row[3] == TAKEN_OVER and node_epoch < row[6])):
                # fenced between the epoch check at start and now: start again
                raise NodeIdInUse(f"node id {node_id} was fenced while starting (its WAL is "
                                  f"taken over); start it again")
            if row is not None and row[2] != instance and row[3] != STOPPED \
                    and row[4] > now and row[5] != home:
                raise NodeIdInUse(f"node id {node_id} is already used by a live broker at "
                                  f"{row[0]}:{row[1]}")
            db.execute("INSERT INTO cluster_brokers(node_id, host, port, rack, instance, state, "
                       "lease_until_ms, home, listeners, lease_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, "
                       "?) ON CONFLICT "
                       "(node_id) DO UPDATE SET host = excluded.host, port = excluded.port, "
                       "rack = excluded.rack, instance = excluded.instance, state = "
                       "excluded.state, lease_until_ms = excluded.lease_until_ms, home = "
                       "excluded.home, listeners = excluded.listeners, lease_ms = excluded.lease_ms",
                       (node_id, host, port, rack, instance, LIVE, now + lease_ms, home,
                        listeners, lease_ms))
            self._bump(db)
        return self._tx(body)

    def heartbeat(self, node_id: int, instance: str, lease_ms: int) -> bool:
        """Renew the lease; False when another instance took the node id over or this one
        was fenced (its lease had lapsed: a zombie never gets it back). The lease column
        strictly increases with every renewal: others watch it change on their own monotonic
        clocks (broker/cluster/lease.py), whatever this host's wall clock does."""
        def body(db: Any) -> Any:
            until = now_ms() + lease_ms
            n = db.execute("UPDATE cluster_brokers SET lease_until_ms = CASE WHEN ? > "
                           "lease_until_ms THEN ? ELSE lease_until_ms + 1 END WHERE node_id = ? "
                           "AND instance = ? AND state NOT IN (?, ?)",
                           (until, until, node_id, instance, FENCED, TAKEN_OVER))
            return n == 1
        # not flushed on SQLite (sqldb ``relax``): a renewal only matters while this host is
        # up. PostgreSQL keeps its synchronous commit: a server crash there must not take back
        # a renewal the brokers on other hosts may not have seen (broker/cluster/lease.py)
        return self._beat_db.transact(body, durable=False)

    def set_state(self, node_id: int, instance: str, state: str, expire: bool = False) -> None:
        def body(db: Any) -> Any:
            if expire:
                db.execute("UPDATE cluster_brokers SET state = ?, lease_until_ms = 0 WHERE "
                           "node_id = ? AND instance = ? AND state NOT IN (?, ?)",
                           (state, node_id, instance, FENCED, TAKEN_OVER))
            else:
                db.execute("UPDATE cluster_brokers SET state = ? WHERE node_id = ? AND "
                           "instance = ? AND state NOT IN (?, ?)",
                           (state, node_id, instance, FENCED, TAKEN_OVER))
            self._bump(db)
        return self._tx(body)

    def brokers(self) -> list[BrokerRow]:
        return [BrokerRow(*r) for r in self._query(
            "SELECT node_id, host, port, rack, instance, state, lease_until_ms, node_epoch, "
            "taker, takeover_epoch, home, listeners, lease_ms FROM cluster_brokers "
            "ORDER BY node_id")]

    def broker(self, node_id: int) -> BrokerRow | None:
        rows = [b for b in self.brokers() if b.node_id == node_id]
        return rows[0] if rows else None

    # ---- failover -------------------------------------------------------------------------
    def fence(self, node_id: int, instance: str, lease_until_ms: int, taker: int,
              controller: tuple[int, int]) -> BrokerRow | None:
        """The controller fences a broker whose lease lapsed: node epoch + 1, state FENCED,
        ``taker`` assigned at takeover epoch + 1. CAS on the row as the controller saw it (a
        broker that renewed or re-registered meanwhile is left alone). Returns the new row."""
        def body(db: Any) -> Any:
            if not self._is_controller(db, *controller):
                return None
            n = db.execute("UPDATE cluster_brokers SET state = ?, node_epoch = node_epoch + 1, "
                           "taker = ?, takeover_epoch = takeover_epoch + 1 WHERE node_id = ? "
                           "AND instance = ? AND lease_until_ms = ? AND state IN (?, ?)",
                           (FENCED, taker, node_id, instance, lease_until_ms, LIVE, DRAINING))
            if n != 1:
                return None
            if db.query_one("SELECT 1 FROM schema_migrations WHERE component = ? AND "
                            "version >= 3", ("engine",)) is not None:
                # the WAL registry (storage/metastore.py, engine step 3) marks the WAL taken
                # over in the same transaction: the fenced node's uploads are refused from
                # the fence on (commit_objects' wal_owner check), not only once the taker
                # begins - a zombie resumed in between commits nothing (issue 17). The taker's
                # begin_wal_takeover accepts it (same taker and takeover epoch, or a newer one)
                db.execute("UPDATE s3_wals SET state = ?, taken_over_by = ?, "
                           "taken_over_epoch = (SELECT takeover_epoch FROM cluster_brokers "
                           "WHERE node_id = ?), updated_ms = ? WHERE node_id = ? AND "
                           "state = ?", (WAL_TAKING_OVER, taker, node_id, now_ms(), node_id,
                                         WAL_ACTIVE))
            self._bump(db)
            return True
        return self.broker(node_id) if self._tx(body) else None

    def assign_taker(self, node_id: int, takeover_epoch: int, taker: int,
                     controller: tuple[int, int]) -> bool:
        """A new taker (the previous one failed or left) at takeover epoch + 1 (CAS)."""
        def body(db: Any) -> Any:
            if not self._is_controller(db, *controller):
                return False
            n = db.execute("UPDATE cluster_brokers SET taker = ?, takeover_epoch = "
                           "takeover_epoch + 1 WHERE node_id = ? AND state = ? AND "
                           "takeover_epoch = ?", (taker, node_id, FENCED, takeover_epoch))
            if n == 1:
                self._bump(db)
            return n == 1
        return self._tx(body)

    def takeover_failed(self, node_id: int, takeover_epoch: int) -> None:
        """The taker gives the takeover back (the controller picks a taker again)."""
        def body(db: Any) -> Any:
            if db.execute("UPDATE cluster_brokers SET taker = -1 WHERE node_id = ? AND "
                          "state = ? AND takeover_epoch = ?",
                          (node_id, FENCED, takeover_epoch)) == 1:
                self._bump(db)
        return self._tx(body)

    def finish_takeover(self, node_id: int, takeover_epoch: int,
                        leaders: dict[tuple[str, int], int]) -> list[Assignment] | None:
        """The taker recovered the WAL: mark the node TAKEN_OVER and hand each of its
        partitions to a live broker at leader epoch + 1, in one transaction (CAS on the
        takeover epoch). ``leaders``: partition -> new leader. Returns the moved rows."""
        def body(db: Any) -> Any:
            if db.execute("UPDATE cluster_brokers SET state = ?, taker = -1 WHERE node_id = ? "
                          "AND state = ? AND takeover_epoch = ?",
                          (TAKEN_OVER, node_id, FENCED, takeover_epoch)) != 1:
                return None
            moved = []
            for r in db.query("SELECT topic_id, partition_index, leader, leader_epoch, "
                              "replicas, state, target FROM cluster_assignments WHERE "
                              "leader = ?", (node_id,)):
                a = Assignment(*r)
                new = leaders.get((a.topic_id, a.partition))
                if new is None:
                    continue
                db.execute("UPDATE cluster_assignments SET leader = ?, leader_epoch = ?, "
                           "state = ?, target = -1 WHERE topic_id = ? AND partition_index = ? "
                           "AND leader_epoch = ?", (new, a.leader_epoch + 1, ACTIVE,
                                                    a.topic_id, a.partition, a.leader_epoch))
                moved.append(Assignment(a.topic_id, a.partition, new, a.leader_epoch + 1,
                                        a.replicas, ACTIVE, -1))
            self._bump(db)
            return moved
        return self._tx(body)

    def record_epoch_start(self, topic_id: str, partition: int, leader_epoch: int,
                           start_offset: int) -> None:
        """Where a leader epoch began (a failover's new leader records it when it opens)."""
        def body(db: Any) -> Any:
            db.execute("INSERT INTO cluster_leader_epochs(topic_id, partition_index, "
                       "leader_epoch, start_offset) VALUES (?, ?, ?, ?) ON CONFLICT "
                       "(topic_id, partition_index, leader_epoch) DO NOTHING",
                       (topic_id, partition, leader_epoch, start_offset))
        return self._tx(body)

    # ---- controller ---------------------------------------------------------------------
    def elect(self, node_id: int, epoch: int, lease_ms: int) -> tuple[int, int]:
        """Renew our controller lease, or take it over when it expired. Returns the current
        (controller node id, controller epoch)."""
        now = now_ms()
        def body(db: Any) -> Any:
            row = db.query_one("SELECT node_id, epoch, lease_until_ms FROM cluster_controller "
                             "WHERE id = 1")
            if row is None:
                db.execute("INSERT INTO cluster_controller(id, node_id, epoch, lease_until_ms) "
                           "VALUES (1, ?, 1, ?)", (node_id, now + lease_ms))
                self._bump(db)
                return node_id, 1
            cur_node, cur_epoch, until = row
            if cur_node == node_id and cur_epoch == epoch:
                db.execute("UPDATE cluster_controller SET lease_until_ms = ? WHERE id = 1 AND "
                           "epoch = ?", (now + lease_ms, epoch))
                return node_id, epoch
            if until < now:
                db.execute("UPDATE cluster_controller SET node_id = ?, epoch = ?, "
                           "lease_until_ms = ? WHERE id = 1 AND epoch = ?",
                           (node_id, cur_epoch + 1, now + lease_ms, cur_epoch))
                self._bump(db)
                return node_id, cur_epoch + 1
            return cur_node, cur_epoch
        return self._tx(body, durable=False)   # run every beat: as ``heartbeat``

    def resign(self, node_id: int, epoch: int) -> None:
        def body(db: Any) -> Any:
            db.execute("UPDATE cluster_controller SET lease_until_ms = 0 WHERE id = 1 AND "
                       "node_id = ? AND epoch = ?", (node_id, epoch))
            self._bump(db)
        return self._tx(body)

    # ---- assignments --------------------------------------------------------------------
    def assignments(self) -> list[Assignment]:
        return [Assignment(*r) for r in self._query(
            "SELECT topic_id, partition_index, leader, leader_epoch, replicas, state, target "
            "FROM cluster_assignments")]

    def assign_new(self, topic_id: str, first: int, leaders: list[int], replicas: int) -> None:
        """Rows for new partitions (written before the topic itself, so that no broker ever
        sees the topic without them; a leftover of a failed creation is overwritten)."""
        def body(db: Any) -> Any:
            for i, leader in enumerate(leaders):
                db.execute("INSERT INTO cluster_assignments(topic_id, partition_index, leader, "
                           "leader_epoch, replicas, state, target) VALUES (?, ?, ?, 0, ?, ?, -1) "
                           "ON CONFLICT (topic_id, partition_index) DO UPDATE SET leader = "
                           "excluded.leader, leader_epoch = 0, replicas = excluded.replicas, "
                           "state = excluded.state, target = -1",
                           (topic_id, first + i, leader, replicas, ACTIVE))
            self._bump(db)
        return self._tx(body)

    def claim_unassigned(self, topic_id: str, count: int, node_id: int) -> None:
        """Partitions without a row (topics from before the cluster existed) go to ``node_id``."""
        def body(db: Any) -> Any:
            for i in range(count):
                db.execute("INSERT INTO cluster_assignments(topic_id, partition_index, leader, "
                           "leader_epoch, replicas, state, target) VALUES (?, ?, ?, 0, 1, ?, -1) "
                           "ON CONFLICT (topic_id, partition_index) DO NOTHING",
                           (topic_id, i, node_id, ACTIVE))
        return self._tx(body)

    def delete_topic(self, topic_id: str) -> None:
        def body(db: Any) -> Any:
            db.execute("DELETE FROM cluster_assignments WHERE topic_id = ?", (topic_id,))
            db.execute("DELETE FROM cluster_leader_epochs WHERE topic_id = ?", (topic_id,))
            self._bump(db)
        return self._tx(body)

    def start_move(self, topic_id: str, partition: int, leader_epoch: int, target: int,
                   controller: tuple[int, int] | None = None) -> bool:
        """Ask the leader to hand the partition to ``target`` (CAS on the leader epoch and, for
        the controller's own moves, on the controller epoch)."""
        def body(db: Any) -> Any:
            if controller is not None and not self._is_controller(db, *controller):
                return False
            n = db.execute("UPDATE cluster_assignments SET state = ?, target = ? WHERE "
                             "topic_id = ? AND partition_index = ? AND leader_epoch = ? AND "
                             "leader <> ?", (MOVING, target, topic_id, partition, leader_epoch,
                                             target))
            if n == 1:
                self._bump(db)
            return n == 1
        return self._tx(body)

    def cancel_move(self, topic_id: str, partition: int, leader_epoch: int) -> bool:
        def body(db: Any) -> Any:
            n = db.execute("UPDATE cluster_assignments SET state = ?, target = -1 WHERE "
                             "topic_id = ? AND partition_index = ? AND leader_epoch = ? AND "
                             "state = ?", (ACTIVE, topic_id, partition, leader_epoch, MOVING))
            if n == 1:
                self._bump(db)
            return n == 1
        return self._tx(body)

    def hand_over(self, topic_id: str, partition: int, node_id: int, leader_epoch: int,
                  end_offset: int) -> int | None:
        """The old leader, after releasing the partition: leadership passes to the target at
        leader_epoch + 1 (CAS). Returns the new leader, None when the row changed meanwhile."""
        def body(db: Any) -> Any:
            row = db.query_one("SELECT target FROM cluster_assignments WHERE topic_id = ? AND "
                             "partition_index = ? AND leader = ? AND leader_epoch = ? AND "
                             "state = ?", (topic_id, partition, node_id, leader_epoch,
                                           MOVING))
            if row is None or row[0] < 0:
                return None
            db.execute("UPDATE cluster_assignments SET leader = ?, leader_epoch = ?, state = ?, "
                       "target = -1 WHERE topic_id = ? AND partition_index = ?",
                       (row[0], leader_epoch + 1, ACTIVE, topic_id, partition))
            db.execute("INSERT INTO cluster_leader_epochs(topic_id, partition_index, "
                       "leader_epoch, start_offset) VALUES (?, ?, ?, ?) ON CONFLICT "
                       "(topic_id, partition_index, leader_epoch) DO NOTHING",
                       (topic_id, partition, leader_epoch + 1, end_offset))
            self._bump(db)
            return int(row[0])
        return self._tx(body)

    def leader_epochs(self, topic_id: str, partition: int) -> list[tuple[int, int]]:
        """(leader epoch, start offset) of every epoch after the first, ascending."""
        return [(int(a), int(b)) for a, b in self._query(
            "SELECT leader_epoch, start_offset FROM cluster_leader_epochs WHERE topic_id = ? "
            "AND partition_index = ? ORDER BY leader_epoch", (topic_id, partition))]

    @staticmethod
    def _is_controller(db: Any, node_id: int, epoch: int) -> bool:
        row = db.query_one("SELECT 1 FROM cluster_controller WHERE id = 1 AND node_id = ? AND "
                         "epoch = ?", (node_id, epoch))
        return row is not None

    def close(self) -> None:
        self.db.close()
        if self._beat_db is not self.db:
            self._beat_db.close()


def describe(rows: list[Any]) -> str:
    return ",".join(str(r) for r in rows)
