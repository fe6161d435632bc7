"""Produce (api key 0): append record batches to partitions, answer per acks.

acks=0 gets no response at all; acks=1 and acks=-1 (all; one replica here) are answered once
the append is durable in the WAL. Partitions of one request are appended concurrently (a
request for a single partition, the common case, is appended without an extra task). Each
append's first step (offsets, producer sequences) runs before the handler yields, so the
requests of one connection reach every partition in request order (idempotent producers
pipeline up to five).

The request's ``records`` are views into the request frame, which the server hands over as an
owned buffer: the partition writes offsets into it in place (no copy). The answer is encoded
directly (``protocol.produce_fast.encode_produce_response``), not through the generic codec;
a one-partition success - every path's common answer - is framed whole in one piece
(``frame_produce_ok``: the same bytes behind the response header, a ``Framed`` answer the
server writes as it is).

In a cluster a broker appends and acknowledges only while its own lease is valid
(broker/cluster/lease.py, monotonic clock): past it, nothing is appended and appends that
completed after it are not acknowledged; both answer NOT_LEADER_OR_FOLLOWER, which every Kafka
client retries after refreshing metadata (an idempotent producer keeps its sequence numbers,
so a retry of an append that did reach the WAL is answered as a duplicate at its offset).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Callable

import protocol
from protocol import ErrorCode, response_class
from protocol.produce_fast import encode_produce_response, frame_produce_ok

from ..eager import start_now
from ..partition import NO_PRODUCER_ID, TXN_ATTRS, AppendResult, find_topic, \
    find_topic_by_id, get_partition, topic_for_produce
from ..listeners import of_connection
from ..metrics import stats_of
from ..topics import INTERNAL_TOPICS, keyless_record_error
from ..transactions.verify import append_transactional
from .registry import Framed, RequestContext, handler, now_handler, run_handler

log = logging.getLogger(__name__)

PRODUCE = 0
LEASE_LAPSED = AppendResult(error=ErrorCode.NOT_LEADER_OR_FOLLOWER,
                            message="this broker's cluster lease lapsed; retry")
# a partition this broker is handing over: hold its produce until the hand-over is done, at
# most this long, instead of answering NOT_LEADER_OR_FOLLOWER at once
HANDOVER_HOLD_S = 2.0


async def _hand_over_done(broker: Any, topic: Any, index: int) -> None:
    """Wait until a release of this partition under way here is done. Answering
    NOT_LEADER_OR_FOLLOWER during the release sent clients into retry backoff (librdkafka
    doubles it on each retry: ~1 s after a 0.3 s release); answered after the hand-over it
    names the new leader (KIP-951). A held produce is never appended, even if the release
    failed and the partition reopened here: one that waited could otherwise be appended after
    a later batch of the same producer that found the partition open (pipelined idempotent
    batches out of order: a fatal OUT_OF_ORDER_SEQUENCE in librdkafka)."""
    settling = getattr(getattr(broker, "cluster", None), "settling", None)
    fut = settling(topic, index) if settling is not None else None
    if fut is None:
        return
    try:
        await asyncio.wait_for(asyncio.shield(fut), HANDOVER_HOLD_S)
    except asyncio.TimeoutError:
        pass


async def _append(topic: Any, index: int, records: Any, version: int,
                  tid: str | None = None, broker: Any = None) -> AppendResult:
    partition = get_partition(topic, index)
    if partition is None:
        if topic is None or not 0 <= index < len(topic.partitions):
            return AppendResult(error=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION)
        refused_here = getattr(getattr(broker, "cluster", None), "refused_here", None)
        if refused_here is not None:    # opened or reopened here next: failed marks there
            refused_here(topic, index, records)
        await _hand_over_done(broker, topic, index)
        return AppendResult(error=ErrorCode.NOT_LEADER_OR_FOLLOWER)  # led elsewhere
    keyless = keyless_record_error(topic, index, records)   # compacted topics only
    if keyless is not None:
        return AppendResult(error=ErrorCode.INVALID_RECORD, message=keyless)
    # a writable view is the server's request frame: the partition may write into it
    owned = isinstance(records, memoryview) and not records.readonly
    try:
        if tid:   # a transactional producer: its coordinator may have to be asked first
            return await append_transactional(
                broker, partition, tid, records, version,
                lambda: partition.append(records, version, owned=owned),
                lambda err: AppendResult(error=err, message="not in an ongoing transaction"))
        return await partition.append(records, version, owned=owned)
    except Exception:  # noqa: BLE001 - malformed input must not kill the connection
        log.exception("produce failed topic=%s partition=%d", partition.topic, index)
        return AppendResult(error=ErrorCode.CORRUPT_MESSAGE, message="invalid record batch")


@handler(PRODUCE)
async def handle_produce(ctx: RequestContext, req: Any) -> Any:
    """Append every partition's records; the encoded body, or None (no response) for acks=0."""
    version = ctx.version
    acks = req.acks
    tid = getattr(req, "transactional_id", None) if version >= 3 else None
    refused: AppendResult | None = None
    if acks not in (-1, 0, 1):
        refused = AppendResult(error=ErrorCode.INVALID_REQUIRED_ACKS)
    cluster = getattr(ctx.broker, "cluster", None)
    lease = cluster.own_lease if cluster is not None else None
    if refused is None and lease is not None and not lease.valid():
        refused = LEASE_LAPSED      # append nothing while another broker may take our WAL

    # (topic key for the answer, [(partition index, result or pending append)])
    plan: list[tuple[Any, list[tuple[int, Any]]]] = []
    pending = 0
    for td in req.topic_data or []:
        if version >= 13:
            topic = find_topic_by_id(ctx.broker, td.topic_id)
            unknown = ErrorCode.UNKNOWN_TOPIC_ID
            key = td.topic_id
        else:
            topic = await topic_for_produce(ctx.broker, td.name)
            unknown = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
            key = td.name
        if getattr(topic, "is_internal", False) or (version < 13 and td.name in INTERNAL_TOPICS):
            # clients never write Kafka's internal topics (nor auto-create them)
            topic, unknown = None, ErrorCode.INVALID_TOPIC
        jobs: list[tuple[int, Any]] = []
        for pd in td.partition_data or []:
            if refused is not None:
                if refused is LEASE_LAPSED and topic is not None and pd.records:
                    partition = get_partition(topic, pd.index)
                    if partition is not None:
                        partition.refused(pd.records)   # failed marks (Partition.refused)
                    elif hasattr(cluster, "refused_here"):  # opened or reopened here next
                        cluster.refused_here(topic, pd.index, pd.records)
                jobs.append((pd.index, refused))
            elif topic is None:
                jobs.append((pd.index, AppendResult(error=unknown)))
            else:
                jobs.append((pd.index, (topic, pd.records)))
                pending += 1
        plan.append((key, jobs))

    if pending == 1:  # one partition: append in this task
        for _, jobs in plan:
            for i, (index, job) in enumerate(jobs):
                if isinstance(job, tuple):
                    jobs[i] = (index, await _append(job[0], index, job[1], version, tid,
                                                    ctx.broker))
    elif pending > 1:  # several: concurrently, answered in request order
        for _, jobs in plan:
            for i, (index, job) in enumerate(jobs):
                if isinstance(job, tuple):
                    jobs[i] = (index, start_now(_append(job[0], index, job[1], version,
                                                                tid, ctx.broker)))
        for _, jobs in plan:
            for i, (index, job) in enumerate(jobs):
                if isinstance(job, asyncio.Future):
                    jobs[i] = (index, await job)

    if lease is not None and pending and not lease.valid() \
            and not await lease.wait_valid(_renewal_wait_s(req, lease)):
        # the lease ended while appending and was not renewed in time: acknowledge nothing.
        # (Valid again means no controller can have fenced this node yet, so the appends were
        # in its WAL before any takeover: they are acknowledged, with their offsets. An
        # error for an appended batch makes librdkafka acknowledge it without an offset once
        # a later batch of the producer succeeds.)
        _withhold(plan, lease, req, ctx.broker, version)
    stats = stats_of(ctx.broker)
    if acks == 0:
        for _, jobs in plan:
            for _, r in jobs:
                if r.error:
                    stats.error(PRODUCE, version, int(r.error))
        return None
    if len(plan) == 1 and len(plan[0][1]) == 1 and not plan[0][1][0][1].error:
        # one partition appended (the common request): its answer framed whole in one piece,
        # as the task-less path frames it (the same bytes as the body below behind its header;
        # no per-field encoding here, no header encoding in the server's flush)
        key, ((index, r),) = plan[0]
        return Framed((frame_produce_ok(version, ctx.header.correlation_id, key, index,
                                        r.base_offset, r.log_append_time,
                                        r.log_start_offset),))
    topics = []
    for key, jobs in plan:
        parts = []
        for index, r in jobs:
            if r.error:
                stats.error(PRODUCE, version, int(r.error))
                parts.append((index, int(r.error), -1, r.log_append_time, r.log_start_offset,
                              r.message))
            else:
                parts.append((index, 0, r.base_offset, r.log_append_time, r.log_start_offset,
                              None))
        topics.append((key, parts))
    if version >= 10 and any(part[1] == ErrorCode.NOT_LEADER_OR_FOLLOWER
                             for _, parts in topics for part in parts):
        moved = _with_current_leaders(ctx, version, topics)
        if moved is not None:
            return moved
    return encode_produce_response(version, topics)  # bytes: framed as it is


