"""Topic administration: CreateTopics, DeleteTopics, CreatePartitions and the config APIs."""
from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from protocol import ErrorCode, response_class
from storage.stream import StorageError

from ..failures import is_store_outage, note
from ..listeners import encode as encode_listeners
from ..partition import find_topic_by_id
from ..topics import (BOOLEAN, INT, LIST, LONG, SOURCE_DEFAULT, SOURCE_STATIC_BROKER,
                      SOURCE_TOPIC, STRING, TOPIC_CONFIGS, Topic, TopicError, validate_config)
from .registry import RequestContext, handler

log = logging.getLogger(__name__)

CREATE_TOPICS, DELETE_TOPICS, CREATE_PARTITIONS = 19, 20, 37
DESCRIBE_CONFIGS, ALTER_CONFIGS, INCREMENTAL_ALTER_CONFIGS = 32, 33, 44
RESOURCE_TOPIC, RESOURCE_BROKER, RESOURCE_BROKER_LOGGER = 2, 4, 8
OP_SET, OP_DELETE, OP_APPEND, OP_SUBTRACT = 0, 1, 2, 3
ZERO_UUID = uuid.UUID(int=0)


def _err(exc: Exception) -> tuple[int, str]:
    if isinstance(exc, TopicError):
        return exc.code, exc.message
    if isinstance(exc, StorageError):
        log.warning("admin operation hit a storage error: %s", exc)
        return ErrorCode.KAFKA_STORAGE_ERROR, str(exc)
    if is_store_outage(exc):   # what a broker answers when its controller cannot be reached
        note(exc, "admin operation")
        return ErrorCode.REQUEST_TIMED_OUT, "metadata store unavailable; retry"
    log.exception("admin operation failed", exc_info=exc)
    return ErrorCode.UNKNOWN_SERVER_ERROR, str(exc) or type(exc).__name__


def _check_named_once(names: list[str], name: str) -> None:
    """A topic named twice in one request is refused (for both mentions), as Kafka does."""
    if names.count(name) > 1:
        raise TopicError(ErrorCode.INVALID_REQUEST,
                         f"topic {name!r} appears more than once in the request")


# ---- CreateTopics ---------------------------------------------------------------------
@handler(CREATE_TOPICS)
async def create_topics(ctx: RequestContext, req: Any) -> Any:
    mgr = ctx.broker.topic_manager
    v = ctx.version
    cls = response_class(CREATE_TOPICS)
    rcls = cls.CreatableTopicResult
    ccls = rcls.CreatableTopicConfigs
    validate_only = bool(getattr(req, "validate_only", False))
    names = [t.name for t in req.topics]
    results = []
    for t in req.topics:
        topic: Topic | None = None
        count = -1
        rf = 1
        try:
            _check_named_once(names, t.name)
            configs: dict[str, str | None] = {}
            for c in t.configs or []:
                configs[c.name] = c.value
            assignments = [(a.partition_index, list(a.broker_ids)) for a in t.assignments or []]
            count, overrides = mgr.check_create(t.name, t.num_partitions, t.replication_factor,
                                                assignments, configs)
            rf = len(assignments[0][1]) if assignments else \
                (t.replication_factor if t.replication_factor > 0 else 1)
            if not validate_only:
                leaders = [b[0] for _, b in sorted(assignments)] if assignments else None
                topic = await mgr.create(t.name, count, overrides, rf, leaders)
            err, msg = ErrorCode.NONE, None
        except Exception as exc:  # noqa: BLE001 - answered per topic
            err, msg = _err(exc)
        res: dict[str, Any] = dict(name=t.name, error_code=err, error_message=msg)
        if v >= 7:
            res["topic_id"] = topic.topic_id if topic is not None else ZERO_UUID
        if v >= 5:
            if err == ErrorCode.NONE:
                overrides_now = topic.overrides if topic is not None else overrides
                tmp = Topic(t.name, ZERO_UUID, overrides=dict(overrides_now))
                res.update(num_partitions=count, replication_factor=rf, configs=[
                    ccls(name=n, value=val, read_only=False, config_source=src,
                         is_sensitive=False) for n, val, src in mgr.describe(tmp)])
            else:
                res.update(num_partitions=-1, replication_factor=-1, configs=None)
        results.append(rcls(**res))
    return cls(version=v, throttle_time_ms=0, topics=results)


