"""The engine's metadata: streams, objects and which offsets each object holds.

``MetaStore`` is the interface; ``SqlMetaStore`` implements it on ``storage.sqldb`` (tables
prefixed ``s3_`` of the metadata database: SQLite by default, PostgreSQL for brokers sharing an
object store). Calls block: the engine runs them in a thread. Object lifecycle: prepared (before
the put, so a crash between put and commit leaves a record to clean up) -> committed ->
destroyed (no longer needed; its key is deleted from the store, then the row goes).

A stream may be claimed by one node at an epoch (``claim_stream``: compare-and-set, only a
higher epoch wins, in ``s3_stream_owners``); from then on objects of other nodes cannot commit
ranges of it, and a commit that carries the epochs its writer holds is refused once any of them
moved, so a broker whose stream was taken over can no longer change it.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass

from . import sqldb
from .objects.format import StreamRange


@dataclass
class StreamMeta:
    stream_id: int
    start_offset: int
    end_offset: int          # every offset below is committed to the object store
    deleted: bool


@dataclass
class ObjectRange:
    """A committed object's share of one stream."""

    object_id: int
    key: str
    kind: str                # "sso" (stream set object) or "so" (stream object)
    size: int
    stream_id: int
    start_offset: int
    end_offset: int


@dataclass
class NewObject:
    object_id: int
    size: int
    ranges: list[StreamRange]


class StreamFenced(sqldb.StaleEpoch):
    """Another node claimed the stream at a higher epoch: this node may not commit to it.
    ``stream_id`` names the stream when one stream's owner refused the commit."""

    def __init__(self, message: str, stream_id: int | None = None) -> None:
        super().__init__(message)
        self.stream_id = stream_id


class TakeoverConflict(sqldb.StaleEpoch):
    """A takeover's commit found the metadata moved on: another taker committed these ranges,
    a newer taker owns the takeover, or a stream's owner changed. Nothing was committed."""


WAL_ACTIVE = "active"              # its owner writes it
WAL_TAKING_OVER = "taking_over"    # taken_over_by recovers it (at taken_over_epoch)
WAL_TAKEN_OVER = "taken_over"      # recovered and committed; the owner must format afresh


@dataclass
class WALInfo:
    """Where a node's WAL lives (s3_wals): what a controller needs to hand it to a taker.
    device_id/inode identify the file or device (st_rdev for a block device, else st_dev)."""

    node_id: int
    node_epoch: int
    path: str
    host: str
    device_id: int
    inode: int
    capacity: int
    state: str = WAL_ACTIVE
    taken_over_by: int | None = None
    taken_over_epoch: int | None = None
    updated_ms: int = 0