def _with_current_leaders(ctx: RequestContext, version: int,
                          topics: list[tuple[Any, list]]) -> Any:
    """KIP-951 (v10+): partitions answered NOT_LEADER_OR_FOLLOWER carry ``current_leader``
    and the response the leaders' ``node_endpoints``, so the producer goes straight to the new
    leader without a Metadata round trip. Rare (a partition moved), so the generic codec."""
    broker = ctx.broker
    cluster = getattr(broker, "cluster", None)
    if cluster is None:
        return None
    Resp = response_class(PRODUCE)
    TopicResp = Resp.TopicProduceResponse
    PartResp = TopicResp.PartitionProduceResponse
    leaders: set[int] = set()
    out = []
    for key, parts in topics:
        topic = find_topic_by_id(broker, key) if version >= 13 else find_topic(broker, key)
        presp = []
        for index, error, base, append_time, start, message in parts:
            extra = {}
            if error == ErrorCode.NOT_LEADER_OR_FOLLOWER and topic is not None:
                leader, epoch = cluster.leader(topic, index)
                extra["current_leader"] = PartResp.LeaderIdAndEpoch(leader_id=leader,
                                                                    leader_epoch=epoch)
                if leader >= 0:
                    leaders.add(leader)
            presp.append(PartResp(index=index, error_code=error, base_offset=base,
                                  log_append_time_ms=append_time, log_start_offset=start,
                                  record_errors=[], error_message=message, **extra))
        if version >= 13:
            out.append(TopicResp(topic_id=key, partition_responses=presp))
        else:
            out.append(TopicResp(name=key, partition_responses=presp))
    endpoints = [Resp.NodeEndpoint(node_id=n, host=ep[0], port=ep[1],
                                   rack=getattr(cluster.live.get(n), "rack", None) or None)
                 for n in sorted(leaders) if (ep := cluster.endpoint(n, of_connection(ctx))) is not None]
    return Resp(version=version, responses=out, throttle_time_ms=0, node_endpoints=endpoints)