# ---- DeleteTopics ---------------------------------------------------------------------
@handler(DELETE_TOPICS)
async def delete_topics(ctx: RequestContext, req: Any) -> Any:
    broker, v = ctx.broker, ctx.version
    mgr = broker.topic_manager
    cls = response_class(DELETE_TOPICS)
    rcls = cls.DeletableTopicResult
    if v >= 6:
        wanted = [(t.name, t.topic_id) for t in req.topics]
    else:
        wanted = [(n, None) for n in req.topic_names]
    results = []
    for name, tid in wanted:
        err, msg = ErrorCode.NONE, None
        if name is None and tid not in (None, ZERO_UUID):
            topic = find_topic_by_id(broker, tid)
            if topic is None:
                err, msg = ErrorCode.UNKNOWN_TOPIC_ID, f"unknown topic id {tid}"
            else:
                name = topic.name
        elif name is not None and tid not in (None, ZERO_UUID):
            err, msg = ErrorCode.INVALID_REQUEST, "give a topic name or a topic id, not both"
        topic = broker.topics.get(name) if name is not None else None
        if err == ErrorCode.NONE:
            if not broker.config.delete_topic_enable:
                err, msg = ErrorCode.TOPIC_DELETION_DISABLED, "delete.topic.enable is false"
            elif topic is None:
                err, msg = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"unknown topic {name!r}"
            else:
                tid = topic.topic_id
                try:
                    await mgr.delete(name)
                except Exception as exc:  # noqa: BLE001
                    err, msg = _err(exc)
        res: dict[str, Any] = dict(name=name, error_code=err)
        if v >= 5:
            res["error_message"] = msg
        if v >= 6:
            res["topic_id"] = tid if tid is not None else ZERO_UUID
        results.append(rcls(**res))
    return cls(version=v, throttle_time_ms=0, responses=results)


# ---- CreatePartitions -----------------------------------------------------------------
@handler(CREATE_PARTITIONS)
async def create_partitions(ctx: RequestContext, req: Any) -> Any:
    mgr = ctx.broker.topic_manager
    cls = response_class(CREATE_PARTITIONS)
    rcls = cls.CreatePartitionsTopicResult
    names = [t.name for t in req.topics]
    results = []
    for t in req.topics:
        try:
            _check_named_once(names, t.name)
            assignments = None if t.assignments is None else [list(a.broker_ids)
                                                              for a in t.assignments]
            mgr.check_add_partitions(t.name, t.count, assignments)
            if not req.validate_only:
                await mgr.add_partitions(t.name, t.count)
            err, msg = ErrorCode.NONE, None
        except Exception as exc:  # noqa: BLE001
            err, msg = _err(exc)
        results.append(rcls(name=t.name, error_code=err, error_message=msg))
    return cls(version=ctx.version, throttle_time_ms=0, results=results)


