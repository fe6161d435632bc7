"""InitProducerId (22) and DescribeProducers (61).

Idempotent producers get a fresh producer id with epoch 0 every time (as Kafka does without a
transactional id); ids come from a durable counter, so none is reused after a restart. A
transactional id goes to the transaction coordinator (``broker/transactions/``): same producer
id, bumped epoch (fencing the previous instance), INVALID_TRANSACTION_TIMEOUT above
``transaction.max.timeout.ms``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import protocol
from protocol import ErrorCode

from ..failures import note
from ..partition import Partition
from ..producer_state import producer_store_for
from ..transactions import ensure_transactions
from .per_partition import answer_partitions
from .registry import RequestContext, handler

log = logging.getLogger(__name__)

INIT_PRODUCER_ID = 22
DESCRIBE_PRODUCERS = 61


@handler(INIT_PRODUCER_ID)
async def handle_init_producer_id(ctx: RequestContext, req: Any) -> Any:
    Resp = protocol.response_class(INIT_PRODUCER_ID)
    txn_id = getattr(req, "transactional_id", None)
    if txn_id:
        try:
            coord = await ensure_transactions(ctx.broker)
            err, pid, epoch = await coord.init_producer_id(
                txn_id, req.transaction_timeout_ms, getattr(req, "producer_id", -1),
                getattr(req, "producer_epoch", -1))
        except Exception as exc:  # noqa: BLE001 - the database may be busy/broken: retriable
            note(exc, f"InitProducerId transactional_id={txn_id}")
            err, pid, epoch = ErrorCode.COORDINATOR_NOT_AVAILABLE, -1, -1
        if err == ErrorCode.PRODUCER_FENCED and ctx.version < 4:
            err = ErrorCode.INVALID_PRODUCER_EPOCH  # PRODUCER_FENCED is v4+ (KIP-588)
        return Resp(version=ctx.version, throttle_time_ms=0, error_code=int(err),
                    producer_id=pid, producer_epoch=epoch)
    try:
        store = producer_store_for(ctx.broker)
        pid, epoch = await asyncio.to_thread(store.allocate_producer_id), 0
        err = ErrorCode.NONE
    except Exception as exc:  # noqa: BLE001 - the database may be busy/broken: retriable
        # Kafka answers COORDINATOR_LOAD_IN_PROGRESS while no producer id block is at hand:
        # an idempotent producer retries in place (it has no coordinator to look up)
        note(exc, "producer id allocation")
        pid, epoch, err = -1, -1, ErrorCode.COORDINATOR_LOAD_IN_PROGRESS
    return Resp(version=ctx.version, throttle_time_ms=0, error_code=int(err),
                producer_id=pid, producer_epoch=epoch)


@handler(DESCRIBE_PRODUCERS)
async def handle_describe_producers(ctx: RequestContext, req: Any) -> Any:
    Resp = protocol.response_class(DESCRIBE_PRODUCERS)
    TopicResp = Resp.TopicResponse
    PartResp = TopicResp.PartitionResponse
    State = PartResp.ProducerState

    async def answer(name: str, index: int, partition: Partition | None) -> Any:
        if partition is None:
            return PartResp(partition_index=index, error_code=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
                            error_message=None, active_producers=[])
        active = [State(producer_id=pid, producer_epoch=epoch, last_sequence=seq,
                        last_timestamp=ts, coordinator_epoch=marked,
                        current_txn_start_offset=first)
                  for pid, epoch, seq, ts, first, marked in partition.producer_rows()]
        return PartResp(partition_index=index, error_code=0, error_message=None,
                        active_producers=active)

    topics = await answer_partitions(ctx.broker, req.topics, answer,
                                     lambda name, parts: TopicResp(name=name, partitions=parts),
                                     partitions_field="partition_indexes", index_field=None)
    return Resp(version=ctx.version, throttle_time_ms=0, topics=topics)
