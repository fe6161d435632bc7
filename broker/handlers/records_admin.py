"""DeleteRecords (21) and OffsetForLeaderEpoch (23).

There is one node and the leader epoch is 0 forever, so OffsetForLeaderEpoch answers epoch 0
with the log end offset as its end offset (as Kafka does for the latest epoch), and UNDEFINED (-1, -1) for any other epoch, as Kafka
does for epochs it has not seen.
"""
from __future__ import annotations

import logging
from typing import Any

import protocol
from protocol import ErrorCode

from ..partition import find_topic, get_partition
from .registry import RequestContext, handler

log = logging.getLogger(__name__)

DELETE_RECORDS = 21
OFFSET_FOR_LEADER_EPOCH = 23
LEADER_EPOCH = 0
UNDEFINED = -1


@handler(DELETE_RECORDS)
async def handle_delete_records(ctx: RequestContext, req: Any) -> Any:
    """Advance log start offsets; offset -1 means 'up to the high watermark'."""
    Resp = protocol.response_class(DELETE_RECORDS)
    TopicResp = Resp.DeleteRecordsTopicResult
    PartResp = TopicResp.DeleteRecordsPartitionResult
    topics = []
    for t in req.topics or []:
        topic = find_topic(ctx.broker, t.name)
        parts = []
        for p in t.partitions or []:
            partition = get_partition(topic, p.partition_index)
            if partition is None:
                parts.append(PartResp(partition_index=p.partition_index, low_watermark=-1,
                                      error_code=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION))
                continue
            hw = partition.high_watermark
            target = hw if p.offset == -1 else p.offset
            if target < 0 or target > hw:
                parts.append(PartResp(partition_index=p.partition_index, low_watermark=-1,
                                      error_code=ErrorCode.OFFSET_OUT_OF_RANGE))
                continue
            try:
                low = await partition.trim_to(target)
                err = ErrorCode.NONE
            except Exception:  # noqa: BLE001
                log.exception("delete records failed topic=%s partition=%d", t.name,
                              p.partition_index)
                low, err = -1, ErrorCode.KAFKA_STORAGE_ERROR
            parts.append(PartResp(partition_index=p.partition_index, low_watermark=low,
                                  error_code=int(err)))
        topics.append(TopicResp(name=t.name, partitions=parts))
    return Resp(version=ctx.version, throttle_time_ms=0, topics=topics)


@handler(OFFSET_FOR_LEADER_EPOCH)
async def handle_offset_for_leader_epoch(ctx: RequestContext, req: Any) -> Any:
    """End offset of the requested epoch; validates the caller's current epoch."""
    Resp = protocol.response_class(OFFSET_FOR_LEADER_EPOCH)
    TopicResp = Resp.OffsetForLeaderTopicResult
    PartResp = TopicResp.EpochEndOffset
    topics = []
    for t in req.topics or []:
        topic = find_topic(ctx.broker, t.topic)
        parts = []
        for p in t.partitions or []:
            partition = get_partition(topic, p.partition)
            current = getattr(p, "current_leader_epoch", -1)
            if partition is None:
                err, epoch, end = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, UNDEFINED, UNDEFINED
            elif current is not None and current > LEADER_EPOCH:
                err, epoch, end = ErrorCode.UNKNOWN_LEADER_EPOCH, UNDEFINED, UNDEFINED
            elif current is not None and 0 <= current < LEADER_EPOCH:
                err, epoch, end = ErrorCode.FENCED_LEADER_EPOCH, UNDEFINED, UNDEFINED
            elif p.leader_epoch == LEADER_EPOCH:
                # like Kafka: the log end offset of the latest epoch (never below any
                # consumer position, so clients cannot mistake it for a truncation)
                err, epoch, end = ErrorCode.NONE, LEADER_EPOCH, partition.log_end_offset
            else:
                err, epoch, end = ErrorCode.NONE, UNDEFINED, UNDEFINED
            parts.append(PartResp(error_code=int(err), partition=p.partition,
                                  leader_epoch=epoch, end_offset=end))
        topics.append(TopicResp(topic=t.topic, partitions=parts))
    return Resp(version=ctx.version, throttle_time_ms=0, topics=topics)
