"""Metadata, DescribeCluster and DescribeTopicPartitions: brokers and partition leaders as the
cluster room (broker/cluster) sees them; a single broker leads every partition at epoch 0."""
from __future__ import annotations

import logging
import uuid
from typing import Any

from protocol import ErrorCode, response_class

from ..failures import note
from ..listeners import of_connection, own_address
from ..partition import find_topic_by_id
from ..topics import INTERNAL_TOPICS, Topic, TopicError, validate_topic_name
from .authorized import CLUSTER_OPS, NOT_REQUESTED, TOPIC_OPS, as_int32, ops_if
from .registry import RequestContext, handler

log = logging.getLogger(__name__)

METADATA, DESCRIBE_CLUSTER, DESCRIBE_TOPIC_PARTITIONS = 3, 60, 75
ZERO_UUID = uuid.UUID(int=0)
LEADER_EPOCH = 0


async def resolve_topic(ctx: RequestContext, name: str, allow_create: bool
                        ) -> tuple[Topic | None, int]:
    """Find (or auto-create) a topic; returns (topic, error code)."""
    broker = ctx.broker
    topic = broker.topics.get(name)
    if topic is not None:
        return topic, ErrorCode.NONE
    if name in INTERNAL_TOPICS:   # never created by clients: a permanent error, not "unknown"
        return None, ErrorCode.INVALID_TOPIC
    try:
        validate_topic_name(name)
    except TopicError as exc:
        return None, exc.code
    catch_up = getattr(getattr(broker, "cluster", None), "catch_up", None)
    if catch_up is not None:
        # another broker may have created it a moment ago: once CreateTopics was answered,
        # every broker's Metadata lists the topic (a group joining right after it would get
        # nothing assigned and depend on a metadata-triggered rebalance)
        await catch_up()
        topic = broker.topics.get(name)
        if topic is not None:
            return topic, ErrorCode.NONE
    if allow_create and broker.config.auto_create_topics:
        try:
            topic = await broker.auto_create_topic(name)
        except TopicError as exc:
            return None, exc.code
        except Exception as exc:  # noqa: BLE001 - e.g. storage trouble: the client retries
            note(exc, f"auto-creating topic={name}")
            return None, ErrorCode.LEADER_NOT_AVAILABLE
        if topic is not None:
            return topic, ErrorCode.NONE
    return None, ErrorCode.UNKNOWN_TOPIC_OR_PARTITION


def _partitions(pcls: Any, topic: Topic, node: int, start: int = 0, limit: int | None = None,
                extra: dict[str, Any] | None = None, cluster: Any = None) -> list[Any]:
    n = len(topic.partitions)
    end = n if limit is None else min(n, start + limit)
    if cluster is None:
        return [pcls(error_code=0, partition_index=i, leader_id=node, leader_epoch=LEADER_EPOCH,
                     replica_nodes=[node], isr_nodes=[node], offline_replicas=[],
                     **(extra or {})) for i in range(start, end)]
    out = []
    for i in range(start, end):
        leader, epoch = cluster.leader(topic, i)
        replicas = cluster.replicas(topic, i, leader)
        out.append(pcls(error_code=0 if leader >= 0 else ErrorCode.LEADER_NOT_AVAILABLE,
                        partition_index=i, leader_id=leader, leader_epoch=epoch,
                        replica_nodes=replicas, isr_nodes=list(replicas), offline_replicas=[],
                        **(extra or {})))
    return out


def _brokers(broker: Any, listener: str | None = None) -> list[tuple[int, str, int, str | None]]:
    """(node id, host, port, rack) of every live broker, as advertised on the client's
    listener (broker/listeners.py); this one always among them."""
    cfg = broker.config
    me = (cfg.node_id, *own_address(cfg, listener), getattr(cfg, "rack", "") or None)
    cluster = getattr(broker, "cluster", None)
    if cluster is None:
        return [me]
    out = [(b.node_id, *(cluster.endpoint(b.node_id, listener) or (b.host, b.port)),
            b.rack or None) for b in cluster.live_brokers() if b.node_id != cfg.node_id]
    return sorted(out + [me])


def _controller(broker: Any) -> int:
    cluster = getattr(broker, "cluster", None)
    return cluster.controller_id if cluster is not None else broker.config.node_id


