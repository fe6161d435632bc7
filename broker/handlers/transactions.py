"""Transaction APIs: AddPartitionsToTxn (24), AddOffsetsToTxn (25), EndTxn (26),
WriteTxnMarkers (27), TxnOffsetCommit (28), DescribeTransactions (65), ListTransactions (66).

They translate between the wire objects and the transaction coordinator
(``broker/transactions/``), where every rule lives. AddPartitionsToTxn v4+ is the batched
form of KIP-890 part 1 (several transactional ids, ``verify_only`` to check membership; a
partition leader on another broker sends it too). EndTxn v5+ is KIP-890 part 2 (the epoch is
bumped). WriteTxnMarkers comes from a coordinator on another broker (or Admin's
abortTransaction). TxnOffsetCommit reaches the group's coordinator, which forwards it to the
transaction's coordinator when that is another broker.
"""
from __future__ import annotations

import logging
from typing import Any

import protocol
from protocol import ErrorCode as E

from ..failures import note
from ..partition import find_topic, get_partition
from ..transactions import ensure_transactions
from ..transactions.coordinator import OFFSETS_TOPIC, WRITE_TXN_MARKERS
from ..transactions.peers import CLIENT_ID as PEER_CLIENT_ID
from ..transactions.peers import PeerError
from ..transactions.placement import group_coordinator, transaction_coordinator
from ..transactions.store import STATES
from .registry import RequestContext, handler

log = logging.getLogger(__name__)

ADD_PARTITIONS_TO_TXN, ADD_OFFSETS_TO_TXN, END_TXN, TXN_OFFSET_COMMIT = 24, 25, 26, 28
DESCRIBE_TRANSACTIONS, LIST_TRANSACTIONS = 65, 66


def _exists(ctx: RequestContext) -> Any:
    """A partition of a topic this broker knows (led here or by another broker)."""
    def exists(topic: str, index: int) -> bool:
        t = find_topic(ctx.broker, topic)
        return t is not None and 0 <= index < len(getattr(t, "partitions", ()))
    return exists


def _topic_results(Resp: Any, errors: dict[tuple[str, int], int], order: list[Any]) -> list[Any]:
    TopicRes = Resp.AddPartitionsToTxnTopicResult
    PartRes = TopicRes.AddPartitionsToTxnPartitionResult
    out = []
    for t in order:
        out.append(TopicRes(name=t.name, results_by_partition=[
            PartRes(partition_index=p, partition_error_code=int(errors[(t.name, p)]))
            for p in t.partitions or []]))
    return out


@handler(ADD_PARTITIONS_TO_TXN)
async def add_partitions_to_txn(ctx: RequestContext, req: Any) -> Any:
    Resp = protocol.response_class(ADD_PARTITIONS_TO_TXN)
    coord = await ensure_transactions(ctx.broker)
    if ctx.version <= 3:
        topics = req.v3_and_below_topics or []
        tps = [(t.name, p) for t in topics for p in t.partitions or []]
        errors = await coord.add_partitions(req.v3_and_below_transactional_id or "",
                                            req.v3_and_below_producer_id,
                                            req.v3_and_below_producer_epoch, tps, _exists(ctx))
        return Resp(version=ctx.version, throttle_time_ms=0,
                    results_by_topic_v3_and_below=_topic_results(Resp, errors, topics))
    results = []
    for txn in req.transactions or []:
        topics = txn.topics or []
        tps = [(t.name, p) for t in topics for p in t.partitions or []]
        if txn.verify_only:
            errors = await coord.verify_partitions(txn.transactional_id or "",
                                                   txn.producer_id, txn.producer_epoch, tps)
        else:
            errors = await coord.add_partitions(txn.transactional_id or "", txn.producer_id,
                                                txn.producer_epoch, tps, _exists(ctx))
        results.append(Resp.AddPartitionsToTxnResult(
            transactional_id=txn.transactional_id,
            topic_results=_topic_results(Resp, errors, topics)))
    return Resp(version=ctx.version, throttle_time_ms=0, error_code=0,
                results_by_transaction=results)


@handler(ADD_OFFSETS_TO_TXN)
async def add_offsets_to_txn(ctx: RequestContext, req: Any) -> Any:
    Resp = protocol.response_class(ADD_OFFSETS_TO_TXN)
    coord = await ensure_transactions(ctx.broker)
    if not req.group_id:
        err = E.INVALID_GROUP_ID
    else:
        err = await coord.add_offsets(req.transactional_id or "", req.producer_id,
                                      req.producer_epoch, req.group_id)
    return Resp(version=ctx.version, throttle_time_ms=0, error_code=int(err))


@handler(END_TXN)
async def end_txn(ctx: RequestContext, req: Any) -> Any:
    Resp = protocol.response_class(END_TXN)
    coord = await ensure_transactions(ctx.broker)
    tid = req.transactional_id or ""
    err = await coord.end_txn(tid, req.producer_id, req.producer_epoch, bool(req.committed),
                              bump=ctx.version >= 5)
    meta = coord.describe(tid) if ctx.version >= 5 else None
    return Resp(version=ctx.version, throttle_time_ms=0, error_code=int(err),
                producer_id=meta.producer_id if meta else -1,
                producer_epoch=meta.epoch if meta else -1)