def _renewal_wait_s(req: Any, lease: Any) -> float:
    """How long appended batches wait for a lapsed lease to be renewed before their answer
    is withheld: half the request's own timeout (the client's clock runs too). They are in
    the WAL: a renewal means nobody fenced this node (acknowledged with their offsets); a
    fence ends this process (the client retries elsewhere, the taker has them). Waiting only
    a lease withheld batches when a database outage outlasted it (the chaos suite's 3 s
    PostgreSQL cut): NOT_LEADER_OR_FOLLOWER for a stored batch while the producer's next
    pipelined batch succeeded after the renewal, which librdkafka acknowledges implicitly,
    without an offset."""
    timeout_ms = getattr(req, "timeout_ms", None)
    return max(0.0, (30000 if timeout_ms is None else timeout_ms) / 2000)


def _withhold(plan: list[tuple[Any, list[tuple[int, Any]]]], lease: Any, req: Any,
              broker: Any, version: int) -> None:
    """Replace every successful result by LEASE_LAPSED (the client retries). The withheld
    batches are stored: their idempotent ones leave failed marks (``Partition.refused``), or
    a successor of the producer answered with its offset after the renewal would make
    librdkafka acknowledge them implicitly, without an offset (a single broker whose
    metadata lease lapsed for longer than the wait under heavy load, session 22)."""
    for td, (_, jobs) in zip(req.topic_data or [], plan):
        topic = find_topic_by_id(broker, td.topic_id) if version >= 13 \
            else find_topic(broker, td.name)
        for i, ((index, r), pd) in enumerate(zip(jobs, td.partition_data or [])):
            if not r.error:
                jobs[i] = (index, LEASE_LAPSED)
                lease.withhold()
                partition = get_partition(topic, index)
                if partition is not None and pd.records:
                    partition.refused(pd.records)