# ---- configs --------------------------------------------------------------------------
def broker_configs(broker: Any) -> list[tuple[str, str | None, int, int, bool, str]]:
    """(name, value, source, type, read_only, doc) of every broker config we report."""
    cfg = broker.config
    out: list[tuple[str, str | None, int, int, bool, str]] = []
    S = SOURCE_STATIC_BROKER

    def b(x: bool) -> str:
        return "true" if x else "false"

    out += [
        ("broker.id", str(cfg.node_id), S, INT, True, "--node-id"),
        ("node.id", str(cfg.node_id), S, INT, True, "--node-id"),
        ("listeners", cfg.listeners or f"PLAINTEXT://{cfg.listen}", S, LIST, True,
         "--listeners" if cfg.listeners else "--listen"),
        ("advertised.listeners", encode_listeners(cfg.listener_list()) if cfg.listeners
         else f"PLAINTEXT://{cfg.advertised_host}:{cfg.advertised_port}", S,
         LIST, True, "--advertised-listeners" if cfg.listeners else "--advertised-listener"),
        ("log.dirs", cfg.data_path, S, STRING, True, "--data-dir"),
        ("auto.create.topics.enable", b(cfg.auto_create_topics), S, BOOLEAN, True,
         "--auto-create-topics"),
        ("num.partitions", str(cfg.default_partitions), S, INT, True, "--default-partitions"),
        ("default.replication.factor", "1", SOURCE_DEFAULT, INT, True,
         "replication factor -1 in CreateTopics and auto-created topics"),
        ("delete.topic.enable", b(cfg.delete_topic_enable), S, BOOLEAN, True,
         "--delete-topic-enable"),
        ("socket.request.max.bytes", str(cfg.max_request_bytes), S, INT, True,
         "--max-request-bytes"),
        ("log.retention.check.interval.ms", str(cfg.retention_check_interval_ms), S, LONG, True,
         "--retention-check-interval-ms"),
        ("producer.id.expiration.ms", str(cfg.producer_id_expiration_ms), S, INT, True, ""),
        ("group.min.session.timeout.ms", str(cfg.group_min_session_timeout_ms), S, INT, True, ""),
        ("group.max.session.timeout.ms", str(cfg.group_max_session_timeout_ms), S, INT, True, ""),
        ("group.initial.rebalance.delay.ms", str(cfg.group_initial_rebalance_delay_ms), S, INT,
         True, ""),
        ("offset.metadata.max.bytes", str(cfg.offset_metadata_max_bytes), S, INT, True, ""),
    ]
    defaults = cfg.topic_defaults or {}
    for d in TOPIC_CONFIGS.values():
        if d.broker_name and d.broker_name not in {o[0] for o in out}:
            if d.name in defaults:
                out.append((d.broker_name, defaults[d.name], S, d.type, True, d.doc))
            else:
                out.append((d.broker_name, d.default, SOURCE_DEFAULT, d.type, True, d.doc))
    return sorted(out)


def _topic_entries(mgr: Any, topic: Topic, synonyms: bool
                   ) -> list[tuple[str, str | None, int, int, bool, str, list]]:
    out = []
    bd = mgr.broker_defaults
    for name, value, source in mgr.describe(topic):
        d = TOPIC_CONFIGS[name]
        syn: list[tuple[str, str, int]] = []
        if synonyms:
            if name in topic.overrides:
                syn.append((name, topic.overrides[name], SOURCE_TOPIC))
            if d.broker_name:
                if name in bd:
                    syn.append((d.broker_name, bd[name], SOURCE_STATIC_BROKER))
                syn.append((d.broker_name, d.default, SOURCE_DEFAULT))
            elif source == SOURCE_DEFAULT:
                syn.append((name, d.default, SOURCE_DEFAULT))
        out.append((name, value, source, d.type, False, d.doc, syn))
    return out


