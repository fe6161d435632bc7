"""The broker's own metadata: cluster id, topics, their configs and partition -> stream ids.

Kept in the metadata database (tables prefixed ``kafka_``; the storage engine keeps its own
``s3_`` tables in the same database). Every change is one transaction, committed with
``synchronous=FULL`` before the admin request is answered, so an acknowledged topic survives
a crash. ``MetadataStore`` is the interface a PostgreSQL store can implement later.
"""
from __future__ import annotations

import abc
import base64
import json
import logging
import os
import sqlite3
import threading
import uuid
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class TopicRecord:
    """One topic as stored: stream ids are indexed by partition number."""

    name: str
    topic_id: uuid.UUID
    configs: dict[str, str] = field(default_factory=dict)   # overrides only (Kafka names)
    stream_ids: list[int] = field(default_factory=list)


class MetadataStore(abc.ABC):
    """Durable, transactional topic metadata (all methods are blocking: run them off-loop)."""

    @abc.abstractmethod
    def cluster_id(self) -> str: ...

    @abc.abstractmethod
    def load_topics(self) -> list[TopicRecord]: ...

    @abc.abstractmethod
    def create_topic(self, topic: TopicRecord) -> None: ...

    @abc.abstractmethod
    def delete_topic(self, name: str) -> None: ...

    @abc.abstractmethod
    def add_partitions(self, name: str, first_index: int, stream_ids: list[int]) -> None: ...

    @abc.abstractmethod
    def set_topic_configs(self, name: str, configs: dict[str, str]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS kafka_cluster (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS kafka_topics (
    name TEXT PRIMARY KEY,
    topic_id TEXT NOT NULL UNIQUE,
    configs TEXT NOT NULL DEFAULT '{}',
    created_ms INTEGER NOT NULL DEFAULT (CAST(strftime('%s','now') AS INTEGER) * 1000)
);
CREATE TABLE IF NOT EXISTS kafka_partitions (
    topic TEXT NOT NULL REFERENCES kafka_topics(name) ON DELETE CASCADE,
    partition INTEGER NOT NULL,
    stream_id INTEGER NOT NULL,
    PRIMARY KEY (topic, partition)
);
"""


def sqlite_path(url: str) -> str:
    """``sqlite:///abs/path`` or ``sqlite:///rel/path`` -> filesystem path."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"unsupported metadata URL {url!r} (only sqlite:/// for now)")
    return url[len("sqlite:///"):] or ":memory:"


class SqliteMetadataStore(MetadataStore):
    """SQLite implementation; one connection guarded by a lock (admin traffic is light)."""

    def __init__(self, url: str) -> None:
        path = sqlite_path(url)
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                                   timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        with self._lock:
            self._db.executescript(_SCHEMA)

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                for sql, args in statements:
                    cur.execute(sql, args)
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise

    def cluster_id(self) -> str:
        """The cluster id, created once (Kafka style: 22 chars of url-safe base64)."""
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM kafka_cluster WHERE key='cluster_id'").fetchone()
        if row:
            return str(row[0])
        new = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        self._tx([("INSERT OR IGNORE INTO kafka_cluster(key, value) VALUES ('cluster_id', ?)",
                   (new,))])
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM kafka_cluster WHERE key='cluster_id'").fetchone()
        return str(row[0])

    def load_topics(self) -> list[TopicRecord]:
        with self._lock:
            topics = self._db.execute(
                "SELECT name, topic_id, configs FROM kafka_topics ORDER BY name").fetchall()
            parts = self._db.execute(
                "SELECT topic, partition, stream_id FROM kafka_partitions "
                "ORDER BY topic, partition").fetchall()
        by_topic: dict[str, list[tuple[int, int]]] = {}
        for t, p, s in parts:
            by_topic.setdefault(t, []).append((p, s))
        out = []
        for name, tid, cfg in topics:
            plist = by_topic.get(name, [])
            if [p for p, _ in plist] != list(range(len(plist))):
                log.error("topic=%s has non-contiguous partitions in metadata; skipped", name)
                continue
            try:
                configs = {str(k): str(v) for k, v in json.loads(cfg).items()}
            except (ValueError, AttributeError):
                log.error("topic=%s has unreadable configs in metadata; using defaults", name)
                configs = {}
            out.append(TopicRecord(name, uuid.UUID(tid), configs, [s for _, s in plist]))
        return out

    def create_topic(self, topic: TopicRecord) -> None:
        stmts: list[tuple[str, tuple]] = [(
            "INSERT INTO kafka_topics(name, topic_id, configs) VALUES (?, ?, ?)",
            (topic.name, str(topic.topic_id), json.dumps(topic.configs, sort_keys=True)))]
        stmts += [("INSERT INTO kafka_partitions(topic, partition, stream_id) VALUES (?, ?, ?)",
                   (topic.name, i, s)) for i, s in enumerate(topic.stream_ids)]
        self._tx(stmts)

    def delete_topic(self, name: str) -> None:
        self._tx([("DELETE FROM kafka_partitions WHERE topic=?", (name,)),
                  ("DELETE FROM kafka_topics WHERE name=?", (name,))])

    def add_partitions(self, name: str, first_index: int, stream_ids: list[int]) -> None:
        self._tx([("INSERT INTO kafka_partitions(topic, partition, stream_id) VALUES (?, ?, ?)",
                   (name, first_index + i, s)) for i, s in enumerate(stream_ids)])

    def set_topic_configs(self, name: str, configs: dict[str, str]) -> None:
        self._tx([("UPDATE kafka_topics SET configs=? WHERE name=?",
                   (json.dumps(configs, sort_keys=True), name))])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def open_metadata_store(url: str) -> MetadataStore:
    """The MetadataStore for a ``--metadata`` URL."""
    if url.startswith("sqlite:"):
        return SqliteMetadataStore(url)
    raise ValueError(f"unsupported metadata URL {url!r}: only sqlite:/// is implemented")