@handler(TXN_OFFSET_COMMIT)
async def txn_offset_commit(ctx: RequestContext, req: Any) -> Any:
    Resp = protocol.response_class(TXN_OFFSET_COMMIT)
    TopicRes = Resp.TxnOffsetCommitResponseTopic
    PartRes = TopicRes.TxnOffsetCommitResponsePartition
    coord = await ensure_transactions(ctx.broker)
    exists = _exists(ctx)
    offsets = []
    per: dict[tuple[str, int], int] = {}
    for t in req.topics or []:
        for p in t.partitions or []:
            if not exists(t.name, p.partition_index):
                per[(t.name, p.partition_index)] = E.UNKNOWN_TOPIC_OR_PARTITION
                continue
            md = p.committed_metadata
            if md is not None and len(md.encode()) > 4096:
                per[(t.name, p.partition_index)] = E.OFFSET_METADATA_TOO_LARGE
                continue
            offsets.append((t.name, p.partition_index, p.committed_offset,
                            getattr(p, "committed_leader_epoch", -1), md))
    err = E.NONE
    if not req.group_id:
        err = E.INVALID_GROUP_ID
    elif offsets and not _forwarded(ctx) and not _coordinates_group(ctx, req.group_id):
        err = E.NOT_COORDINATOR    # the client looks the group's coordinator up again
    elif offsets:
        err = _check_member(ctx, req)
        tid = req.transactional_id or ""
        if err == E.NONE and coord.owns(tid):
            err = await coord.txn_offset_commit(tid, req.group_id, req.producer_id,
                                                req.producer_epoch, offsets,
                                                implicit=ctx.version >= 5)
        elif err == E.NONE:
            err = await _forward_offsets(ctx, coord, req, tid)
    topics = []
    for t in req.topics or []:
        topics.append(TopicRes(name=t.name, partitions=[
            PartRes(partition_index=p.partition_index,
                    error_code=int(per.get((t.name, p.partition_index), err)))
            for p in t.partitions or []]))
    return Resp(version=ctx.version, throttle_time_ms=0, topics=topics)


def _forwarded(ctx: RequestContext) -> bool:
    """Sent by a group coordinator on another broker (it checked the member there)."""
    return getattr(ctx.header, "client_id", None) == PEER_CLIENT_ID


def _coordinates_group(ctx: RequestContext, group_id: str) -> bool:
    node = int(getattr(getattr(ctx.broker, "config", None), "node_id", 0))
    return group_coordinator(ctx.broker, group_id) == node


async def _forward_offsets(ctx: RequestContext, coord: Any, req: Any, tid: str) -> int:
    """The transaction is coordinated by another broker: hand it the (checked) offsets there."""
    node = transaction_coordinator(ctx.broker, tid)
    if node < 0:
        return E.COORDINATOR_NOT_AVAILABLE
    Req = protocol.request_class(TXN_OFFSET_COMMIT)
    T = Req.TxnOffsetCommitRequestTopic
    P = T.TxnOffsetCommitRequestPartition
    version = ctx.version
    fields: dict[str, Any] = {}
    if version >= 3:   # the member was checked here, where the group lives
        fields = {"generation_id": -1, "member_id": "", "group_instance_id": None}
    fwd = Req(transactional_id=tid, group_id=req.group_id, producer_id=req.producer_id,
              producer_epoch=req.producer_epoch, topics=[
                  T(name=t.name, partitions=[
                      P(partition_index=p.partition_index, committed_offset=p.committed_offset,
                        committed_leader_epoch=getattr(p, "committed_leader_epoch", -1),
                        committed_metadata=p.committed_metadata) for p in t.partitions or []])
                  for t in req.topics or []], **fields)
    try:
        resp = await coord.peers.call(node, TXN_OFFSET_COMMIT, version, fwd)
    except PeerError as e:
        log.warning("TxnOffsetCommit not forwarded to node %d: %s", node, e)
        return E.COORDINATOR_NOT_AVAILABLE
    codes = [p.error_code for t in resp.topics or [] for p in t.partitions or []]
    return next((c for c in codes if c), E.NONE)