@handler(DESCRIBE_CONFIGS)
async def describe_configs(ctx: RequestContext, req: Any) -> Any:
    broker, v = ctx.broker, ctx.version
    mgr = broker.topic_manager
    cls = response_class(DESCRIBE_CONFIGS)
    rcls = cls.DescribeConfigsResult
    ecls = rcls.DescribeConfigsResourceResult
    scls = ecls.DescribeConfigsSynonym
    include_synonyms = bool(getattr(req, "include_synonyms", False))
    include_docs = bool(getattr(req, "include_documentation", False)) if v >= 3 else False
    results = []
    for res in req.resources:
        keys = set(res.configuration_keys) if res.configuration_keys is not None else None
        err, msg, entries = ErrorCode.NONE, None, []
        if res.resource_type == RESOURCE_TOPIC:
            topic = broker.topics.get(res.resource_name)
            if topic is None:
                err, msg = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, \
                    f"unknown topic {res.resource_name!r}"
            else:
                entries = _topic_entries(mgr, topic, include_synonyms)
        elif res.resource_type == RESOURCE_BROKER:
            if res.resource_name not in ("", str(broker.config.node_id)):
                err, msg = ErrorCode.INVALID_REQUEST, f"unknown broker {res.resource_name!r}"
            else:
                entries = [(n, val, src, typ, ro, doc,
                            [(n, val, src)] if include_synonyms else [])
                           for n, val, src, typ, ro, doc in broker_configs(broker)]
        elif res.resource_type == RESOURCE_BROKER_LOGGER:
            err, msg = ErrorCode.INVALID_REQUEST, "broker loggers are not configurable"
        else:
            err, msg = ErrorCode.INVALID_REQUEST, f"unsupported resource type {res.resource_type}"
        configs = []
        for name, value, source, typ, ro, doc, syn in entries:
            if keys is not None and name not in keys:
                continue
            configs.append(ecls(
                name=name, value=value, read_only=ro, config_source=source,
                is_default=source == SOURCE_DEFAULT, is_sensitive=False,
                synonyms=[scls(name=sn, value=sv, source=ss) for sn, sv, ss in syn],
                config_type=typ, documentation=doc if include_docs else None))
        results.append(rcls(error_code=err, error_message=msg, resource_type=res.resource_type,
                            resource_name=res.resource_name, configs=configs))
    return cls(version=v, throttle_time_ms=0, results=results)


def _non_topic_error(broker: Any, res: Any) -> tuple[int, str]:
    if res.resource_type == RESOURCE_BROKER:
        return (ErrorCode.INVALID_CONFIG, "broker configs are static in s3kafka: set them with "
                "flags, environment or the config file and restart")
    return ErrorCode.INVALID_REQUEST, f"unsupported resource type {res.resource_type}"


async def _alter_topic_configs(ctx: RequestContext, req: Any, api_key: int,
                               new_overrides: Callable[[Any, Topic, Any], dict[str, str]]) -> Any:
    """The loop both AlterConfigs APIs share: per resource, find the topic, compute its new
    overrides with ``new_overrides(mgr, topic, resource)``, store them unless validate_only,
    and answer an error code per resource."""
    broker = ctx.broker
    mgr = broker.topic_manager
    cls = response_class(api_key)
    rcls = cls.AlterConfigsResourceResponse
    out = []
    for res in req.resources:
        err, msg = ErrorCode.NONE, None
        try:
            if res.resource_type != RESOURCE_TOPIC:
                raise TopicError(*_non_topic_error(broker, res))
            topic = broker.topics.get(res.resource_name)
            if topic is None:
                raise TopicError(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
                                 f"unknown topic {res.resource_name!r}")
            new = new_overrides(mgr, topic, res)
            if not req.validate_only:
                await mgr.set_overrides(topic, new)
        except Exception as exc:  # noqa: BLE001
            err, msg = _err(exc)
        out.append(rcls(error_code=err, error_message=msg, resource_type=res.resource_type,
                        resource_name=res.resource_name))
    return cls(version=ctx.version, throttle_time_ms=0, responses=out)


def _replaced_overrides(mgr: Any, topic: Topic, res: Any) -> dict[str, str]:
    """Legacy AlterConfigs: the given set (null values dropped) replaces every override."""
    return {c.name: validate_config(c.name, c.value) for c in res.configs if c.value is not None}


@handler(ALTER_CONFIGS)
async def alter_configs(ctx: RequestContext, req: Any) -> Any:
    """Legacy AlterConfigs: the given set replaces every override of the topic."""
    return await _alter_topic_configs(ctx, req, ALTER_CONFIGS, _replaced_overrides)