# -- runs of pipelined requests ------------------------------------------------------------
# Errors partition.append returns before anything is appended that depend on one request's
# own batches: a run answered with one of them is appended again request by request, so only
# the request at fault gets it.
_OWN_FAULTS = frozenset((ErrorCode.CORRUPT_MESSAGE, ErrorCode.MESSAGE_SIZE_TOO_LARGE,
                         ErrorCode.UNSUPPORTED_COMPRESSION_TYPE, ErrorCode.INVALID_RECORD,
                         ErrorCode.INVALID_TIMESTAMP))
# only requests this small join a run (a copy into the run's buffer; large ones gain nothing;
# with the server's RUN_MAX_REQUESTS a run's payload stays under 512 KiB)
RUN_MAX_RECORDS_BYTES = 16 << 10
# a larger request is still appended without a task, alone: a linger-0 client's request after
# a stall carries the backlog, and a large request (1 MiB batches: received into a pooled frame
# of its own, its one batch's CRC checked in the WAL's copy) saves the task, the timing
# wrapper, four coroutines, Drive and two shield futures. Up to the server's DIRECT_FRAME_MAX
LONE_MAX_RECORDS_BYTES = 16 << 20
_PRODUCER_ID = 43          # offset of producerId in a v2 batch header
_NO_PID = b"\xff" * 8


def run_key(req: Any) -> Any:
    """Which run a decoded Produce request may join (None: handled on its own): one topic,
    one partition, acks 1 or all, not transactional, a small v2 payload whose first batch has
    no producer id. The run handler checks every batch again. A payload over
    RUN_MAX_RECORDS_BYTES (up to LONE_MAX_RECORDS_BYTES) gets a key of its own: a run of one,
    which only the task-less path (``produce_now``) takes (so does the server for a request
    received into a pooled frame, whatever its key)."""
    if getattr(req, "plain", False):
        # the C envelope scan checked the shape already (FastProduceRequest.plain): the
        # records' size is left
        td = req.topic_data[0]
        pd = td.partition_data[0]
        n = len(pd.records)
        if n > LONE_MAX_RECORDS_BYTES:
            return None
    else:
        if req.acks not in (-1, 1) or req.transactional_id is not None:
            return None
        tds = req.topic_data
        if len(tds) != 1 or len(tds[0].partition_data) != 1:
            return None
        td = tds[0]
        pd = td.partition_data[0]
        records = pd.records
        if records is None or not 61 <= len(records) <= LONE_MAX_RECORDS_BYTES \
                or records[16] != 2 or records[_PRODUCER_ID:_PRODUCER_ID + 8] != _NO_PID:
            return None
        n = len(records)
    key = (td.name if td.topic_id is None else td.topic_id, pd.index, req.acks)
    if n > RUN_MAX_RECORDS_BYTES:
        return (key, object())     # equal to no other key: a run of its own (no merge copy)
    return key


