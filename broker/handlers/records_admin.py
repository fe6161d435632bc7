"""DeleteRecords (21) and OffsetForLeaderEpoch (23).

Appended batches carry the leader epoch of the broker that appended them (partition.py,
``Partition.leader_epoch``), and the cluster records where each epoch after 0 began
(``cluster_leader_epochs``). OffsetForLeaderEpoch answers as Kafka does: the latest epoch ends
at the log end offset; an older epoch E ends where the first epoch after E began; an epoch
above the latest is UNDEFINED (-1, -1). Epoch 0 is answered with the log end offset: batches
appended before leader epochs were stamped carry 0 whichever leader wrote them, at any offset,
so a consumer that last read one of those must not see a truncation (the log never truncates).
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

    async def answer(name: str, p: Any, partition: Partition | None) -> Any:
        if partition is None:
            low, err = -1, ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        else:
            low, err = await _delete_records(name, p, partition)
        return PartResp(partition_index=p.partition_index, low_watermark=low, error_code=int(err))

    topics = await answer_partitions(ctx.broker, req.topics, answer,
                                     lambda name, parts: TopicResp(name=name, partitions=parts))
    return Resp(version=ctx.version, throttle_time_ms=0, topics=topics)


async def _delete_records(name: str, p: Any, partition: Partition) -> tuple[int, int]:
    """(new low watermark, error) for one partition of a DeleteRecords request."""
    hw = partition.high_watermark
    target = hw if p.offset == -1 else p.offset
    if target < 0 or target > hw:
        return -1, ErrorCode.OFFSET_OUT_OF_RANGE
    try:
        return await partition.trim_to(target), ErrorCode.NONE
    except Exception:  # noqa: BLE001
        log.exception("delete records failed topic=%s partition=%d", name, p.partition_index)
        return -1, ErrorCode.KAFKA_STORAGE_ERROR


@handler(OFFSET_FOR_LEADER_EPOCH)
async def handle_offset_for_leader_epoch(ctx: RequestContext, req: Any) -> Any:
    """End offset of the requested epoch; validates the caller's current epoch."""
    Resp = protocol.response_class(OFFSET_FOR_LEADER_EPOCH)
    TopicResp = Resp.OffsetForLeaderTopicResult
    PartResp = TopicResp.EpochEndOffset

    cluster = getattr(ctx.broker, "cluster", None)

    async def answer(name: str, p: Any, partition: Partition | None) -> Any:
        current = getattr(p, "current_leader_epoch", -1)
        topic = ctx.broker.topics.get(name)
        latest = LEADER_EPOCH
        if cluster is not None and topic is not None and \
                0 <= p.partition < len(topic.partitions):
            latest = cluster.leader(topic, p.partition)[1]
        if partition is None:
            err = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION if topic is None or \
                not 0 <= p.partition < len(topic.partitions) \
                else ErrorCode.NOT_LEADER_OR_FOLLOWER
            epoch, end = UNDEFINED, UNDEFINED
        elif current is not None and current > latest:
            err, epoch, end = ErrorCode.UNKNOWN_LEADER_EPOCH, UNDEFINED, UNDEFINED
        elif current is not None and 0 <= current < latest:
            err, epoch, end = ErrorCode.FENCED_LEADER_EPOCH, UNDEFINED, UNDEFINED
        elif p.leader_epoch == latest:
            # like Kafka: the log end offset of the latest epoch (never below any
            # consumer position, so clients cannot mistake it for a truncation)
            err, epoch, end = ErrorCode.NONE, latest, partition.log_end_offset
        elif p.leader_epoch == LEADER_EPOCH:
            # batches appended before epochs were stamped carry 0 whichever leader wrote
            # them, so a client that read one of those asks for epoch 0 at any position: as
            # far as the log tells, it has not ended. Answering where epoch 1 began would look
            # like a truncation to a consumer past it (librdkafka, Java and kafka-python then
            # seek back there and commit the lower offset).
            err, epoch, end = ErrorCode.NONE, LEADER_EPOCH, partition.log_end_offset
        elif p.leader_epoch < 0 or p.leader_epoch > latest:   # unknown epoch, like Kafka
            err, epoch, end = ErrorCode.NONE, UNDEFINED, UNDEFINED
        else:
            # an older epoch: it ends where the next epoch (a move) started
            history = [(0, 0)] + (await cluster.leader_epochs(topic, p.partition)
                                  if cluster is not None else [])
            older = [h for h in history if h[0] <= p.leader_epoch]
            later = [h for h in history if h[0] > p.leader_epoch]
            err = ErrorCode.NONE
            epoch = older[-1][0] if older else UNDEFINED
            end = later[0][1] if later else partition.log_end_offset
        return PartResp(error_code=int(err), partition=p.partition, leader_epoch=epoch,
                        end_offset=end)

    topics = await answer_partitions(ctx.broker, req.topics, answer,
                                     lambda name, parts: TopicResp(topic=name, partitions=parts),
                                     name_field="topic", index_field="partition")
    return Resp(version=ctx.version, throttle_time_ms=0, topics=topics)