def _split_list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def _incremental_overrides(mgr: Any, topic: Topic, res: Any) -> dict[str, str]:
    """SET/DELETE/APPEND/SUBTRACT applied in order to a copy of the topic's overrides."""
    seen = [c.name for c in res.configs]
    if len(seen) != len(set(seen)):
        raise TopicError(ErrorCode.INVALID_REQUEST, "a config appears more than once")
    new = dict(topic.overrides)
    for c in res.configs:
        d = TOPIC_CONFIGS.get(c.name)
        if d is None:
            raise TopicError(ErrorCode.INVALID_CONFIG, f"unknown topic config {c.name!r}")
        op = c.config_operation
        if op == OP_SET:
            new[c.name] = validate_config(c.name, c.value)
        elif op == OP_DELETE:
            new.pop(c.name, None)
        elif op in (OP_APPEND, OP_SUBTRACT):
            if d.type != LIST:
                raise TopicError(ErrorCode.INVALID_CONFIG,
                                 f"{c.name} is not a list; cannot APPEND/SUBTRACT")
            current = _split_list(mgr.effective(new)[c.name])
            items = _split_list(c.value or "")
            if op == OP_APPEND:
                merged = current + [x for x in items if x not in current]
            else:
                merged = [x for x in current if x not in items]
            if merged or d.check is None:
                new[c.name] = validate_config(c.name, ",".join(merged))
            elif op == OP_SUBTRACT:
                new[c.name] = ""   # Kafka leaves the list empty (cleanup.policy: no deletion)
            else:
                raise TopicError(ErrorCode.INVALID_CONFIG, f"{c.name} cannot be empty")
        else:
            raise TopicError(ErrorCode.INVALID_REQUEST, f"unknown operation {op}")
    return new


@handler(INCREMENTAL_ALTER_CONFIGS)
async def incremental_alter_configs(ctx: RequestContext, req: Any) -> Any:
    """SET/DELETE/APPEND/SUBTRACT applied in order to a copy; stored only if all are valid."""
    return await _alter_topic_configs(ctx, req, INCREMENTAL_ALTER_CONFIGS,
                                      _incremental_overrides)


# ---- DescribeLogDirs ------------------------------------------------------------------
DESCRIBE_LOG_DIRS = 35


@handler(DESCRIBE_LOG_DIRS)
async def describe_log_dirs(ctx: RequestContext, req: Any) -> Any:
    """One log dir (the data dir) holding every partition; sizes are the bytes each partition
    keeps (its log index's total), which tools use to size reassignments and disks."""
    import shutil  # noqa: PLC0415 - only this rarely called handler needs it

    broker, v = ctx.broker, ctx.version
    cls = response_class(DESCRIBE_LOG_DIRS)
    rcls = cls.DescribeLogDirsResult
    tcls = rcls.DescribeLogDirsTopic
    pcls = tcls.DescribeLogDirsPartition
    if req.topics is None:
        wanted = [(name, None) for name in sorted(broker.topics)]
    else:
        wanted = [(t.topic, list(t.partitions)) for t in req.topics]
    topics = []
    for name, indexes in wanted:
        topic = broker.topics.get(name)
        if topic is None:
            continue   # Kafka leaves out partitions this broker does not host
        parts = []
        for i in (range(len(topic.partitions)) if indexes is None else indexes):
            if not 0 <= i < len(topic.partitions):
                continue
            p = topic.partitions[i]
            index = getattr(p, "log_index", None)
            size = int(getattr(index, "total_bytes", 0)) if index is not None else 0
            parts.append(pcls(partition_index=i, partition_size=size, offset_lag=0,
                              is_future_key=False))
        topics.append(tcls(name=name, partitions=parts))
    path = broker.config.data_path
    total = usable = -1
    try:
        du = shutil.disk_usage(path)
        total, usable = du.total, du.free
    except OSError:
        pass
    result = rcls(error_code=0, log_dir=path, topics=topics, total_bytes=total,
                  usable_bytes=usable, is_cordoned=False)
    return cls(version=v, throttle_time_ms=0, error_code=0, results=[result])


# ---- partition moves (broker/cluster) -------------------------------------------------
ELECT_LEADERS, ALTER_PARTITION_REASSIGNMENTS, LIST_PARTITION_REASSIGNMENTS = 43, 45, 46