class MetaStore(abc.ABC):
    """What the engine needs from a metadata database."""

    @abc.abstractmethod
    def create_stream(self) -> int: ...

    @abc.abstractmethod
    def streams(self) -> list[StreamMeta]: ...

    @abc.abstractmethod
    def set_stream_start(self, stream_id: int, start_offset: int) -> None: ...

    @abc.abstractmethod
    def delete_stream(self, stream_id: int) -> None: ...

    @abc.abstractmethod
    def prepare_object(self, kind: str, node_id: int) -> tuple[int, str]:
        """Allocate an object id and key before it is uploaded."""

    @abc.abstractmethod
    def commit_objects(self, new: list[NewObject], destroy: list[int],
                       epochs: dict[int, int] | None = None,
                       wal_owner: tuple[int, int] | None = None) -> None:
        """In one transaction: mark ``new`` committed with their ranges (advancing each stream's
        committed end), and mark ``destroy`` destroyed (compaction replaced them). With
        ``epochs`` (stream id -> the epoch the writer holds) the commit is refused with
        ``StreamFenced`` if any of those streams was claimed at another epoch meanwhile. Ranges
        of a stream claimed by another node than the object's are refused in any case. With
        ``wal_owner`` (node id, node epoch: the uploader whose WAL holds these records) it is
        refused too once that WAL's registry row is being taken over or has a newer epoch (a
        zombie's upload never races a takeover's commit)."""

    @abc.abstractmethod
    def claim_stream(self, stream_id: int, node_id: int, epoch: int) -> bool:
        """Make ``node_id`` the stream's only writer at ``epoch`` (compare-and-set: only a
        higher epoch wins, or the same node re-claiming its epoch); False if refused."""

    @abc.abstractmethod
    def stream_owner(self, stream_id: int) -> tuple[int, int] | None:
        """(node id, epoch) of the stream's claimed writer, None when never claimed."""

    @abc.abstractmethod
    def stream(self, stream_id: int) -> StreamMeta | None:
        """One stream's committed state as the database has it now (another node may own it)."""

    @abc.abstractmethod
    def stream_ranges(self, stream_id: int) -> list[ObjectRange]:
        """One stream's committed object ranges, by start offset."""

    @abc.abstractmethod
    def ranges(self) -> list[ObjectRange]:
        """Every committed object's ranges."""

    @abc.abstractmethod
    def objects_in_state(self, state: str, node_id: int | None = None) -> list[tuple[int, str]]:
        """(object id, key) of the objects in ``state``; with ``node_id`` only that node's
        (a broker sharing the database must not clean up another's upload in flight)."""

    def object_states(self, object_ids: list[int]) -> dict[int, str]:
        """object id -> state (prepared / committed / destroyed) of those that have a row."""
        raise NotImplementedError

    @abc.abstractmethod
    def mark_destroyed(self, object_ids: list[int]) -> None: ...

    @abc.abstractmethod
    def forget_objects(self, object_ids: list[int]) -> None:
        """Remove rows of objects whose keys are gone from the store."""

    # -- the WAL registry (storage/takeover.py; docs/wal.md "Takeover and fencing") --------
    def register_wal(self, info: WALInfo) -> bool:
        """Record (or update) this node's WAL; refused (False) when the registry holds a newer
        epoch of the node. A new epoch makes the row active again."""
        raise NotImplementedError

    def wal(self, node_id: int) -> WALInfo | None:
        """A node's registered WAL, None when it never registered one."""
        raise NotImplementedError

    def wals(self) -> list[WALInfo]:
        """Every registered WAL, by node id."""
        raise NotImplementedError

    def begin_wal_takeover(self, node_id: int, node_epoch: int, taker: int,
                           taker_epoch: int) -> bool:
        """Compare-and-set: ``taker`` owns the takeover of node_id's WAL (at node_epoch) from
        now on. Refused when the node registered a newer epoch, the takeover is done, or
        another taker holds it at a higher taker epoch. True also when no row exists."""
        raise NotImplementedError

    def finish_wal_takeover(self, node_id: int, taker: int, taker_epoch: int) -> bool:
        """Mark the WAL taken over (done) if this taker still owns its takeover."""
        raise NotImplementedError

    def commit_takeover(self, new: list[NewObject], owners: dict[int, tuple[int, int] | None],
                        wal_node: int, taker: int, taker_epoch: int) -> None:
        """Commit a takeover's objects in one transaction, conditioned on epochs: each
        stream's owner is still ``owners[stream]`` (None: unclaimed), each range starts
        exactly at its stream's committed end (so nothing is committed twice), and, if the
        WAL is registered, ``taker`` still owns its takeover at ``taker_epoch``. Raises
        TakeoverConflict (nothing committed) otherwise."""
        raise NotImplementedError

    def close(self) -> None: ...


