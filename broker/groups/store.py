"""Durable storage of committed offsets and group metadata (tables ``kafka_group_*``).

The coordinator keeps everything in memory and writes through to a store before it answers,
so a restart (or kill -9) loses nothing that was acknowledged. ``GroupStore`` is the
interface; ``SqlGroupStore`` implements it on ``storage.sqldb`` (SQLite by default, PostgreSQL
when brokers share one metadata database, so a group's offsets outlive its coordinator).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Protocol

from storage import sqldb


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


STEPS: list[sqldb.Step] = [
    (1, """
CREATE TABLE IF NOT EXISTS kafka_group_offsets (
    group_id TEXT NOT NULL,
    topic TEXT NOT NULL,
    partition INTEGER NOT NULL,
    committed_offset BIGINT NOT NULL,
    leader_epoch INTEGER NOT NULL DEFAULT -1,
    metadata TEXT,
    commit_ts_ms BIGINT NOT NULL,
    PRIMARY KEY (group_id, topic, partition)
);
CREATE TABLE IF NOT EXISTS kafka_group_metadata (
    group_id TEXT PRIMARY KEY,
    protocol_type TEXT,
    protocol_name TEXT,
    generation_id INTEGER NOT NULL,
    leader_id TEXT,
    members TEXT NOT NULL
)
"""),
]


def sqlite_path(db_path_or_url: str) -> str:
    """A plain path, or a metadata URL as the broker's metastore reads it (``sqlite:///...``)."""
    if "://" in db_path_or_url and not db_path_or_url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite:/// metadata URL: {db_path_or_url!r}")
    return sqldb.sqlite_path(db_path_or_url)


class SqlGroupStore:
    """Store with its own connection; every write is committed durably before it returns, so
    an acknowledged commit survives kill -9 (and power loss on SQLite's synchronous=FULL)."""

    def __init__(self, db_path_or_url: str) -> None:
        self.db = sqldb.connect(db_path_or_url)
        try:
            self.db.migrate("groups", STEPS)
        except BaseException:
            self.db.close()
            raise

    def load_offsets(self) -> list[OffsetRecord]:
        rows = self.db.query(
            "SELECT group_id, topic, partition, committed_offset, leader_epoch, metadata,"
            " commit_ts_ms FROM kafka_group_offsets")
        return [OffsetRecord(*row) for row in rows]

    def load_group_offsets(self, group_id: str) -> list[OffsetRecord]:
        rows = self.db.query(
            "SELECT group_id, topic, partition, committed_offset, leader_epoch, metadata,"
            " commit_ts_ms FROM kafka_group_offsets WHERE group_id=?", (group_id,))
        return [OffsetRecord(*row) for row in rows]

    def load_groups(self) -> list[GroupRecord]:
        rows = self.db.query(
            "SELECT group_id, protocol_type, protocol_name, generation_id, leader_id, members"
            " FROM kafka_group_metadata")
        return [GroupRecord(g, pt, pn, gen, leader, json.loads(members))
                for g, pt, pn, gen, leader, members in rows]

    def commit_offsets(self, records: Iterable[OffsetRecord]) -> None:
        rows = [
            (r.group_id, r.topic, r.partition, r.offset, r.leader_epoch, r.metadata, r.commit_ts_ms)
            for r in records
        ]
        if not rows:
            return
        self.db.transact(lambda tx: tx.executemany(
            "INSERT INTO kafka_group_offsets (group_id, topic, partition, committed_offset,"
            " leader_epoch, metadata, commit_ts_ms) VALUES (?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (group_id, topic, partition) DO UPDATE SET"
            " committed_offset=excluded.committed_offset, leader_epoch=excluded.leader_epoch,"
            " metadata=excluded.metadata, commit_ts_ms=excluded.commit_ts_ms",
            rows))

    def delete_offsets(self, group_id: str, partitions: Iterable[tuple[str, int]]) -> None:
        rows = [(group_id, t, p) for t, p in partitions]
        self.db.transact(lambda tx: tx.executemany(
            "DELETE FROM kafka_group_offsets WHERE group_id=? AND topic=? AND partition=?", rows))

    def save_group(self, record: GroupRecord) -> None:
        self.db.transact(lambda tx: tx.execute(
            "INSERT INTO kafka_group_metadata (group_id, protocol_type, protocol_name,"
            " generation_id, leader_id, members) VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (group_id) DO UPDATE SET protocol_type=excluded.protocol_type,"
            " protocol_name=excluded.protocol_name, generation_id=excluded.generation_id,"
            " leader_id=excluded.leader_id, members=excluded.members",
            (record.group_id, record.protocol_type, record.protocol_name, record.generation_id,
             record.leader_id, json.dumps(record.members))))

    def delete_group(self, group_id: str) -> None:
        def body(tx: sqldb.Tx) -> None:
            tx.execute("DELETE FROM kafka_group_offsets WHERE group_id=?", (group_id,))
            tx.execute("DELETE FROM kafka_group_metadata WHERE group_id=?", (group_id,))
        self.db.transact(body)

    def close(self) -> None:
        self.db.close()


SqliteGroupStore = SqlGroupStore  # the name it had before PostgreSQL
