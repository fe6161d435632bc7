"""Fetch (api key 1): read partitions with byte limits and long-poll for new data.

Incremental fetch sessions (KIP-227) are declined by answering session_id 0, so every request
is a full fetch. A request that finds fewer than min_bytes parks on the partitions' append
waiters (no polling) until data arrives or max_wait_ms passes. KIP-74: the first batch of the
first partition with data is returned even when larger than the limits (v3+).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import protocol
from protocol import ErrorCode

from ..cluster import follower as kip392
from ..partition import Partition, ReadResult, find_topic, find_topic_by_id, get_partition
from ..listeners import of_connection
from ..metrics import stats_of
from .registry import RequestContext, handler

log = logging.getLogger(__name__)

FETCH = 1
READ_COMMITTED = 1
NO_LIMIT = 2**31 - 1


async def _read_all(slots: list[tuple[Partition | None, int, int, int]], max_bytes: int,
                    hard_limit: bool, read_committed: bool) -> tuple[list[ReadResult], int]:
    """One pass over the requested partitions honouring the partition/response limits."""
    results: list[ReadResult] = []
    remaining = max_bytes
    min_one = not hard_limit
    total = 0
    for partition, offset, part_max, missing_error in slots:
        if partition is None:
            results.append(ReadResult(error=missing_error))
            continue
        limit = min(part_max, remaining)
        if limit <= 0 and not min_one:
            # response budget used up: report the partition's offsets, no data
            r = ReadResult(
                high_watermark=partition.high_watermark,
                last_stable_offset=partition.last_stable_offset,
                log_start_offset=partition.log_start_offset)
            results.append(r)
            continue
        r = await partition.read(offset, max(limit, 1), read_committed)
        if r.batches and not min_one:
            # only the very first batch of the response may exceed the limits (KIP-74)
            kept, size = [], 0
            for b in r.batches:
                if size + len(b.payload) > limit:
                    break
                kept.append(b)
                size += len(b.payload)
            r.batches = kept
        size = r.size
        if size:
            min_one = False
        remaining = max(0, remaining - size)
        total += size
        results.append(r)
    return results, total


@handler(FETCH)
async def handle_fetch(ctx: RequestContext, req: Any) -> Any:
    """Full fetch with long-poll; declines fetch sessions (session_id 0)."""
    version = ctx.version
    Resp = protocol.response_class(FETCH)
    TopicResp = Resp.FetchableTopicResponse
    PartResp = TopicResp.PartitionData
    AbortedTxn = PartResp.AbortedTransaction
    broker = ctx.broker

    read_committed = version >= 4 and getattr(req, "isolation_level", 0) == READ_COMMITTED
    max_bytes = req.max_bytes if version >= 3 and req.max_bytes is not None else NO_LIMIT
    if max_bytes <= 0:
        max_bytes = NO_LIMIT if version < 3 else max_bytes
    hard_limit = version <= 2

    session_id = getattr(req, "session_id", 0) or 0
    if version >= 7 and session_id != 0:
        return Resp(version=version, throttle_time_ms=0,
                    error_code=ErrorCode.FETCH_SESSION_ID_NOT_FOUND, session_id=0, responses=[])

    cluster = getattr(broker, "cluster", None)
    # KIP-392: a consumer that names its rack may be sent to, and served by, a broker of its
    # rack (broker/cluster/follower.py); never for read_committed
    rack = (getattr(req, "rack_id", None) or "") if version >= 11 and cluster is not None \
        and not read_committed else ""
    slots: list[tuple[Partition | None, int, int, int]] = []
    layout: list[tuple[Any, list[int]]] = []
    for ft in req.topics or []:
        if version >= 13:
            topic = find_topic_by_id(broker, ft.topic_id)
            missing = ErrorCode.UNKNOWN_TOPIC_ID
        else:
            topic = find_topic(broker, ft.topic)
            missing = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        idxs = []
        for fp in ft.partitions or []:
            part = get_partition(topic, fp.partition)
            err = missing
            if cluster is not None and topic is not None and \
                    0 <= fp.partition < len(topic.partitions):
                err = leader_error(cluster, topic, fp.partition,
                                   getattr(fp, "current_leader_epoch", -1), part)
                if rack:
                    part, err = await kip392.route(cluster, broker, topic, fp.partition, rack,
                                                   fp.fetch_offset, part, err)
                if err:
                    part = None
            slots.append((part, fp.fetch_offset, fp.partition_max_bytes, err))
            idxs.append(fp.partition)
        layout.append((ft, idxs, topic.name if topic is not None else None))

    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(req.max_wait_ms or 0, 0) / 1000
    min_bytes = max(req.min_bytes or 0, 0)
    partitions = [s[0] for s in slots if kip392.waits(s[0])]
    # KIP-392 redirects and follower reads answer at once
    no_wait = len(partitions) < sum(1 for s in slots if s[0] is not None)
    if not slots and min_bytes > 0:
        # an empty fetch waits like Kafka does, so a client loop over it does not spin
        await asyncio.sleep(max(0.0, deadline - loop.time()))
    while True:
        # register before reading so an append landing during the read is not missed
        waiter = loop.create_future()
        for p in partitions:
            p.new_waiter(waiter)
        try:
            results, total = await _read_all(slots, max_bytes, hard_limit, read_committed)
            remaining = deadline - loop.time()
            if (total >= min_bytes or remaining <= 0 or not partitions or no_wait
                    or any(r.error for r in results)
                    or any(p.closed for p in partitions)):
                break
            try:
                await asyncio.wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                pass
        finally:
            for p in partitions:
                p.remove_waiter(waiter)
            if not waiter.done():
                waiter.cancel()
    lease = getattr(cluster, "own_lease", None)
    if lease is not None and not lease.valid():
        # our cluster lease lapsed (paused, cut off): another broker may own our WAL and these
        # partitions by now, and what we hold may include appends it never saw - serve nothing
        results = [ReadResult(error=ErrorCode.NOT_LEADER_OR_FOLLOWER) for _ in results]

    responses = []
    leaders: set[int] = set()
    i = 0
    stats = stats_of(broker)
    for ft, idxs, tname in layout:
        parts = []
        nbytes = nrecords = 0
        for index in idxs:
            r = results[i]
            preferred = kip392.preferred_read_replica(slots[i][0], r) if rack else -1
            i += 1
            if r.batches:
                nbytes += r.size
                nrecords += sum(b.count for b in r.batches)
            elif r.error:
                stats.error(FETCH, version, int(r.error))
            # a list of stored payloads: the protocol's Fetch encoder sends them uncopied
            records = [b.payload for b in r.batches] if r.batches else b""
            extra = {}
            if r.error == ErrorCode.NOT_LEADER_OR_FOLLOWER and version >= 12 and \
                    cluster is not None:   # KIP-951: where to go instead
                topic = find_topic_by_id(broker, ft.topic_id) if version >= 13 \
                    else find_topic(broker, ft.topic)
                if topic is not None:
                    leader, epoch = cluster.leader(topic, index)
                    extra["current_leader"] = PartResp.LeaderIdAndEpoch(leader_id=leader,
                                                                        leader_epoch=epoch)
                    if leader >= 0:
                        leaders.add(leader)
            parts.append(PartResp(**extra,
                partition_index=index, error_code=int(r.error),
                high_watermark=r.high_watermark, last_stable_offset=r.last_stable_offset,
                log_start_offset=r.log_start_offset,
                aborted_transactions=(
                    [AbortedTxn(producer_id=pid, first_offset=first) for pid, first in r.aborted]
                    if r.aborted else []) if read_committed else None,
                preferred_read_replica=preferred, records=records))
        if nbytes:
            stats.fetched(tname, nbytes, nrecords)
        if version >= 13:
            responses.append(TopicResp(topic_id=ft.topic_id, partitions=parts))
        else:
            responses.append(TopicResp(topic=ft.topic, partitions=parts))
    extra_resp = {}
    if leaders and version >= 16:
        extra_resp["node_endpoints"] = [
            Resp.NodeEndpoint(node_id=n, host=ep[0], port=ep[1], rack=None)
            for n in sorted(leaders) if (ep := cluster.endpoint(n, of_connection(ctx))) is not None]
    return Resp(version=version, throttle_time_ms=0, error_code=0, session_id=0,
                responses=responses, **extra_resp)


def leader_error(cluster: Any, topic: Any, index: int, leader_epoch: int | None,
                 partition: Partition | None) -> int:
    """NOT_LEADER_OR_FOLLOWER when another broker leads the partition (or it is moving);
    FENCED_LEADER_EPOCH / UNKNOWN_LEADER_EPOCH when the client's epoch is older / newer than
    ours; 0 otherwise."""
    leader, epoch = cluster.leader(topic, index)
    if leader_epoch is not None and leader_epoch >= 0:
        if leader_epoch < epoch:
            return ErrorCode.FENCED_LEADER_EPOCH
        if leader_epoch > epoch:
            return ErrorCode.UNKNOWN_LEADER_EPOCH
    if partition is None:
        return ErrorCode.NOT_LEADER_OR_FOLLOWER
    return 0