@handler(ALTER_PARTITION_REASSIGNMENTS)
async def alter_partition_reassignments(ctx: RequestContext, req: Any) -> Any:
    """The first broker of a partition's new replica list becomes its leader (the data stays
    in the object store: a move hands the stream over, nothing is copied); a null list
    cancels a move still in progress."""
    broker = ctx.broker
    cls = response_class(ALTER_PARTITION_REASSIGNMENTS)
    tcls = cls.ReassignableTopicResponse
    pcls = tcls.ReassignablePartitionResponse
    out = []
    for t in req.topics or []:
        topic = broker.topics.get(t.name)
        parts = []
        for p in t.partitions or []:
            if topic is None or not 0 <= p.partition_index < len(topic.partitions):
                err: int = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
            elif p.replicas is not None and (not p.replicas or
                                             len(set(p.replicas)) != len(p.replicas)):
                err = ErrorCode.INVALID_REPLICATION_ASSIGNMENT
            else:
                target = p.replicas[0] if p.replicas is not None else None
                try:
                    err = await broker.cluster.request_move(topic, p.partition_index, target)
                except Exception as exc:  # noqa: BLE001 - answered per partition
                    err, _ = _err(exc)
            parts.append(pcls(partition_index=p.partition_index, error_code=err,
                              error_message=None if not err else ErrorCode(err).name))
        out.append(tcls(name=t.name, partitions=parts))
    return cls(version=ctx.version, throttle_time_ms=0, error_code=0, error_message=None,
               responses=out)


@handler(LIST_PARTITION_REASSIGNMENTS)
async def list_partition_reassignments(ctx: RequestContext, req: Any) -> Any:
    """Moves in progress: the leader is being removed, the target added."""
    broker = ctx.broker
    cluster = broker.cluster
    cls = response_class(LIST_PARTITION_REASSIGNMENTS)
    tcls = cls.OngoingTopicReassignment
    pcls = tcls.OngoingPartitionReassignment
    if req.topics is None:
        wanted = [(t, range(len(t.partitions))) for t in broker.topics.values()]
    else:
        wanted = [(broker.topics[t.name], t.partition_indexes) for t in req.topics
                  if t.name in broker.topics]
    out = []
    for topic, idxs in sorted(wanted, key=lambda w: w[0].name):
        parts = []
        for i in idxs:
            a = cluster.assign.get((str(topic.topic_id), i))
            if a is not None and a.state == "moving" and a.target >= 0:
                parts.append(pcls(partition_index=i, replicas=[a.leader, a.target],
                                  adding_replicas=[a.target], removing_replicas=[a.leader]))
        if parts:
            out.append(tcls(name=topic.name, partitions=parts))
    return cls(version=ctx.version, throttle_time_ms=0, error_code=0, error_message=None,
               topics=out)


@handler(ELECT_LEADERS)
async def elect_leaders(ctx: RequestContext, req: Any) -> Any:
    """Every partition's leader is its preferred replica (the first of the list reported),
    so a preferred election is never needed; an unclean one has nothing to do either."""
    broker = ctx.broker
    cls = response_class(ELECT_LEADERS)
    rcls = cls.ReplicaElectionResult
    pcls = rcls.PartitionResult
    if req.topic_partitions is None:
        wanted = [(t.name, list(range(len(t.partitions)))) for t in broker.topics.values()]
    else:
        wanted = [(t.topic, list(t.partitions)) for t in req.topic_partitions]
    out = []
    for name, idxs in wanted:
        topic = broker.topics.get(name)
        parts = []
        for i in idxs:
            if topic is None or not 0 <= i < len(topic.partitions):
                parts.append(pcls(partition_id=i,
                                  error_code=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
                                  error_message="unknown topic or partition"))
            elif broker.cluster.leader(topic, i)[0] < 0:
                parts.append(pcls(partition_id=i, error_code=ErrorCode.ELIGIBLE_LEADERS_NOT_AVAILABLE,
                                  error_message="its broker is offline"))
            else:
                parts.append(pcls(partition_id=i, error_code=ErrorCode.ELECTION_NOT_NEEDED,
                                  error_message="the partition is led by its preferred replica"))
        out.append(rcls(topic=name, partition_result=parts))
    kw: dict[str, Any] = {"error_code": 0} if ctx.version >= 1 else {}
    return cls(version=ctx.version, throttle_time_ms=0, replica_election_results=out, **kw)
