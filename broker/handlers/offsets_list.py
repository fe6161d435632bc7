"""ListOffsets (api key 2): earliest, latest, max timestamp and lookups by timestamp.

Special timestamps as Kafka defines them: -1 latest (high watermark, or last stable offset
under read_committed), -2 earliest (log start offset), -3 the record with the largest
timestamp (v7+), -4 earliest local (= earliest: all data is "local" through the stream), -5
latest tiered (v9+: offset -1, as Kafka answers for a topic without tiered storage).
A timestamp >= 0 finds the first record whose timestamp is >= it.
"""
from __future__ import annotations

import logging
from typing import Any

import protocol
from protocol import ErrorCode

from ..partition import Partition
from .per_partition import answer_partitions
from .registry import RequestContext, handler

log = logging.getLogger(__name__)

LIST_OFFSETS = 2
LATEST, EARLIEST, MAX_TIMESTAMP, EARLIEST_LOCAL, LATEST_TIERED = -1, -2, -3, -4, -5
READ_COMMITTED = 1


async def lookup(partition: Partition, timestamp: int, read_committed: bool) -> tuple[int, int, int]:
    """(error, offset, timestamp) answering one ListOffsets partition query."""
    if timestamp == LATEST:
        off = partition.last_stable_offset if read_committed else partition.high_watermark
        return ErrorCode.NONE, off, -1
    if timestamp in (EARLIEST, EARLIEST_LOCAL):
        return ErrorCode.NONE, partition.log_start_offset, -1
    if timestamp == LATEST_TIERED:
        return ErrorCode.NONE, -1, -1
    if timestamp == MAX_TIMESTAMP:
        off, ts = await partition.max_timestamp_offset()
        return ErrorCode.NONE, off, ts
    if timestamp < 0:
        return ErrorCode.INVALID_REQUEST, -1, -1
    off, ts = await partition.offset_for_timestamp(timestamp)
    if read_committed and off >= partition.last_stable_offset:
        return ErrorCode.NONE, -1, -1
    return ErrorCode.NONE, off, ts


@handler(LIST_OFFSETS)
async def handle_list_offsets(ctx: RequestContext, req: Any) -> Any:
    version = ctx.version
    Resp = protocol.response_class(LIST_OFFSETS)
    TopicResp = Resp.ListOffsetsTopicResponse
    PartResp = TopicResp.ListOffsetsPartitionResponse
    read_committed = version >= 2 and getattr(req, "isolation_level", 0) == READ_COMMITTED

    async def answer(name: str, p: Any, partition: Partition | None) -> Any:
        if partition is None:
            # in a cluster, a partition of a known topic is led by another broker (consumers,
            # KIP-392 ones too, ask the leader): Kafka answers NOT_LEADER_OR_FOLLOWER
            topic = ctx.broker.topics.get(name) \
                if getattr(ctx.broker, "cluster", None) is not None else None
            led_elsewhere = topic is not None and 0 <= p.partition_index < len(topic.partitions)
            return PartResp(partition_index=p.partition_index,
                            error_code=ErrorCode.NOT_LEADER_OR_FOLLOWER if led_elsewhere
                            else ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
                            timestamp=-1, offset=-1, leader_epoch=-1, old_style_offsets=[])
        try:
            err, off, ts = await lookup(partition, p.timestamp, read_committed)
        except Exception:  # noqa: BLE001 - a broken partition answers an error, not a crash
            log.exception("list offsets failed topic=%s partition=%d", name, p.partition_index)
            err, off, ts = ErrorCode.KAFKA_STORAGE_ERROR, -1, -1
        if version == 0:
            # v0 (0.8/0.9 clients) answers a list of offsets; one is what clients use
            wanted = getattr(p, "max_num_offsets", 1) or 0
            return PartResp(partition_index=p.partition_index, error_code=int(err),
                            old_style_offsets=[off] if off >= 0 and wanted > 0 else [])
        return PartResp(partition_index=p.partition_index, error_code=int(err),
                        timestamp=ts, offset=off, leader_epoch=0 if off >= 0 and not err else -1)

    topics = await answer_partitions(ctx.broker, req.topics, answer,
                                     lambda name, parts: TopicResp(name=name, partitions=parts))
    return Resp(version=version, throttle_time_ms=0, topics=topics)
