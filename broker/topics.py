"""Topics: creation/deletion/partition growth, and their configs with Kafka's names and defaults.

A topic's effective config is Kafka's default, overridden by the broker-wide ``topic_defaults``
(reported with source STATIC_BROKER_CONFIG), overridden by the topic's own overrides (source
TOPIC_CONFIG). ``Topic.configs`` is the live effective dict handed to ``Partition.open``: it is
updated in place when configs change, so partitions always read current values.
"""
from __future__ import annotations

import asyncio
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from protocol import CorruptRecordError, ErrorCode, convert_legacy, has_keyless_record, is_legacy

from .metastore import MetadataStore, TopicRecord

log = logging.getLogger(__name__)

LONG_MAX = str(2 ** 63 - 1)

# ConfigType (DescribeConfigs v3+) and ConfigSource numbers, fixed by the protocol.
BOOLEAN, STRING, INT, SHORT, LONG, DOUBLE, LIST = 1, 2, 3, 4, 5, 6, 7
SOURCE_TOPIC, SOURCE_STATIC_BROKER, SOURCE_DEFAULT = 1, 4, 5


@dataclass(frozen=True)
class ConfigDef:
    """A Kafka topic config: default value, wire type, validator, and the broker synonym."""

    name: str
    default: str
    type: int
    doc: str
    broker_name: str | None = None
    check: Callable[[str], bool] | None = None


def _int_at_least(lo: int) -> Callable[[str], bool]:
    return lambda v: int(v) >= lo


def _one_of(*choices: str) -> Callable[[str], bool]:
    return lambda v: v in choices


def _list_of(*choices: str) -> Callable[[str], bool]:
    return lambda v: all(x.strip() in choices for x in v.split(",")) and bool(v.strip())


def _ratio(v: str) -> bool:
    return 0.0 <= float(v) <= 1.0


