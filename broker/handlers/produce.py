"""Produce (api key 0): append record batches to partitions, answer per acks.

acks=0 gets no response at all; acks=1 and acks=-1 (all; one replica here) are answered once
the append is durable in the WAL. Partitions of one request are appended concurrently.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import protocol
from protocol import ErrorCode

from ..partition import AppendResult, find_topic_by_id, get_partition, topic_for_produce
from .registry import RequestContext, handler

log = logging.getLogger(__name__)

PRODUCE = 0


async def _append(ctx: RequestContext, topic: Any, index: int, records: Any,
                  version: int) -> AppendResult:
    partition = get_partition(topic, index)
    if partition is None:
        return AppendResult(error=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION)
    try:
        return await partition.append(records, version)
    except Exception:  # noqa: BLE001 - malformed input must not kill the connection
        log.exception("produce failed topic=%s partition=%d", partition.topic, index)
        return AppendResult(error=ErrorCode.CORRUPT_MESSAGE, message="invalid record batch")


@handler(PRODUCE)
async def handle_produce(ctx: RequestContext, req: Any) -> Any:
    """Append every partition's records; None (no response) for acks=0."""
    version = ctx.version
    acks = req.acks
    Resp = protocol.response_class(PRODUCE)
    TopicResp = Resp.TopicProduceResponse
    PartResp = TopicResp.PartitionProduceResponse

    jobs: list[tuple[int, int, asyncio.Future[AppendResult] | AppendResult]] = []
    topics_out: list[tuple[Any, Any]] = []
    for t_idx, td in enumerate(req.topic_data or []):
        if version >= 13:
            topic = find_topic_by_id(ctx.broker, td.topic_id)
            unknown = ErrorCode.UNKNOWN_TOPIC_ID
        else:
            topic = await topic_for_produce(ctx.broker, td.name)
            unknown = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        topics_out.append((td, topic))
        for pd in td.partition_data or []:
            if acks not in (-1, 0, 1):
                res: Any = AppendResult(error=ErrorCode.INVALID_REQUIRED_ACKS)
            elif getattr(req, "transactional_id", None):
                res = AppendResult(error=ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
                                   message="transactions are not supported")
            elif topic is None:
                res = AppendResult(error=unknown)
            else:
                res = asyncio.ensure_future(_append(ctx, topic, pd.index, pd.records, version))
            jobs.append((t_idx, pd.index, res))

    results: dict[tuple[int, int], AppendResult] = {}
    for t_idx, index, job in jobs:
        results[(t_idx, index)] = await job if isinstance(job, asyncio.Future) else job

    if acks == 0:
        return None
    responses = []
    for t_idx, (td, topic) in enumerate(topics_out):
        parts = []
        for pd in td.partition_data or []:
            r = results[(t_idx, pd.index)]
            parts.append(PartResp(index=pd.index, error_code=int(r.error),
                                  base_offset=r.base_offset if not r.error else -1,
                                  log_append_time_ms=r.log_append_time,
                                  log_start_offset=r.log_start_offset,
                                  record_errors=[], error_message=r.message if r.error else None))
        if version >= 13:
            responses.append(TopicResp(topic_id=td.topic_id, partition_responses=parts))
        else:
            responses.append(TopicResp(name=td.name, partition_responses=parts))
    return Resp(version=version, responses=responses, throttle_time_ms=0)
