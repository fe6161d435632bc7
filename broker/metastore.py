"""The broker's own metadata: cluster id, topics, their configs and partition -> stream ids.

Kept in the metadata database (tables prefixed ``kafka_``; the storage engine keeps its own
``s3_`` tables in the same database): SQLite by default, or PostgreSQL shared by the brokers of
a cluster (one cluster id per database), both through ``storage.sqldb``. Every change is one
transaction, committed durably before the admin request is answered, so an acknowledged topic
survives a crash.
"""
from __future__ import annotations

import abc
import base64
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from storage import sqldb

log = logging.getLogger(__name__)


class ClusterMisconfigured(OSError):
    """This broker's settings contradict the cluster it joins (an OSError: start-up reports it
    as one line ``cannot start: ...`` and exits 1)."""


def object_store_identity(url: str) -> str:
    """What must be equal for two brokers to share data: scheme, bucket and prefix (the
    ``?endpoint_url=...`` part may differ by where a broker runs), or a file:// directory."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return "file://" + os.path.normpath(os.path.abspath(parts.netloc + parts.path))
    return f"{parts.scheme}://{parts.netloc}/{parts.path.strip('/')}".rstrip("/")


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

    def bind_object_store(self, object_store_url: str, joining: bool | None = None) -> None:
        """Record (first broker) or check (every later one) the cluster's object store."""

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


STEPS: list[sqldb.Step] = [
    (1, """
CREATE TABLE IF NOT EXISTS kafka_cluster (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS kafka_topics (
    name TEXT PRIMARY KEY,
    topic_id TEXT NOT NULL UNIQUE,
    configs TEXT NOT NULL DEFAULT '{}',
    created_ms BIGINT NOT NULL DEFAULT @NOW_MS@
);
CREATE TABLE IF NOT EXISTS kafka_partitions (
    topic TEXT NOT NULL REFERENCES kafka_topics(name) ON DELETE CASCADE,
    partition INTEGER NOT NULL,
    stream_id BIGINT NOT NULL,
    PRIMARY KEY (topic, partition)
)
"""),
]


def sqlite_path(url: str) -> str:
    """``sqlite:///abs/path`` or ``sqlite:///rel/path`` -> filesystem path."""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"not a sqlite:/// metadata URL: {url!r}")
    return sqldb.sqlite_path(url)


class SqlMetadataStore(MetadataStore):
    """On one ``sqldb.Database`` connection (admin traffic is light)."""

    def __init__(self, url: str) -> None:
        self.db = sqldb.connect(url)
        try:
            self.db.migrate("kafka", STEPS)
        except BaseException:
            self.db.close()
            raise

    def _tx(self, statements: list[tuple[str, tuple]]) -> None:
        def body(tx: sqldb.Tx) -> None:
            for sql, args in statements:
                tx.execute(sql, args)
        self.db.transact(body)

    def cluster_id(self) -> str:
        """The cluster id, created once per database (Kafka style: 22 chars of url-safe
        base64); brokers sharing a database share it."""
        select = "SELECT value FROM kafka_cluster WHERE key='cluster_id'"
        row = self.db.query_one(select)
        if row:
            return str(row[0])
        new = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")

        def body(tx: sqldb.Tx) -> str:
            tx.execute("INSERT INTO kafka_cluster(key, value) VALUES ('cluster_id', ?)"
                       " ON CONFLICT (key) DO NOTHING", (new,))
            return str(tx.query_one(select)[0])
        return self.db.transact(body)

    def bind_object_store(self, object_store_url: str, joining: bool | None = None) -> None:
        """On a shared (PostgreSQL) database, the first broker records the object store and a
        broker pointed at another one refuses to start: its data would be invisible to the
        others. An SQLite database is shared only by brokers on one host: the cluster room
        calls this with ``joining`` - False for a broker alone in its cluster (it records its
        store: its data dir, and a file:// store in it, may have moved), True for one joining
        live brokers (checked like PostgreSQL)."""
        if not self.db.is_postgres and not joining:
            if joining is False:
                self._tx([("INSERT INTO kafka_cluster(key, value) VALUES ('object_store', ?)"
                           " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                           (object_store_identity(object_store_url),))])
            return
        mine = object_store_identity(object_store_url)

        def body(tx: sqldb.Tx) -> str:
            tx.execute("INSERT INTO kafka_cluster(key, value) VALUES ('object_store', ?)"
                       " ON CONFLICT (key) DO NOTHING", (mine,))
            return str(tx.query_one(
                "SELECT value FROM kafka_cluster WHERE key='object_store'")[0])
        theirs = self.db.transact(body)
        if theirs != mine:
            raise ClusterMisconfigured(
                f"--object-store {mine} is not this cluster's object store {theirs} (cluster"
                f" {self.cluster_id()}): brokers sharing a metadata database must share one"
                " object store")

    def load_topics(self) -> list[TopicRecord]:
        def body(tx: sqldb.Tx) -> tuple[list[tuple], list[tuple]]:
            return (tx.query("SELECT name, topic_id, configs FROM kafka_topics ORDER BY name"),
                    tx.query("SELECT topic, partition, stream_id FROM kafka_partitions "
                             "ORDER BY topic, partition"))
        topics, parts = self.db.transact(body)   # one snapshot of both tables
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
        self.db.close()


SqliteMetadataStore = SqlMetadataStore  # the name it had before PostgreSQL


def open_metadata_store(url: str) -> MetadataStore:
    """The MetadataStore for a ``--metadata`` URL (``sqlite:///...`` or ``postgresql://...``)."""
    if url.startswith("sqlite:") or sqldb.is_postgres_url(url):
        return SqlMetadataStore(url)
    raise ValueError(f"unsupported metadata URL {url!r}: use sqlite:///PATH or "
                     "postgresql://USER:PASS@HOST:PORT/DB")