_DEFS = [
    ConfigDef("cleanup.policy", "delete", LIST, "delete: retention trims the log; compact: the log cleaner keeps the latest record per key (broker/compaction.py), keyless records are refused (INVALID_RECORD)",
              "log.cleanup.policy", _list_of("delete", "compact")),
    ConfigDef("compression.type", "producer", STRING, "accepted and reported; batches are stored as the producer compressed them",
              "compression.type",
              _one_of("uncompressed", "zstd", "lz4", "snappy", "gzip", "producer")),
    ConfigDef("compression.gzip.level", "-1", INT, "gzip level", "compression.gzip.level",
              lambda v: int(v) == -1 or 1 <= int(v) <= 9),
    ConfigDef("compression.lz4.level", "9", INT, "lz4 level", "compression.lz4.level",
              lambda v: 1 <= int(v) <= 17),
    ConfigDef("compression.zstd.level", "3", INT, "zstd level", "compression.zstd.level",
              lambda v: -131072 <= int(v) <= 22),
    ConfigDef("delete.retention.ms", "86400000", LONG, "tombstones are kept this long after the cleaner first processes them",
              "log.cleaner.delete.retention.ms", _int_at_least(0)),
    ConfigDef("file.delete.delay.ms", "60000", LONG, "accepted for compatibility",
              "log.segment.delete.delay.ms", _int_at_least(0)),
    ConfigDef("flush.messages", LONG_MAX, LONG, "accepted; every batch is made durable in the WAL",
              "log.flush.interval.messages", _int_at_least(1)),
    ConfigDef("flush.ms", LONG_MAX, LONG, "accepted; every batch is made durable in the WAL",
              "log.flush.interval.ms", _int_at_least(0)),
    ConfigDef("follower.replication.throttled.replicas", "", LIST,
              "accepted; replicas copy nothing (they read the object store), so there is "
              "nothing to throttle",
              "follower.replication.throttled.replicas"),
    ConfigDef("index.interval.bytes", "4096", INT, "accepted for compatibility",
              "log.index.interval.bytes", _int_at_least(0)),
    ConfigDef("leader.replication.throttled.replicas", "", LIST,
              "accepted; replicas copy nothing (they read the object store), so there is "
              "nothing to throttle",
              "leader.replication.throttled.replicas"),
    ConfigDef("local.retention.bytes", "-2", LONG, "accepted for compatibility",
              "log.local.retention.bytes", _int_at_least(-2)),
    ConfigDef("local.retention.ms", "-2", LONG, "accepted for compatibility",
              "log.local.retention.ms", _int_at_least(-2)),
    ConfigDef("max.compaction.lag.ms", LONG_MAX, LONG, "dirty data older than this is compacted whatever the dirty ratio",
              "log.cleaner.max.compaction.lag.ms", _int_at_least(1)),
    ConfigDef("max.message.bytes", "1048588", INT, "largest record batch accepted; bigger ones get MESSAGE_TOO_LARGE (enforced)",
              "message.max.bytes", _int_at_least(0)),
    # deprecated in Kafka 3.x (message formats v0/v1, KIP-724; KIP-937): still accepted and
    # reported with their defaults, as Kafka 3.x does, and ignored as Kafka ignores them
    ConfigDef("message.downconversion.enable", "true", BOOLEAN,
              "deprecated in Kafka: accepted and ignored (Fetch v0-3 answers are always "
              "down-converted)", "log.message.downconversion.enable"),
    ConfigDef("message.format.version", "3.0-IV1", STRING,
              "deprecated in Kafka: accepted and ignored (batches are stored as magic 2)",
              "log.message.format.version",
              lambda v: re.fullmatch(r"\d+\.\d+(\.\d+)?(-IV\d+)?", v) is not None),
    ConfigDef("message.timestamp.after.max.ms", "3600000", LONG,
              "INVALID_TIMESTAMP beyond this (enforced, CreateTime only)",
              "log.message.timestamp.after.max.ms", _int_at_least(0)),
    ConfigDef("message.timestamp.before.max.ms", LONG_MAX, LONG,
              "INVALID_TIMESTAMP beyond this (enforced, CreateTime only)",
              "log.message.timestamp.before.max.ms", _int_at_least(0)),
    ConfigDef("message.timestamp.difference.max.ms", LONG_MAX, LONG,
              "deprecated in Kafka (use message.timestamp.before/after.max.ms): accepted and "
              "ignored", "log.message.timestamp.difference.max.ms", _int_at_least(0)),
    ConfigDef("message.timestamp.type", "CreateTime", STRING,
              "CreateTime keeps producer timestamps; LogAppendTime stamps batches with broker "
              "time (enforced)",
              "log.message.timestamp.type", _one_of("CreateTime", "LogAppendTime")),
    ConfigDef("min.cleanable.dirty.ratio", "0.5", DOUBLE, "compact once dirty bytes are this share of the log's uploaded bytes",
              "log.cleaner.min.cleanable.ratio", _ratio),
    ConfigDef("min.compaction.lag.ms", "0", LONG, "batches newer than this are not compacted yet",
              "log.cleaner.min.compaction.lag.ms", _int_at_least(0)),
    ConfigDef("min.insync.replicas", "1", INT,
              "accepted, not enforced: a record has one copy (its leader's WAL, then the "
              "object store), acks=all waits for that copy to be durable",
              "min.insync.replicas", _int_at_least(1)),
    ConfigDef("preallocate", "false", BOOLEAN, "accepted for compatibility", "log.preallocate"),
    ConfigDef("remote.log.copy.disable", "false", BOOLEAN, "accepted for compatibility", None),
    ConfigDef("remote.log.delete.on.disable", "false", BOOLEAN, "accepted for compatibility",
              None),
    ConfigDef("remote.storage.enable", "false", BOOLEAN, "accepted (storage is always remote)",
              None),
    ConfigDef("retention.bytes", "-1", LONG, "per-partition size limit, -1 = none (enforced by the retention task)",
              "log.retention.bytes", _int_at_least(-1)),
    ConfigDef("retention.ms", "604800000", LONG, "age limit in ms, -1 = forever (enforced by the retention task)",
              "log.retention.ms", _int_at_least(-1)),
    ConfigDef("segment.bytes", "1073741824", INT, "accepted for compatibility",
              "log.segment.bytes", _int_at_least(14)),
    ConfigDef("segment.index.bytes", "10485760", INT, "accepted for compatibility",
              "log.index.size.max.bytes", _int_at_least(4)),
    ConfigDef("segment.jitter.ms", "0", LONG, "accepted for compatibility",
              "log.roll.jitter.ms", _int_at_least(0)),
    ConfigDef("segment.ms", "604800000", LONG, "accepted for compatibility", "log.roll.ms",
              _int_at_least(1)),
    ConfigDef("unclean.leader.election.enable", "false", BOOLEAN,
              "accepted; a new leader takes over the old one's WAL, so no election loses "
              "acknowledged records",
              "unclean.leader.election.enable"),
]
TOPIC_CONFIGS: dict[str, ConfigDef] = {d.name: d for d in _DEFS}

