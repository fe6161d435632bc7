"""Durable storage of committed offsets and group metadata (tables ``kafka_group_*``).

The coordinator keeps everything in memory and writes through to a store before it answers,
so a restart (or kill -9) loses nothing that was acknowledged. ``GroupStore`` is the
interface; ``SqliteGroupStore`` is the default; a PostgreSQL store can implement the same
methods later (the SQL is plain and portable apart from the upsert syntax).
"""
from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

from ..metastore import sqlite_path as metastore_sqlite_path


@dataclass(frozen=True)
class OffsetRecord:
    """One committed offset, as Kafka keeps it per (group, topic, partition)."""

    group_id: str
    topic: str
    partition: int
    offset: int
    leader_epoch: int = -1
    metadata: str | None = ""
    commit_ts_ms: int = 0


@dataclass(frozen=True)
class GroupRecord:
    """Persisted group state: enough to resume a Stable generation after a restart."""

    group_id: str
    protocol_type: str | None
    protocol_name: str | None
    generation_id: int
    leader_id: str | None
    members: list[dict]  # MemberState.to_json() dicts (bytes base64-encoded)


class GroupStore(Protocol):
    """What the coordinator needs from durable storage. Calls are blocking; the coordinator
    runs them on its own single worker thread so the event loop never waits on disk."""

    def load_offsets(self) -> list[OffsetRecord]: ...
    def load_groups(self) -> list[GroupRecord]: ...
    def commit_offsets(self, records: Iterable[OffsetRecord]) -> None: ...
    def delete_offsets(self, group_id: str, partitions: Iterable[tuple[str, int]]) -> None: ...
    def save_group(self, record: GroupRecord) -> None: ...
    def delete_group(self, group_id: str) -> None: ...
    def close(self) -> None: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS kafka_group_offsets (
    group_id TEXT NOT NULL,
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    committed_offset INTEGER NOT NULL,
    leader_epoch INTEGER NOT NULL DEFAULT -1,
    metadata TEXT,
    commit_ts_ms INTEGER NOT NULL,
    PRIMARY KEY (group_id, topic, partition)
);
CREATE TABLE IF NOT EXISTS kafka_group_metadata (
    group_id TEXT PRIMARY KEY,
    protocol_type TEXT,
    protocol_name TEXT,
    generation_id INTEGER NOT NULL,
    leader_id TEXT,
    members TEXT NOT NULL
);
"""


def sqlite_path(db_path_or_url: str) -> str:
    """A plain path, or a metadata URL as the broker's metastore reads it (``sqlite:///...``)."""
    if "://" in db_path_or_url:
        return metastore_sqlite_path(db_path_or_url)
    return db_path_or_url


class SqliteGroupStore:
    """SQLite store with its own connection; every write is committed (synchronous=FULL)
    before it returns, so an acknowledged commit survives kill -9 and power loss."""

    def __init__(self, db_path_or_url: str) -> None:
        path = sqlite_path(db_path_or_url)
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # The connection is used from the coordinator's single worker thread only, but it is
        # created here (another thread), hence check_same_thread=False plus our own lock.
        self._db = sqlite3.connect(path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def load_offsets(self) -> list[OffsetRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT group_id, topic, partition, committed_offset, leader_epoch, metadata,"
                " commit_ts_ms FROM kafka_group_offsets"
            ).fetchall()
        return [OffsetRecord(*row) for row in rows]

    def load_groups(self) -> list[GroupRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT group_id, protocol_type, protocol_name, generation_id, leader_id, members"
                " FROM kafka_group_metadata"
            ).fetchall()
        return [GroupRecord(g, pt, pn, gen, leader, json.loads(members)) for g, pt, pn, gen, leader, members in rows]

    def commit_offsets(self, records: Iterable[OffsetRecord]) -> None:
        rows = [
            (r.group_id, r.topic, r.partition, r.offset, r.leader_epoch, r.metadata, r.commit_ts_ms)
            for r in records
        ]
        if not rows:
            return
        with self._lock, self._transaction():
            self._db.executemany(
                "INSERT INTO kafka_group_offsets (group_id, topic, partition, committed_offset,"
                " leader_epoch, metadata, commit_ts_ms) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (group_id, topic, partition) DO UPDATE SET"
                " committed_offset=excluded.committed_offset, leader_epoch=excluded.leader_epoch,"
                " metadata=excluded.metadata, commit_ts_ms=excluded.commit_ts_ms",
                rows,
            )

    def delete_offsets(self, group_id: str, partitions: Iterable[tuple[str, int]]) -> None:
        rows = [(group_id, t, p) for t, p in partitions]
        with self._lock, self._transaction():
            self._db.executemany(
                "DELETE FROM kafka_group_offsets WHERE group_id=? AND topic=? AND partition=?", rows
            )

    def save_group(self, record: GroupRecord) -> None:
        with self._lock, self._transaction():
            self._db.execute(
                "INSERT INTO kafka_group_metadata (group_id, protocol_type, protocol_name,"
                " generation_id, leader_id, members) VALUES (?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (group_id) DO UPDATE SET protocol_type=excluded.protocol_type,"
                " protocol_name=excluded.protocol_name, generation_id=excluded.generation_id,"
                " leader_id=excluded.leader_id, members=excluded.members",
                (
                    record.group_id,
                    record.protocol_type,
                    record.protocol_name,
                    record.generation_id,
                    record.leader_id,
                    json.dumps(record.members),
                ),
            )

    def delete_group(self, group_id: str) -> None:
        with self._lock, self._transaction():
            self._db.execute("DELETE FROM kafka_group_offsets WHERE group_id=?", (group_id,))
            self._db.execute("DELETE FROM kafka_group_metadata WHERE group_id=?", (group_id,))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _transaction(self) -> "_Tx":
        return _Tx(self._db)


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error) on an autocommit connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
