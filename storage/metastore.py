"""The engine's metadata: streams, objects and which offsets each object holds.

``MetaStore`` is the interface (a PostgreSQL store will implement it for shared object stores);
``SqliteMetaStore`` is the default, in tables prefixed ``s3_`` of the broker's SQLite database
(WAL journal mode, so the broker's own connection can work alongside). Calls block: the engine
runs them in a thread. Object lifecycle: prepared (before the put, so a crash between put and
commit leaves a record to clean up) -> committed -> destroyed (no longer needed; its key is
deleted from the store, then the row goes).
"""
from __future__ import annotations

import abc
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

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
    def commit_objects(self, new: list[NewObject], destroy: list[int]) -> None:
        """In one transaction: mark ``new`` committed with their ranges (advancing each stream's
        committed end), and mark ``destroy`` destroyed (compaction replaced them)."""

    @abc.abstractmethod
    def ranges(self) -> list[ObjectRange]:
        """Every committed object's ranges."""

    @abc.abstractmethod
    def objects_in_state(self, state: str) -> list[tuple[int, str]]: ...

    @abc.abstractmethod
    def mark_destroyed(self, object_ids: list[int]) -> None: ...

    @abc.abstractmethod
    def forget_objects(self, object_ids: list[int]) -> None:
        """Remove rows of objects whose keys are gone from the store."""

    def close(self) -> None: ...


SCHEMA = """
CREATE TABLE IF NOT EXISTS s3_streams (
    stream_id INTEGER PRIMARY KEY AUTOINCREMENT,
    start_offset INTEGER NOT NULL DEFAULT 0,
    end_offset INTEGER NOT NULL DEFAULT 0,
    deleted INTEGER NOT NULL DEFAULT 0,
    created_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS s3_objects (
    object_id INTEGER PRIMARY KEY AUTOINCREMENT,
    object_key TEXT NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    size INTEGER NOT NULL DEFAULT 0,
    node_id INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    committed_ms INTEGER);
CREATE TABLE IF NOT EXISTS s3_object_ranges (
    object_id INTEGER NOT NULL,
    stream_id INTEGER NOT NULL,
    start_offset INTEGER NOT NULL,
    end_offset INTEGER NOT NULL,
    PRIMARY KEY (object_id, stream_id));
CREATE INDEX IF NOT EXISTS s3_object_ranges_stream ON s3_object_ranges(stream_id, start_offset);
"""


def _now_ms() -> int:
    return int(time.time() * 1000)


class SqliteMetaStore(MetaStore):
    """SQLite implementation; one connection guarded by a lock (calls come from a thread pool)."""

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                                   timeout=30)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    def _tx(self):
        return _Tx(self._db, self._lock)

    def create_stream(self) -> int:
        with self._tx() as db:
            return db.execute("INSERT INTO s3_streams(created_ms) VALUES (?)",
                              (_now_ms(),)).lastrowid

    def streams(self) -> list[StreamMeta]:
        with self._lock:
            rows = self._db.execute(
                "SELECT stream_id, start_offset, end_offset, deleted FROM s3_streams").fetchall()
        return [StreamMeta(r[0], r[1], r[2], bool(r[3])) for r in rows]

    def set_stream_start(self, stream_id: int, start_offset: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE s3_streams SET start_offset=? WHERE stream_id=? AND start_offset<?",
                       (start_offset, stream_id, start_offset))

    def delete_stream(self, stream_id: int) -> None:
        with self._tx() as db:
            db.execute("UPDATE s3_streams SET deleted=1 WHERE stream_id=?", (stream_id,))

    def prepare_object(self, kind: str, node_id: int) -> tuple[int, str]:
        with self._tx() as db:
            oid = db.execute("INSERT INTO s3_objects(object_key, kind, state, node_id, created_ms)"
                             " VALUES ('', ?, 'prepared', ?, ?)",
                             (kind, node_id, _now_ms())).lastrowid
            key = f"{kind}/{node_id}/{oid:012d}"
            db.execute("UPDATE s3_objects SET object_key=? WHERE object_id=?", (key, oid))
        return oid, key

    def commit_objects(self, new: list[NewObject], destroy: list[int]) -> None:
        with self._tx() as db:
            now = _now_ms()
            for obj in new:
                cur = db.execute("UPDATE s3_objects SET state='committed', size=?, committed_ms=?"
                                 " WHERE object_id=? AND state='prepared'",
                                 (obj.size, now, obj.object_id))
                if cur.rowcount != 1:
                    raise RuntimeError(f"object {obj.object_id} is not prepared")
                for r in obj.ranges:
                    db.execute("INSERT INTO s3_object_ranges VALUES (?, ?, ?, ?)",
                               (obj.object_id, r.stream_id, r.start_offset, r.end_offset))
                    db.execute("UPDATE s3_streams SET end_offset=? WHERE stream_id=? AND"
                               " end_offset<?", (r.end_offset, r.stream_id, r.end_offset))
            for oid in destroy:
                db.execute("UPDATE s3_objects SET state='destroyed' WHERE object_id=?", (oid,))
                db.execute("DELETE FROM s3_object_ranges WHERE object_id=?", (oid,))

    def ranges(self) -> list[ObjectRange]:
        with self._lock:
            rows = self._db.execute(
                "SELECT o.object_id, o.object_key, o.kind, o.size, r.stream_id, r.start_offset,"
                " r.end_offset FROM s3_object_ranges r JOIN s3_objects o USING (object_id)"
                " WHERE o.state='committed' ORDER BY r.stream_id, r.start_offset").fetchall()
        return [ObjectRange(*r) for r in rows]

    def objects_in_state(self, state: str) -> list[tuple[int, str]]:
        with self._lock:
            return [tuple(r) for r in self._db.execute(
                "SELECT object_id, object_key FROM s3_objects WHERE state=?", (state,))]

    def mark_destroyed(self, object_ids: list[int]) -> None:
        with self._tx() as db:
            for oid in object_ids:
                db.execute("UPDATE s3_objects SET state='destroyed' WHERE object_id=?", (oid,))
                db.execute("DELETE FROM s3_object_ranges WHERE object_id=?", (oid,))

    def forget_objects(self, object_ids: list[int]) -> None:
        with self._tx() as db:
            for oid in object_ids:
                db.execute("DELETE FROM s3_objects WHERE object_id=?", (oid,))
                db.execute("DELETE FROM s3_object_ranges WHERE object_id=?", (oid,))

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT/ROLLBACK under the connection lock."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self.lock.release()


def open_metastore(url: str) -> MetaStore:
    """``sqlite:///path/meta.db`` (or a bare path); other schemes are for future stores."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        # SQLAlchemy convention: sqlite:///relative/path, sqlite:////absolute/path
        path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else ""
        return SqliteMetaStore(path or ":memory:")
    if parts.scheme == "":
        return SqliteMetaStore(url)
    raise ValueError(f"unsupported metadata URL {url!r}")