@handler(WRITE_TXN_MARKERS)
async def write_txn_markers(ctx: RequestContext, req: Any) -> Any:
    """Markers from a transaction coordinator on another broker (or Admin's abortTransaction)
    for partitions led here; a marker for ``__consumer_offsets`` commits the transaction's
    offsets of the groups coordinated here."""
    Resp = protocol.response_class(WRITE_TXN_MARKERS)
    R = Resp.WritableTxnMarkerResult
    TR = R.WritableTxnMarkerTopicResult
    PR = TR.WritableTxnMarkerPartitionResult
    coord = await ensure_transactions(ctx.broker)
    # a transaction coordinator of this cluster (not Admin's abortTransaction): its markers
    # carry a per-transaction number, so a late copy is recognised (Partition.write_marker)
    from_coordinator = ctx.header.client_id == PEER_CLIENT_ID
    out = []
    for m in req.markers or []:
        commit = bool(m.transaction_result)
        topics = []
        for t in m.topics or []:
            results = []
            for index in t.partition_indexes or []:
                if t.name == OFFSETS_TOPIC:
                    try:
                        err = await coord.commit_offsets_of(m.producer_id, m.producer_epoch,
                                                            commit)
                    except Exception as exc:  # noqa: BLE001 - the coordinator retries
                        note(exc, f"transactional offsets of producer_id={m.producer_id}")
                        err = E.COORDINATOR_NOT_AVAILABLE
                else:
                    partition = get_partition(find_topic(ctx.broker, t.name), index)
                    if partition is None:
                        err = E.NOT_LEADER_OR_FOLLOWER if _exists(ctx)(t.name, index) \
                            else E.UNKNOWN_TOPIC_OR_PARTITION
                    else:
                        err = await partition.write_marker(
                            m.producer_id, m.producer_epoch, commit, m.coordinator_epoch,
                            from_coordinator=from_coordinator)
                results.append(PR(partition_index=index, error_code=int(err)))
            topics.append(TR(name=t.name, partitions=results))
        out.append(R(producer_id=m.producer_id, topics=topics))
    return Resp(version=ctx.version, markers=out)


def _check_member(ctx: RequestContext, req: Any) -> int:
    """v3+ carries the consumer's generation and member id (KIP-447): a zombie consumer's
    offsets are refused like an OffsetCommit's."""
    generation = getattr(req, "generation_id", -1)
    if ctx.version < 3 or generation is None or generation < 0:
        return E.NONE
    groups = getattr(ctx.broker, "groups", None)
    group = groups.groups.get(req.group_id) if groups is not None else None
    if group is None:
        return E.NONE
    return int(groups._validate_commit(group, generation, req.member_id or "",
                                       req.group_instance_id))


@handler(DESCRIBE_TRANSACTIONS)
async def describe_transactions(ctx: RequestContext, req: Any) -> Any:
    Resp = protocol.response_class(DESCRIBE_TRANSACTIONS)
    State = Resp.TransactionState
    coord = await ensure_transactions(ctx.broker)
    out = []
    for tid in req.transactional_ids or []:
        meta = coord.describe(tid)
        if meta is None:
            out.append(State(error_code=E.TRANSACTIONAL_ID_NOT_FOUND, transactional_id=tid,
                             transaction_state="", transaction_timeout_ms=0,
                             transaction_start_time_ms=-1, producer_id=-1, producer_epoch=-1,
                             topics=[]))
            continue
        by_topic: dict[str, list[int]] = {}
        for t, p in sorted(meta.partitions):
            by_topic.setdefault(t, []).append(p)
        out.append(State(error_code=0, transactional_id=tid, transaction_state=meta.state,
                         transaction_timeout_ms=meta.timeout_ms,
                         transaction_start_time_ms=meta.start_ms, producer_id=meta.producer_id,
                         producer_epoch=meta.epoch,
                         topics=[State.TopicData(topic=t, partitions=ps)
                                 for t, ps in by_topic.items()]))
    return Resp(version=ctx.version, throttle_time_ms=0, transaction_states=out)


@handler(LIST_TRANSACTIONS)
async def list_transactions(ctx: RequestContext, req: Any) -> Any:
    Resp = protocol.response_class(LIST_TRANSACTIONS)
    State = Resp.TransactionState
    coord = await ensure_transactions(ctx.broker)
    filters = list(req.state_filters or [])
    unknown = [s for s in filters if s not in STATES]
    pattern = getattr(req, "transactional_id_pattern", None) if ctx.version >= 2 else None
    matcher = None
    if pattern:
        import re  # noqa: PLC0415

        try:
            matcher = re.compile(pattern)
        except re.error:
            return Resp(version=ctx.version, throttle_time_ms=0, error_code=E.INVALID_REQUEST,
                        unknown_state_filters=[], transaction_states=[])
    duration = getattr(req, "duration_filter", -1) if ctx.version >= 1 else -1
    metas = coord.list([s for s in filters if s in STATES], list(req.producer_id_filters or []),
                       -1 if duration is None else duration)
    if filters and not [s for s in filters if s in STATES]:
        metas = []
    states = [State(transactional_id=m.transactional_id, producer_id=m.producer_id,
                    transaction_state=m.state)
              for m in sorted(metas, key=lambda m: m.transactional_id)
              if matcher is None or matcher.fullmatch(m.transactional_id)]
    return Resp(version=ctx.version, throttle_time_ms=0, error_code=0,
                unknown_state_filters=unknown, transaction_states=states)