@handler(METADATA)
async def metadata(ctx: RequestContext, req: Any) -> Any:
    broker, v = ctx.broker, ctx.version
    cfg = broker.config
    node = cfg.node_id
    cls = response_class(METADATA)
    tcls = cls.MetadataResponseTopic
    pcls = tcls.MetadataResponsePartition
    allow_create = bool(getattr(req, "allow_auto_topic_creation", True)) if v >= 4 else True
    topic_ops = ops_if(v >= 8 and getattr(req, "include_topic_authorized_operations", False),
                       TOPIC_OPS)
    cluster_ops = ops_if(8 <= v <= 10 and getattr(req, "include_cluster_authorized_operations",
                                                  False), CLUSTER_OPS)
    wanted = req.topics
    topics_out = []
    if wanted is None or (v == 0 and not wanted):
        for topic in sorted(broker.topics.values(), key=lambda t: t.name):
            topics_out.append(tcls(error_code=0, name=topic.name, topic_id=topic.topic_id,
                                   is_internal=topic.is_internal,
                                   partitions=_partitions(pcls, topic, node,
                                                          cluster=getattr(broker, "cluster", None)),
                                   authorized_operations=topic_ops))
    else:
        for t in wanted:
            name = getattr(t, "name", None)
            tid = getattr(t, "topic_id", None) if v >= 10 else None
            if name is None and tid not in (None, ZERO_UUID):
                topic = find_topic_by_id(broker, tid)
                if topic is None:
                    topics_out.append(tcls(error_code=ErrorCode.UNKNOWN_TOPIC_ID, name=None,
                                           topic_id=tid, is_internal=False, partitions=[],
                                           authorized_operations=None))
                    continue
                err = ErrorCode.NONE
            else:
                topic, err = await resolve_topic(ctx, name or "", allow_create)
            if topic is None:
                topics_out.append(tcls(error_code=err, name=name, topic_id=ZERO_UUID,
                                       is_internal=False, partitions=[],
                                       authorized_operations=None))
                continue
            topics_out.append(tcls(error_code=0, name=topic.name, topic_id=topic.topic_id,
                                   is_internal=topic.is_internal,
                                   partitions=_partitions(pcls, topic, node,
                                                          cluster=getattr(broker, "cluster", None)),
                                   authorized_operations=topic_ops))
    brokers = [cls.MetadataResponseBroker(node_id=n, host=h, port=p, rack=r)
               for n, h, p, r in _brokers(broker, of_connection(ctx))]
    return cls(version=v, throttle_time_ms=0, brokers=brokers, cluster_id=broker.cluster_id,
               controller_id=_controller(broker), topics=topics_out,
               authorized_operations=cluster_ops, error_code=0)


@handler(DESCRIBE_CLUSTER)
async def describe_cluster(ctx: RequestContext, req: Any) -> Any:
    broker, v = ctx.broker, ctx.version
    cfg = broker.config
    cls = response_class(DESCRIBE_CLUSTER)
    endpoint_type = getattr(req, "endpoint_type", 1) if v >= 1 else 1
    brokers = [cls.DescribeClusterBroker(broker_id=n, host=h, port=p, rack=r, is_fenced=False)
               for n, h, p, r in _brokers(broker, of_connection(ctx))]
    err, msg = ErrorCode.NONE, None
    if endpoint_type not in (1, 2):
        err, msg, brokers = ErrorCode.UNSUPPORTED_ENDPOINT_TYPE, "unknown endpoint type", []
    return cls(version=v, throttle_time_ms=0, error_code=err, error_message=msg,
               endpoint_type=endpoint_type, cluster_id=broker.cluster_id,
               controller_id=_controller(broker), brokers=brokers,
               authorized_operations=ops_if(req.include_cluster_authorized_operations,
                                            CLUSTER_OPS))


@handler(DESCRIBE_TOPIC_PARTITIONS)
async def describe_topic_partitions(ctx: RequestContext, req: Any) -> Any:
    """KIP-966 paging: topics in name order, at most ``response_partition_limit`` partitions,
    continuing from ``cursor``; ``next_cursor`` says where to continue."""
    broker = ctx.broker
    node = broker.config.node_id
    cls = response_class(DESCRIBE_TOPIC_PARTITIONS)
    tcls = cls.DescribeTopicPartitionsResponseTopic
    pcls = tcls.DescribeTopicPartitionsResponsePartition
    limit = req.response_partition_limit if req.response_partition_limit > 0 else 2000
    limit = min(limit, 2000)
    if req.topics:
        names = sorted({t.name for t in req.topics})
    else:
        names = sorted(broker.topics)
    cursor = req.cursor
    if cursor is not None:
        names = [n for n in names if n >= cursor.topic_name]
    out, next_cursor, budget = [], None, limit
    # Java admin clients call .stream() on these lists: empty, never null.
    extra: dict[str, Any] = {"eligible_leader_replicas": [], "last_known_elr": []}
    for name in names:
        topic = broker.topics.get(name)
        if topic is None:
            out.append(tcls(error_code=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, name=name,
                            topic_id=ZERO_UUID, is_internal=False, partitions=[],
                            topic_authorized_operations=NOT_REQUESTED))
            continue
        start = cursor.partition_index if cursor is not None and name == cursor.topic_name else 0
        start = max(0, start)
        if budget <= 0:
            next_cursor = cls.Cursor(topic_name=name, partition_index=start)
            break
        parts = _partitions(pcls, topic, node, start, budget, extra,
                            getattr(broker, "cluster", None))
        budget -= len(parts)
        out.append(tcls(error_code=0, name=name, topic_id=topic.topic_id,
                        is_internal=topic.is_internal, partitions=parts,
                        topic_authorized_operations=as_int32(TOPIC_OPS)))  # always (KIP-966)
        if start + len(parts) < len(topic.partitions):
            next_cursor = cls.Cursor(topic_name=name, partition_index=start + len(parts))
            break
    return cls(version=ctx.version, throttle_time_ms=0, topics=out, next_cursor=next_cursor)