STEPS: list[sqldb.Step] = [
    (1, """
CREATE TABLE IF NOT EXISTS s3_streams (
    stream_id @ID@,
    start_offset BIGINT NOT NULL DEFAULT 0,
    end_offset BIGINT NOT NULL DEFAULT 0,
    deleted INTEGER NOT NULL DEFAULT 0,
    created_ms BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS s3_objects (
    object_id @ID@,
    object_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    size BIGINT NOT NULL DEFAULT 0,
    node_id BIGINT NOT NULL,
    created_ms BIGINT NOT NULL,
    committed_ms BIGINT);
CREATE TABLE IF NOT EXISTS s3_object_ranges (
    object_id BIGINT NOT NULL,
    stream_id BIGINT NOT NULL,
    start_offset BIGINT NOT NULL,
    end_offset BIGINT NOT NULL,
    PRIMARY KEY (object_id, stream_id));
CREATE INDEX IF NOT EXISTS s3_object_ranges_stream ON s3_object_ranges(stream_id, start_offset)
"""),
    (2, """
CREATE TABLE IF NOT EXISTS s3_stream_owners (
    stream_id BIGINT PRIMARY KEY,
    node_id BIGINT NOT NULL,
    epoch BIGINT NOT NULL);
CREATE INDEX IF NOT EXISTS s3_objects_state ON s3_objects(state)
"""),
    (3, """
CREATE TABLE IF NOT EXISTS s3_wals (
    node_id BIGINT PRIMARY KEY,
    node_epoch BIGINT NOT NULL,
    path TEXT NOT NULL,
    host TEXT NOT NULL,
    device_id BIGINT NOT NULL,
    inode BIGINT NOT NULL,
    capacity BIGINT NOT NULL,
    state TEXT NOT NULL,
    taken_over_by BIGINT,
    taken_over_epoch BIGINT,
    updated_ms BIGINT NOT NULL)
"""),
]

_WAL_COLS = ("node_id, node_epoch, path, host, device_id, inode, capacity, state, taken_over_by,"
             " taken_over_epoch, updated_ms")


def _now_ms() -> int:
    return int(time.time() * 1000)