@run_handler(PRODUCE, run_key)
async def handle_produce_run(ctxs: list[RequestContext], reqs: list[Any]) -> list[Any]:
    """Consecutive Produce requests of one connection for the same partition (``run_key``),
    which the server found in one read: a client pipelining small linger-0 requests faster
    than they are answered. Appended as one payload (one validation pass, one stream append,
    one WAL record), each answered with its own offsets, as if appended one after the other
    (which they would have been: same partition, in order, nothing in between). Falls back
    to one request at a time for anything but plain batches of a partition led here."""
    broker = ctxs[0].broker
    td = reqs[0].topic_data[0]
    index = td.partition_data[0].index
    cluster = getattr(broker, "cluster", None)
    lease = cluster.own_lease if cluster is not None else None
    topic = find_topic_by_id(broker, td.topic_id) if td.topic_id is not None \
        else find_topic(broker, td.name)
    partition = get_partition(topic, index)
    if partition is None or getattr(topic, "is_internal", False) or td.name in INTERNAL_TOPICS \
            or "compact" in (getattr(topic, "configs", None) or {}).get("cleanup.policy", "") \
            or (lease is not None and not lease.valid()):
        return await _one_by_one(ctxs, reqs)
    counts = []
    total = 0
    try:
        for req in reqs:
            records = req.topic_data[0].partition_data[0].records
            n = 0
            for view in protocol.iter_batches(records):
                if view.producer_id != NO_PRODUCER_ID or view.attributes & TXN_ATTRS:
                    return await _one_by_one(ctxs, reqs)
                n += view.last_offset_delta + 1
            counts.append(n)
            total += len(records)
    except protocol.CorruptRecordError:
        return await _one_by_one(ctxs, reqs)
    merged = bytearray(total)
    pos = 0
    for req in reqs:
        records = req.topic_data[0].partition_data[0].records
        merged[pos:pos + len(records)] = records
        pos += len(records)
    version = min(ctx.version for ctx in ctxs)
    try:
        r = await partition.append(memoryview(merged), version, owned=True)
    except Exception:  # noqa: BLE001 - as _append: bad input must not kill the connection
        log.exception("produce failed topic=%s partition=%d", partition.topic, index)
        return await _one_by_one(ctxs, reqs)
    if r.error in _OWN_FAULTS:         # nothing appended: find the request at fault
        return await _one_by_one(ctxs, reqs)
    if not r.error and lease is not None and not lease.valid() \
            and not await lease.wait_valid(_renewal_wait_s(reqs[0], lease)):
        r = LEASE_LAPSED               # as handle_produce: acknowledge nothing
        for _ in reqs:
            lease.withhold()
    return _run_answers(broker, ctxs, counts, td, index, r)


def _run_answers(broker: Any, ctxs: list[RequestContext], counts: list[int], td: Any,
                 index: int, r: AppendResult) -> list[Any]:
    """The answer of each request of a run appended as one payload (``r``): its own base
    offset (the run's, plus the records of the requests before it), or the run's error."""
    stats = stats_of(broker)
    key = td.name if td.topic_id is None else td.topic_id
    out = []
    base = r.base_offset
    for ctx, n in zip(ctxs, counts):
        out.append(_run_answer(stats, ctx, key, index, r, base))
        base += n
    return out


def _run_answer(stats: Any, ctx: RequestContext, key: Any, index: int, r: AppendResult,
                base: int) -> Any:
    """One request's answer (``_run_answers``): offsets from ``base``, or the run's error
    (counted; NOT_LEADER_OR_FOLLOWER with the current leader from v10)."""
    if not r.error:     # framed whole, as the task-less path answers (the same bytes)
        return Framed((frame_produce_ok(ctx.version, ctx.header.correlation_id, key, index,
                                        base, r.log_append_time, r.log_start_offset),))
    stats.error(PRODUCE, ctx.version, int(r.error))
    part = (index, int(r.error), -1, r.log_append_time, r.log_start_offset, r.message)
    if r.error == ErrorCode.NOT_LEADER_OR_FOLLOWER and ctx.version >= 10:
        moved = _with_current_leaders(ctx, ctx.version, [(key, [part])])
        if moved is not None:
            return moved
    return encode_produce_response(ctx.version, [(key, [part])])


async def _one_by_one(ctxs: list[RequestContext], reqs: list[Any]) -> list[Any]:
    """The requests of a run handled as if they had come alone: each one's first step (its
    offsets) runs in request order, then all are awaited."""
    futs = [start_now(handle_produce(ctx, req)) for ctx, req in zip(ctxs, reqs)]
    return [await f for f in futs]


