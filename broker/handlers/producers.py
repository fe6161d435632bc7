"""InitProducerId (22) and DescribeProducers (61).

Idempotent producers get a fresh producer id with epoch 0 every time (as Kafka does without a
transactional id); ids come from a durable counter, so none is reused after a restart.
Transactions are not offered: a transactional id is refused at once with
TRANSACTIONAL_ID_AUTHORIZATION_FAILED, which librdkafka, Java and kafka-python all treat as
fatal (an answer with a producer id would let ``init_transactions()`` succeed and every later
send time out). A ``transaction.timeout.ms`` above ``transaction.max.timeout.ms`` is checked
first and gets INVALID_TRANSACTION_TIMEOUT, as Kafka's coordinator answers.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import protocol
from protocol import ErrorCode

from ..partition import Partition
from ..producer_state import producer_store_for
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
        if req.transaction_timeout_ms > ctx.broker.config.transaction_max_timeout_ms:
            err = ErrorCode.INVALID_TRANSACTION_TIMEOUT
        else:
            err = ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
        log.info("transactional producer refused transactional_id=%s error=%s peer=%s", txn_id,
                 err.name, getattr(ctx.conn, "peer", "?"))
        return Resp(version=ctx.version, throttle_time_ms=0, error_code=int(err),
                    producer_id=-1, producer_epoch=-1)
    try:
        store = producer_store_for(ctx.broker)
        pid, epoch = await asyncio.to_thread(store.allocate_producer_id), 0
        err = ErrorCode.NONE
    except Exception:  # noqa: BLE001 - the database may be busy/broken: a retriable answer
        log.exception("producer id allocation failed")
        pid, epoch, err = -1, -1, ErrorCode.COORDINATOR_NOT_AVAILABLE
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
                        last_timestamp=ts, coordinator_epoch=-1, current_txn_start_offset=-1)
                  for pid, epoch, seq, ts, _first in partition.producer_rows()]
        return PartResp(partition_index=index, error_code=0, error_message=None,
                        active_producers=active)

    topics = await answer_partitions(ctx.broker, req.topics, answer,
                                     lambda name, parts: TopicResp(name=name, partitions=parts),
                                     partitions_field="partition_indexes", index_field=None)
    return Resp(version=ctx.version, throttle_time_ms=0, topics=topics)