class SqlMetaStore(MetaStore):
    """On one ``sqldb.Database`` connection (its lock serialises the engine's worker threads);
    every multi-row change is one transaction."""

    def __init__(self, url: str) -> None:
        self.db = sqldb.connect(url)
        try:
            self.db.migrate("engine", STEPS)
        except BaseException:
            self.db.close()
            raise

    def create_stream(self) -> int:
        with self.db.transaction() as tx:
            return tx.insert_id("INSERT INTO s3_streams(created_ms) VALUES (?)"
                                " RETURNING stream_id", (_now_ms(),))

    def streams(self) -> list[StreamMeta]:
        rows = self.db.query("SELECT stream_id, start_offset, end_offset, deleted FROM s3_streams"
                             " ORDER BY stream_id")
        return [StreamMeta(r[0], r[1], r[2], bool(r[3])) for r in rows]

    def set_stream_start(self, stream_id: int, start_offset: int) -> None:
        self.db.execute("UPDATE s3_streams SET start_offset=? WHERE stream_id=? AND start_offset<?",
                        (start_offset, stream_id, start_offset))

    def delete_stream(self, stream_id: int) -> None:
        self.db.execute("UPDATE s3_streams SET deleted=1 WHERE stream_id=?", (stream_id,))

    def stream(self, stream_id: int) -> StreamMeta | None:
        r = self.db.query_one("SELECT stream_id, start_offset, end_offset, deleted FROM s3_streams"
                              " WHERE stream_id=?", (stream_id,))
        return None if r is None else StreamMeta(r[0], r[1], r[2], bool(r[3]))

    def stream_ranges(self, stream_id: int) -> list[ObjectRange]:
        rows = self.db.query(
            "SELECT o.object_id, o.object_key, o.kind, o.size, r.stream_id, r.start_offset,"
            " r.end_offset FROM s3_object_ranges r JOIN s3_objects o USING (object_id)"
            " WHERE o.state='committed' AND r.stream_id=? ORDER BY r.start_offset", (stream_id,))
        return [ObjectRange(*r) for r in rows]

    def claim_stream(self, stream_id: int, node_id: int, epoch: int) -> bool:
        return self.db.transact(lambda tx: tx.execute(
            "INSERT INTO s3_stream_owners(stream_id, node_id, epoch) VALUES (?, ?, ?)"
            " ON CONFLICT (stream_id) DO UPDATE SET node_id=excluded.node_id,"
            " epoch=excluded.epoch WHERE s3_stream_owners.epoch < excluded.epoch OR"
            " (s3_stream_owners.epoch = excluded.epoch AND"
            " s3_stream_owners.node_id = excluded.node_id)",
            (stream_id, node_id, epoch))) == 1

    def stream_owner(self, stream_id: int) -> tuple[int, int] | None:
        r = self.db.query_one("SELECT node_id, epoch FROM s3_stream_owners WHERE stream_id=?",
                              (stream_id,))
        return None if r is None else (int(r[0]), int(r[1]))

    def prepare_object(self, kind: str, node_id: int) -> tuple[int, str]:
        def body(tx: sqldb.Tx) -> tuple[int, str]:
            oid = tx.insert_id("INSERT INTO s3_objects(object_key, kind, state, node_id,"
                               " created_ms) VALUES ('', ?, 'prepared', ?, ?) RETURNING object_id",
                               (kind, node_id, _now_ms()))
            key = f"{kind}/{node_id}/{oid:012d}"
            tx.execute("UPDATE s3_objects SET object_key=? WHERE object_id=?", (key, oid))
            return oid, key
        return self.db.transact(body)

    def commit_objects(self, new: list[NewObject], destroy: list[int],
                       epochs: dict[int, int] | None = None,
                       wal_owner: tuple[int, int] | None = None) -> None:
        def body(tx: sqldb.Tx) -> None:
            now = _now_ms()
            if wal_owner is not None:
                row = tx.query_one("SELECT node_epoch, state, taken_over_by, taken_over_epoch"
                                   " FROM s3_wals WHERE node_id=?", (wal_owner[0],))
                if row is not None and (row[0] > wal_owner[1] or row[1] != WAL_ACTIVE):
                    raise StreamFenced(
                        f"node {wal_owner[0]} epoch {wal_owner[1]} may not commit: its WAL is "
                        f"{row[1]} (epoch {row[0]}, taker {row[2]} at epoch {row[3]})")
            for stream_id, epoch in sorted((epochs or {}).items()):
                # the writer must still hold the stream at its epoch (compare-and-set)
                try:
                    tx.compare_and_set("s3_stream_owners", {"stream_id": stream_id}, "epoch",
                                       epoch, {"epoch": epoch})
                except sqldb.StaleEpoch as exc:
                    raise StreamFenced(str(exc)) from None
            for obj in new:
                self._check_owner(tx, obj)
                n = tx.execute("UPDATE s3_objects SET state='committed', size=?, committed_ms=?"
                               " WHERE object_id=? AND state='prepared'",
                               (obj.size, now, obj.object_id))
                if n != 1:
                    raise RuntimeError(f"object {obj.object_id} is not prepared")
                tx.executemany("INSERT INTO s3_object_ranges(object_id, stream_id, start_offset,"
                               " end_offset) VALUES (?, ?, ?, ?)",
                               [(obj.object_id, r.stream_id, r.start_offset, r.end_offset)
                                for r in obj.ranges])
                for r in obj.ranges:
                    tx.execute("UPDATE s3_streams SET end_offset=? WHERE stream_id=? AND"
                               " end_offset<?", (r.end_offset, r.stream_id, r.end_offset))
            self._destroy(tx, destroy)
        self.db.transact(body)

    @staticmethod
    def _check_owner(tx: sqldb.Tx, obj: NewObject) -> None:
        """Fencing: a stream claimed by another node takes no ranges from this one."""
        node = tx.query_one("SELECT node_id FROM s3_objects WHERE object_id=?", (obj.object_id,))
        if node is None:
            return
        for r in obj.ranges:
            owner = tx.query_one("SELECT node_id, epoch FROM s3_stream_owners WHERE stream_id=?",
                                 (r.stream_id,))
            if owner is not None and owner[0] != node[0]:
                raise StreamFenced(f"stream {r.stream_id} is owned by node {owner[0]} at epoch "
                                   f"{owner[1]}; node {node[0]} cannot commit to it",
                                   r.stream_id)

    def ranges(self) -> list[ObjectRange]:
        rows = self.db.query(
            "SELECT o.object_id, o.object_key, o.kind, o.size, r.stream_id, r.start_offset,"
            " r.end_offset FROM s3_object_ranges r JOIN s3_objects o USING (object_id)"
            " WHERE o.state='committed' ORDER BY r.stream_id, r.start_offset")
        return [ObjectRange(*r) for r in rows]

    def objects_in_state(self, state: str, node_id: int | None = None) -> list[tuple[int, str]]:
        if node_id is None:
            return self.db.query("SELECT object_id, object_key FROM s3_objects WHERE state=?"
                                 " ORDER BY object_id", (state,))
        return self.db.query("SELECT object_id, object_key FROM s3_objects WHERE state=? AND"
                             " node_id=? ORDER BY object_id", (state, node_id))

    def object_states(self, object_ids: list[int]) -> dict[int, str]:
        out: dict[int, str] = {}
        for oid in object_ids:
            r = self.db.query_one("SELECT state FROM s3_objects WHERE object_id=?", (oid,))
            if r is not None:
                out[oid] = str(r[0])
        return out

    def mark_destroyed(self, object_ids: list[int]) -> None:
        self.db.transact(lambda tx: self._destroy(tx, object_ids))

    @staticmethod
    def _destroy(tx: sqldb.Tx, object_ids: list[int]) -> None:
        rows = [(oid,) for oid in object_ids]
        tx.executemany("UPDATE s3_objects SET state='destroyed' WHERE object_id=?", rows)
        tx.executemany("DELETE FROM s3_object_ranges WHERE object_id=?", rows)

    def forget_objects(self, object_ids: list[int]) -> None:
        def body(tx: sqldb.Tx) -> None:
            rows = [(oid,) for oid in object_ids]
            tx.executemany("DELETE FROM s3_objects WHERE object_id=?", rows)
            tx.executemany("DELETE FROM s3_object_ranges WHERE object_id=?", rows)
        self.db.transact(body)

    # -- the WAL registry ---------------------------------------------------------------
    def register_wal(self, info: WALInfo) -> bool:
        return self.db.transact(lambda tx: tx.execute(
            "INSERT INTO s3_wals(" + _WAL_COLS + ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL,"
            " ?) ON CONFLICT (node_id) DO UPDATE SET node_epoch=excluded.node_epoch,"
            " path=excluded.path, host=excluded.host, device_id=excluded.device_id,"
            " inode=excluded.inode, capacity=excluded.capacity,"
            " state=CASE WHEN s3_wals.node_epoch < excluded.node_epoch THEN excluded.state"
            " ELSE s3_wals.state END,"
            " taken_over_by=CASE WHEN s3_wals.node_epoch < excluded.node_epoch THEN NULL"
            " ELSE s3_wals.taken_over_by END,"
            " taken_over_epoch=CASE WHEN s3_wals.node_epoch < excluded.node_epoch THEN NULL"
            " ELSE s3_wals.taken_over_epoch END,"
            " updated_ms=excluded.updated_ms WHERE s3_wals.node_epoch <= excluded.node_epoch",
            (info.node_id, info.node_epoch, info.path, info.host, info.device_id, info.inode,
             info.capacity, WAL_ACTIVE, _now_ms()))) == 1

    def wal(self, node_id: int) -> WALInfo | None:
        r = self.db.query_one("SELECT " + _WAL_COLS + " FROM s3_wals WHERE node_id=?",
                              (node_id,))
        return None if r is None else WALInfo(*r)

    def wals(self) -> list[WALInfo]:
        return [WALInfo(*r) for r in self.db.query("SELECT " + _WAL_COLS + " FROM s3_wals"
                                                   " ORDER BY node_id")]

    def begin_wal_takeover(self, node_id: int, node_epoch: int, taker: int,
                           taker_epoch: int) -> bool:
        def body(tx: sqldb.Tx) -> bool:
            row = tx.query_one("SELECT node_epoch, state, taken_over_by, taken_over_epoch FROM"
                               " s3_wals WHERE node_id=?", (node_id,))
            if row is None:
                return True
            epoch, state, by, by_epoch = row
            if epoch > node_epoch or state == WAL_TAKEN_OVER:
                return False
            if state == WAL_TAKING_OVER and (by_epoch, by != taker) > (taker_epoch, False):
                return False              # a newer taker (or another at the same epoch) has it
            tx.execute("UPDATE s3_wals SET state=?, taken_over_by=?, taken_over_epoch=?,"
                       " updated_ms=? WHERE node_id=?",
                       (WAL_TAKING_OVER, taker, taker_epoch, _now_ms(), node_id))
            return True
        return self.db.transact(body)

    def finish_wal_takeover(self, node_id: int, taker: int, taker_epoch: int) -> bool:
        return self.db.transact(lambda tx: tx.execute(
            "UPDATE s3_wals SET state=?, updated_ms=? WHERE node_id=? AND state=? AND"
            " taken_over_by=? AND taken_over_epoch=?",
            (WAL_TAKEN_OVER, _now_ms(), node_id, WAL_TAKING_OVER, taker, taker_epoch))) == 1

    def commit_takeover(self, new: list[NewObject], owners: dict[int, tuple[int, int] | None],
                        wal_node: int, taker: int, taker_epoch: int) -> None:
        def body(tx: sqldb.Tx) -> None:
            row = tx.query_one("SELECT state, taken_over_by, taken_over_epoch FROM s3_wals"
                               " WHERE node_id=?", (wal_node,))
            if row is not None and tuple(row) != (WAL_TAKING_OVER, taker, taker_epoch):
                raise TakeoverConflict(f"the takeover of node {wal_node}'s WAL is no longer "
                                       f"node {taker}'s at epoch {taker_epoch} (now {row})")
            for sid, want in sorted(owners.items()):
                got = tx.query_one("SELECT node_id, epoch FROM s3_stream_owners WHERE"
                                   " stream_id=?", (sid,))
                if (None if got is None else (int(got[0]), int(got[1]))) != want:
                    raise TakeoverConflict(f"stream {sid} is now owned by {got}, the takeover "
                                           f"expected {want}")
            now = _now_ms()
            for obj in new:
                n = tx.execute("UPDATE s3_objects SET state='committed', size=?, committed_ms=?"
                               " WHERE object_id=? AND state='prepared'",
                               (obj.size, now, obj.object_id))
                if n != 1:
                    raise TakeoverConflict(f"object {obj.object_id} is not prepared")
                for r in obj.ranges:
                    if tx.execute("UPDATE s3_streams SET end_offset=? WHERE stream_id=? AND"
                                  " end_offset=? AND deleted=0",
                                  (r.end_offset, r.stream_id, r.start_offset)) != 1:
                        raise TakeoverConflict(
                            f"stream {r.stream_id} no longer ends at {r.start_offset} "
                            "(committed by another taker, or deleted)")
                tx.executemany("INSERT INTO s3_object_ranges(object_id, stream_id, start_offset,"
                               " end_offset) VALUES (?, ?, ?, ?)",
                               [(obj.object_id, r.stream_id, r.start_offset, r.end_offset)
                                for r in obj.ranges])
        self.db.transact(body)

    def close(self) -> None:
        self.db.close()


SqliteMetaStore = SqlMetaStore  # the name it had before PostgreSQL


def open_metastore(url: str) -> MetaStore:
    """``sqlite:///path/meta.db`` (or a bare path) or ``postgresql://user:pass@host:port/db``."""
    return SqlMetaStore(url)