@now_handler(PRODUCE)
def produce_now(items: list[tuple[RequestContext, Any, float]], futs: list[asyncio.Future],
                conn: Any) -> bool:
    """Requests of ``run_key`` (one alone, or a run read together) appended without a task:
    ``Partition.append_now`` takes the payload in this call and its completion callback
    answers each request (``futs``, in order; then ``conn.answered()``). A lone small linger-0
    request otherwise cost a task, the timing wrapper, four coroutines, the Drive wrapper and
    two shield futures. False, with nothing done, for anything ``append_now`` leaves to the
    usual path (the run handler, or ``handle_produce`` for one request)."""
    ctx0, req0, _received = items[0]
    broker = ctx0.broker
    cluster = getattr(broker, "cluster", None)
    lease = cluster.own_lease if cluster is not None else None
    if lease is not None and not lease.valid():
        return False
    td = req0.topic_data[0]
    index = td.partition_data[0].index
    topic = find_topic_by_id(broker, td.topic_id) if td.topic_id is not None \
        else find_topic(broker, td.name)
    partition = get_partition(topic, index)
    if partition is None or getattr(topic, "is_internal", False) or td.name in INTERNAL_TOPICS \
            or "compact" in (getattr(topic, "configs", None) or {}).get("cleanup.policy", ""):
        return False
    if len(items) == 1:
        records = td.partition_data[0].records
        if not isinstance(records, memoryview) or records.readonly:
            return False
        counts = [0]                    # the run's answer needs no per-request count
        version = ctx0.header.api_version
    else:
        parts = [req.topic_data[0].partition_data[0].records for _ctx, req, _r in items]
        try:
            counts = list(map(protocol.count_offsets, parts))
        except protocol.CorruptRecordError:
            return False
        records = memoryview(bytearray().join(parts))   # one copy, no zero fill first
        version = min([ctx.header.api_version for ctx, _req, _r in items])
    # Partition.append_now calls it with the result (in the WAL's completion of the write)
    return partition.append_now(records, version, functools.partial(
        _answer_now, items, futs, conn, lease, counts, td, index, time.perf_counter()))


def _answer_now(items: list[tuple[RequestContext, Any, float]], futs: list[asyncio.Future],
                conn: Any, lease: Any, counts: list[int], td: Any, index: int, start: float,
                r: AppendResult) -> None:
    """produce_now's completion: each request's future gets its answer (framed whole by
    ``frame_produce_ok`` when appended, ``_run_answer`` for an error), in order, then
    ``conn.answered()``. A run refused for one request's own fault is appended again one
    request at a time, and an append that outlived the lease waits for its renewal: both
    in a task (``_settle_later``)."""
    ctx0, req0, _received = items[0]
    broker = ctx0.broker
    if r.error:
        if r.error in _OWN_FAULTS and len(items) > 1:
            # nothing appended: find the request at fault, one at a time (later requests
            # of the connection wait for this task: conn.track_slow)
            _settle_later(_one_by_one([it[0] for it in items], [it[1] for it in items]),
                          futs, conn)
            return
    elif lease is not None and not lease.valid():
        _settle_later(_after_renewal(broker, [it[0] for it in items], counts, td, index, r,
                                     req0, lease), futs, conn)
        return
    stats = broker.request_stats
    stats.direct_requests += len(items)
    if len(items) > 1:
        stats.runs += 1
        stats.run_requests += len(items)
    end = time.perf_counter()
    key = td.name if td.topic_id is None else td.topic_id
    ok = not r.error
    base = r.base_offset
    append_time, log_start = r.log_append_time, r.log_start_offset
    observe = stats.observe
    for (ctx, _req, received), fut, n in zip(items, futs, counts):
        h = ctx.header
        observe(PRODUCE, h.api_version, start - received, end - start)
        if not fut.done():
            try:
                # appended: framed whole in one piece (what the server writes as it is)
                fut.set_result(Framed((frame_produce_ok(
                    h.api_version, h.correlation_id, key, index, base, append_time,
                    log_start),)) if ok else _run_answer(stats, ctx, key, index, r, base))
            except Exception as exc:  # noqa: BLE001 - it still gets an answer
                fut.set_exception(exc)
        base += n
    conn.answered()


async def _after_renewal(broker: Any, ctxs: list[RequestContext], counts: list[int], td: Any,
                         index: int, r: AppendResult, req: Any, lease: Any) -> list[Any]:
    """As handle_produce: appended while the lease lapsed, acknowledged only if renewed."""
    if not await lease.wait_valid(_renewal_wait_s(req, lease)):
        r = LEASE_LAPSED
        for _ in ctxs:
            lease.withhold()
    return _run_answers(broker, ctxs, counts, td, index, r)


def _settle_later(coro: Any, futs: list[asyncio.Future], conn: Any) -> None:
    """Run ``coro`` (a list of answers) as a task and resolve ``futs`` with its answers."""
    task = asyncio.ensure_future(coro)
    conn.track_slow(task)

    def settle(t: asyncio.Task) -> None:
        exc = None if t.cancelled() else t.exception()
        for i, fut in enumerate(futs):
            if fut.done():
                continue
            if t.cancelled():
                fut.cancel()
            elif exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(t.result()[i])
        conn.answered()

    task.add_done_callback(settle)