# Kafka's internal topics. Group offsets live in the metadata database, not in a topic, but
# clients and tools expect __consumer_offsets to exist: the broker keeps it as a real, empty,
# compacted topic (readable, so regex subscriptions that match it, as librdkafka's do, simply
# see nothing) that Metadata lists with is_internal=true (listTopics() and pattern
# subscriptions of Java and kafka-python leave it out). Creating it answers
# TOPIC_ALREADY_EXISTS, producing to it INVALID_TOPIC_EXCEPTION, as Kafka does;
# __transaction_state (transaction state lives in the metadata database) and
# __cluster_metadata cannot be created either.
CONSUMER_OFFSETS = "__consumer_offsets"
INTERNAL_TOPICS = frozenset({CONSUMER_OFFSETS, "__transaction_state", "__cluster_metadata"})
INTERNAL_TOPIC_PARTITIONS = 1
INTERNAL_TOPIC_CONFIGS = {"cleanup.policy": "compact"}

_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]+")
MAX_TOPIC_NAME = 249


class TopicError(Exception):
    """A per-topic failure with the Kafka error code to answer."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def validate_topic_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise TopicError(ErrorCode.INVALID_TOPIC, "topic name is empty")
    if name in (".", ".."):
        raise TopicError(ErrorCode.INVALID_TOPIC, f"topic name {name!r} is illegal")
    if len(name) > MAX_TOPIC_NAME:
        raise TopicError(ErrorCode.INVALID_TOPIC,
                         f"topic name is longer than {MAX_TOPIC_NAME} characters")
    if not _TOPIC_NAME.fullmatch(name):
        raise TopicError(ErrorCode.INVALID_TOPIC,
                         f"topic name {name!r} has characters other than ASCII alphanumerics, "
                         "'.', '_' and '-'")


def validate_config(name: str, value: str | None) -> str:
    """Check one topic config override; returns the normalised value."""
    d = TOPIC_CONFIGS.get(name)
    if d is None:
        raise TopicError(ErrorCode.INVALID_CONFIG, f"unknown topic config {name!r}")
    if value is None:
        raise TopicError(ErrorCode.INVALID_CONFIG, f"null value for {name}")
    v = value.strip()
    try:
        if d.type in (INT, LONG, SHORT):
            n = int(v)
            if d.type == INT and not -2 ** 31 <= n < 2 ** 31:
                raise ValueError("out of int range")
            if d.type == LONG and not -2 ** 63 <= n < 2 ** 63:
                raise ValueError("out of long range")
            v = str(n)
        elif d.type == DOUBLE:
            float(v)
        elif d.type == BOOLEAN:
            if v.lower() not in ("true", "false"):
                raise ValueError("expected true or false")
            v = v.lower()
        if d.check is not None and not d.check(v):
            raise ValueError("value not allowed")
    except ValueError as exc:
        raise TopicError(ErrorCode.INVALID_CONFIG,
                         f"invalid value {value!r} for configuration {name}: {exc}") from None
    return v


@dataclass
class Topic:
    """A topic as the handlers see it (``broker.topics[name]``)."""

    name: str
    topic_id: uuid.UUID
    partitions: list[Any] = field(default_factory=list)     # broker.partition.Partition
    configs: dict[str, str] = field(default_factory=dict)    # live effective config
    overrides: dict[str, str] = field(default_factory=dict)  # per-topic overrides only
    stream_ids: list[int] = field(default_factory=list)
    is_internal: bool = False


def check_internal_create(name: Any) -> None:
    """Clients cannot create internal topics (Kafka's answers)."""
    if name == CONSUMER_OFFSETS:
        raise TopicError(ErrorCode.TOPIC_ALREADY_EXISTS, f"Topic '{name}' already exists.")
    if name in INTERNAL_TOPICS:
        raise TopicError(ErrorCode.INVALID_REQUEST,
                         f"Creation of internal topic {name} is prohibited.")


def keyless_record_error(topic: "Topic", index: int, records: Any) -> str | None:
    """Kafka's INVALID_RECORD message when ``records`` for a compacted topic hold a record
    without a key, else None. Only compacted topics decode records here (never the hot path of
    other topics); undecodable payloads are left to the partition's own validation."""
    configs = getattr(topic, "configs", None) or {}
    if "compact" not in configs.get("cleanup.policy", "") or records is None:
        return None
    try:
        payload = convert_legacy(records) if is_legacy(records) else records
        if not has_keyless_record(payload):
            return None
    except (CorruptRecordError, ValueError):
        return None
    return (f"Compacted topic cannot accept message without key in topic partition "
            f"{topic.name}-{index}.")


class TopicManager:
    """Creates, deletes and reconfigures topics; owns ``broker.topics``.

    One asyncio lock serialises changes, so concurrent auto-creation of the same topic (say,
    from several producers at once) creates it once.
    """

    def __init__(self, broker: Any, meta: MetadataStore) -> None:
        self.broker = broker
        self.meta = meta
        self.topics: dict[str, Topic] = {}
        self._lock = asyncio.Lock()

    # ---- configs ---------------------------------------------------------------------
    @property
    def broker_defaults(self) -> dict[str, str]:
        return dict(getattr(self.broker.config, "topic_defaults", {}) or {})

    def effective(self, overrides: dict[str, str]) -> dict[str, str]:
        eff = {n: d.default for n, d in TOPIC_CONFIGS.items()}
        eff.update({k: v for k, v in self.broker_defaults.items() if k in TOPIC_CONFIGS})
        eff.update(overrides)
        return eff

    def describe(self, topic: Topic) -> list[tuple[str, str, int]]:
        """(name, value, source) for every known topic config, sorted by name."""
        bd = self.broker_defaults
        out = []
        for name in sorted(TOPIC_CONFIGS):
            if name in topic.overrides:
                out.append((name, topic.overrides[name], SOURCE_TOPIC))
            elif name in bd:
                out.append((name, bd[name], SOURCE_STATIC_BROKER))
            else:
                out.append((name, TOPIC_CONFIGS[name].default, SOURCE_DEFAULT))
        return out

    def validate_configs(self, configs: dict[str, str | None]) -> dict[str, str]:
        return {k: validate_config(k, v) for k, v in configs.items()}

    async def set_overrides(self, topic: Topic, overrides: dict[str, str]) -> None:
        """Persist new overrides and update the live dict the partitions read."""
        await asyncio.to_thread(self.meta.set_topic_configs, topic.name, overrides)
        self._apply_overrides(topic, overrides)
        self._changed()
        log.info("topic configs changed topic=%s overrides=%s", topic.name, overrides)

    def _apply_overrides(self, topic: Topic, overrides: dict[str, str]) -> None:
        topic.overrides = dict(overrides)
        eff = self.effective(topic.overrides)
        topic.configs.clear()
        topic.configs.update(eff)

    # ---- the cluster room (broker/cluster): which partitions this broker leads ----------
    @property
    def _cluster(self) -> Any:
        return getattr(self.broker, "cluster", None)

    def _changed(self) -> None:
        if self._cluster is not None:
            self._cluster.topic_changed()

    async def _leaders(self, topic: Topic, first: int, count: int, rf: int) -> list[int]:
        """Leaders of new partitions, recorded before the topic is (a cluster of one: us)."""
        c = self._cluster
        if c is None:
            return [self.broker.config.node_id] * count
        leaders = c.placement(count)
        await c.assign_new(topic.topic_id, first, leaders, max(1, rf))
        return leaders

    def _disown(self, stream_id: int) -> None:
        disown = getattr(self.broker.store, "disown_stream", None)
        if disown is not None:
            disown(stream_id)

    async def sync(self) -> None:
        """Take topic changes other brokers made (the cluster room calls this when the
        shared metadata changed): new, deleted and grown topics and config changes.
        Partitions are opened by the cluster room once they are assigned here."""
        async with self._lock:
            records = {r.name: r for r in await asyncio.to_thread(self.meta.load_topics)}
            for name in [n for n, t in self.topics.items()
                         if n not in records or records[n].topic_id != t.topic_id]:
                topic = self.topics.pop(name)
                for p in topic.partitions:
                    if p is not None:
                        await p.close()
                        self._disown(p.stream.stream_id)
                log.info("topic deleted elsewhere topic=%s", name)
            for name, rec in records.items():
                topic = self.topics.get(name)
                if topic is None:
                    topic = Topic(rec.name, rec.topic_id, configs=self.effective(rec.configs),
                                  overrides=dict(rec.configs), stream_ids=list(rec.stream_ids),
                                  partitions=[None] * len(rec.stream_ids),
                                  is_internal=rec.name in INTERNAL_TOPICS)
                    self.topics[name] = topic
                    log.info("topic created elsewhere topic=%s partitions=%d", name,
                             len(rec.stream_ids))
                    continue
                if len(rec.stream_ids) > len(topic.partitions):
                    topic.stream_ids = list(rec.stream_ids)
                    topic.partitions.extend([None] * (len(rec.stream_ids) -
                                                      len(topic.partitions)))
                if rec.configs != topic.overrides:
                    self._apply_overrides(topic, rec.configs)

    # ---- lifecycle -------------------------------------------------------------------
    async def load(self) -> None:
        """Open every stored topic's partitions this broker leads (at start-up)."""
        records = await asyncio.to_thread(self.meta.load_topics)
        c = self._cluster
        elsewhere = getattr(self.broker.store, "written_elsewhere", None)
        for rec in records:
            topic = Topic(rec.name, rec.topic_id, configs=self.effective(rec.configs),
                          overrides=dict(rec.configs), stream_ids=list(rec.stream_ids),
                          is_internal=rec.name in INTERNAL_TOPICS)
            try:
                if c is not None:
                    await c.claim_unassigned(rec.topic_id, len(rec.stream_ids))
                for i, sid in enumerate(rec.stream_ids):
                    if c is not None and (not c.should_open(rec.topic_id, i) or (
                            elsewhere is not None and await elsewhere(sid))):
                        # led elsewhere; or handed here while this broker started (its view
                        # of the stream predates the hand-over): the cluster room's first
                        # round opens it as a move does (acquired at the assignment's epoch)
                        topic.partitions.append(None)
                        self._disown(sid)
                        continue
                    topic.partitions.append(await self._open_partition(topic, i, sid,
                                                                        create=False))
            except Exception:  # noqa: BLE001 - one broken topic must not stop the broker
                log.exception("cannot open topic=%s; it stays unavailable", rec.name)
                continue
            self.topics[rec.name] = topic
        if CONSUMER_OFFSETS not in self.topics:
            try:
                await self.create(CONSUMER_OFFSETS, INTERNAL_TOPIC_PARTITIONS,
                                  dict(INTERNAL_TOPIC_CONFIGS))
            except TopicError as exc:  # another broker of the cluster created it just now
                if exc.code != ErrorCode.TOPIC_ALREADY_EXISTS:
                    log.error("cannot create internal topic=%s: %s", CONSUMER_OFFSETS, exc)
            except Exception:  # noqa: BLE001 - only clients listing it would miss it
                log.exception("cannot create internal topic=%s", CONSUMER_OFFSETS)
        log.info("topics loaded count=%d", len(self.topics))

    async def _open_partition(self, topic: Topic, index: int, stream_id: int | None,
                              create: bool) -> Any:
        from .partition import Partition  # noqa: PLC0415 - datapath module, import late

        store = self.broker.store
        stream = await store.create_stream() if create else await store.open_stream(stream_id)
        return await Partition.open(self.broker, topic.name, topic.topic_id, index, stream,
                                    topic.configs)

    def check_create(self, name: Any, num_partitions: int, replication_factor: int,
                     assignments: list[tuple[int, list[int]]] | None,
                     configs: dict[str, str | None]) -> tuple[int, dict[str, str]]:
        """Validate a creation; returns (partition count, validated overrides)."""
        validate_topic_name(name)
        check_internal_create(name)
        if name in self.topics:
            raise TopicError(ErrorCode.TOPIC_ALREADY_EXISTS, f"topic {name!r} already exists")
        node = self.broker.config.node_id
        live = sorted(self._cluster.live) if self._cluster is not None else [node]
        if not live:
            live = [node]
        if assignments:
            if num_partitions not in (-1, 0) or replication_factor not in (-1, 0):
                raise TopicError(ErrorCode.INVALID_REQUEST, "both partition count/replication "
                                 "factor and a manual assignment were given")
            idx = sorted(i for i, _ in assignments)
            if idx != list(range(len(idx))):
                raise TopicError(ErrorCode.INVALID_REPLICATION_ASSIGNMENT,
                                 "partition indexes must be 0..n-1")
            for _, brokers in assignments:
                _check_replicas(list(brokers), live)
            count = len(idx)
        else:
            count = self.broker.config.default_partitions if num_partitions == -1 \
                else num_partitions
            if count <= 0:
                raise TopicError(ErrorCode.INVALID_PARTITIONS,
                                 "number of partitions must be larger than 0")
            if replication_factor != -1 and not 1 <= replication_factor <= len(live):
                n = len(live)
                raise TopicError(ErrorCode.INVALID_REPLICATION_FACTOR,
                                 f"replication factor {replication_factor} is larger than the "
                                 f"{n} available broker{'s' if n > 1 else ''}"
                                 if replication_factor > 1 else
                                 "replication factor must be larger than 0")
        if count > 100_000:
            raise TopicError(ErrorCode.INVALID_PARTITIONS, "too many partitions")
        return count, self.validate_configs(configs)

    async def create(self, name: str, count: int, overrides: dict[str, str],
                     replication_factor: int = 1,
                     leaders: list[int] | None = None) -> Topic:
        """Create a validated topic: streams first, then one metadata transaction.
        ``leaders``: a manual assignment's first broker per partition."""
        async with self._lock:
            if name in self.topics:
                raise TopicError(ErrorCode.TOPIC_ALREADY_EXISTS, f"topic {name!r} already exists")
            topic = Topic(name, uuid.uuid4(), configs=self.effective(overrides),
                          overrides=dict(overrides), is_internal=name in INTERNAL_TOPICS)
            topic.stream_ids = await self._open_new_partitions(
                topic, count, lambda ids: self.meta.create_topic(TopicRecord(
                    name, topic.topic_id, dict(overrides), list(ids))),
                replication_factor, leaders)
            self.topics[name] = topic
            self._changed()
            log.info("topic created topic=%s id=%s partitions=%d configs=%s", name,
                     topic.topic_id, count, overrides)
            return topic

    async def auto_create(self, name: str) -> Topic | None:
        """Create ``name`` with broker defaults if auto-creation is on; None otherwise."""
        if name in self.topics:
            return self.topics[name]
        if not self.broker.config.auto_create_topics or name in INTERNAL_TOPICS:
            return None
        validate_topic_name(name)
        try:
            return await self.create(name, self.broker.config.default_partitions, {})
        except TopicError as exc:
            if exc.code == ErrorCode.TOPIC_ALREADY_EXISTS:
                return self.topics.get(name)
            raise

    async def delete(self, name: str) -> None:
        async with self._lock:
            topic = self.topics.get(name)
            if topic is None:
                raise TopicError(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"unknown topic {name!r}")
            if topic.is_internal:
                raise TopicError(ErrorCode.INVALID_REQUEST,
                                 f"Cannot delete internal topic {name}.")
            await asyncio.to_thread(self.meta.delete_topic, name)
            del self.topics[name]
            if self._cluster is not None:
                await self._cluster.forget_topic(topic.topic_id)
            await _close_partitions(topic)
            for sid in topic.stream_ids:
                await self._drop_stream(sid)
            log.info("topic deleted topic=%s id=%s", name, topic.topic_id)
        groups = getattr(self.broker, "groups", None)
        if groups is not None:  # the committed offsets of the topic go too, as in Kafka
            await groups.on_topic_deleted(name)

    async def _open_new_partitions(self, topic: Topic, count: int,
                                   record: Callable[[list[int]], None], rf: int = 1,
                                   leaders: list[int] | None = None) -> list[int]:
        """Append ``count`` partitions to ``topic``: streams first, then ``record(stream ids)``
        (one metadata transaction, run in a thread; the streams are dropped again if it fails),
        then the partitions are opened. Returns the new stream ids."""
        streams = [await self.broker.store.create_stream() for _ in range(count)]
        ids = [s.stream_id for s in streams]
        first = len(topic.partitions)
        try:
            if leaders is not None and self._cluster is not None:
                await self._cluster.assign_new(topic.topic_id, first, leaders, max(1, rf))
            else:
                leaders = await self._leaders(topic, first, count, rf if rf > 0 else 1)
            await asyncio.to_thread(record, ids)
        except Exception:
            for sid in ids:
                await self._drop_stream(sid)
            if first == 0 and self._cluster is not None:
                await self._cluster.forget_topic(topic.topic_id)
                names = {r.name for r in await asyncio.to_thread(self.meta.load_topics)}
                if topic.name in names:   # another broker created it a moment ago
                    raise TopicError(ErrorCode.TOPIC_ALREADY_EXISTS,
                                     f"topic {topic.name!r} already exists") from None
            raise
        from .partition import Partition  # noqa: PLC0415

        node = self.broker.config.node_id
        for i, s in enumerate(streams):
            if leaders[i] != node:        # led by another broker, which opens it
                topic.partitions.append(None)
                self._disown(s.stream_id)
                continue
            topic.partitions.append(await Partition.open(
                self.broker, topic.name, topic.topic_id, first + i, s, topic.configs))
        return ids

    async def _drop_stream(self, stream_id: int) -> None:
        try:
            await self.broker.store.delete_stream(stream_id)
        except Exception:  # noqa: BLE001 - an orphan stream only wastes space
            log.exception("delete_stream failed stream=%d", stream_id)

    def check_add_partitions(self, name: str, count: int,
                             assignments: list[list[int]] | None) -> Topic:
        topic = self.topics.get(name)
        if topic is None:
            raise TopicError(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"unknown topic {name!r}")
        have = len(topic.partitions)
        if count < have:
            raise TopicError(ErrorCode.INVALID_PARTITIONS,
                             f"topic has {have} partitions; cannot shrink to {count}")
        if count == have:
            raise TopicError(ErrorCode.INVALID_PARTITIONS, f"topic already has {have} partitions")
        if count > 100_000:
            raise TopicError(ErrorCode.INVALID_PARTITIONS, "too many partitions")
        if assignments is not None:
            if len(assignments) != count - have:
                raise TopicError(ErrorCode.INVALID_REPLICATION_ASSIGNMENT,
                                 f"expected {count - have} assignments, got {len(assignments)}")
            node = self.broker.config.node_id
            live = sorted(self._cluster.live) if self._cluster is not None else [node]
            for brokers in assignments:
                _check_replicas(list(brokers), live or [node])
        return topic

    async def add_partitions(self, name: str, count: int) -> None:
        async with self._lock:
            topic = self.check_add_partitions(name, count, None)
            have = len(topic.partitions)
            ids = await self._open_new_partitions(
                topic, count - have, lambda ids: self.meta.add_partitions(name, have, ids))
            topic.stream_ids.extend(ids)
            self._changed()
            log.info("partitions added topic=%s partitions=%d->%d", name, have, count)

    async def close(self) -> None:
        for topic in list(self.topics.values()):
            await _close_partitions(topic)


async def _close_partitions(topic: Topic) -> None:
    """Close each open partition of a topic (deleted, or the broker stopping); a failure is
    logged and the others still close."""
    for p in topic.partitions:
        if p is None:
            continue
        try:
            await p.close()
        except Exception:  # noqa: BLE001
            log.exception("closing partition failed topic=%s", topic.name)


def _check_replicas(brokers: list[int], live: list[int]) -> None:
    """A manual assignment may name live brokers only, each once."""
    if len(live) == 1 and brokers != live:
        raise TopicError(ErrorCode.INVALID_REPLICATION_ASSIGNMENT,
                         f"this single-node cluster has only broker {live[0]}")
    if not brokers or len(set(brokers)) != len(brokers) or any(b not in live for b in brokers):
        raise TopicError(ErrorCode.INVALID_REPLICATION_ASSIGNMENT,
                         f"replicas {brokers} must be distinct live brokers of {live}")
