"""Before a transactional Produce is appended: ask the transaction's coordinator (KIP-890).

The partition accepts a transactional batch only if the producer's transaction is Ongoing
with this partition in it (``Partition._verify_txn``, synchronous). That check needs the
coordinator's answer first when
- the client uses Produce v12+ (KIP-890 part 2, Kafka 4.x clients with ``transaction.version``
  2): it sends no AddPartitionsToTxn, the produce adds the partition implicitly, or
- the transactional id is coordinated by another broker: that broker is asked
  (AddPartitionsToTxn v4+, ``verify_only`` below Produce v12) and its yes is remembered in the
  partition until the transaction's marker (``PartitionTxns.verified``, with a guard so an
  answer that crosses the marker is not taken).
Appends of a partition that wait for a coordinator keep their order: they queue on the
partition's gate, and each starts its append (whose first step is synchronous) before the
next one goes. Nothing here runs for non-transactional produces.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import protocol
from protocol import ErrorCode as E

from ..eager import start_now
from .coordinator import TransactionCoordinator, ensure_transactions
from .peers import PeerError
from .placement import transaction_coordinator

log = logging.getLogger(__name__)

ADD_PARTITIONS_TO_TXN = 24
TXN_ATTRIBUTE = 0x10
# coordinator answers a produce turns into a retriable NOT_ENOUGH_REPLICAS (as Kafka does)
_RETRIABLE = {E.NOT_COORDINATOR, E.COORDINATOR_NOT_AVAILABLE, E.COORDINATOR_LOAD_IN_PROGRESS,
              E.CONCURRENT_TRANSACTIONS, E.REQUEST_TIMED_OUT}


def txn_producer(records: Any) -> tuple[int, int] | None:
    """(producer id, epoch) of the first batch when it is transactional, else None."""
    try:
        if len(records) < 61 or records[16] != 2:
            return None
        view = protocol.BatchView(records, 0)
    except Exception:  # noqa: BLE001 - malformed input: the append reports it
        return None
    if not view.attributes & TXN_ATTRIBUTE or view.is_control:
        return None
    return view.producer_id, view.producer_epoch


async def append_transactional(broker: Any, partition: Any, tid: str, records: Any,
                               version: int, append: Callable[[], Awaitable[Any]],
                               failed: Callable[[int], Any]) -> Any:
    """Run ``append`` once the coordinator has been asked if needed; ``failed(code)`` builds
    the answer when it says no."""
    who = txn_producer(records)
    if who is None:
        return await append()
    pid, epoch = who
    txns = partition.txns
    coord = await ensure_transactions(broker)
    if (txns.gate is None or not txns.gate.locked()) and _settled(coord, partition, pid, epoch,
                                                                   implicit=version >= 12):
        return await append()
    if txns.gate is None:
        txns.gate = asyncio.Lock()
    async with txns.gate:
        if not _settled(coord, partition, pid, epoch, implicit=version >= 12):
            err = await _ask(broker, coord, partition, tid, pid, epoch, add=version >= 12)
            if err:
                return failed(err)
        started = start_now(append())   # its offsets are taken before the next one goes
    return await started


def _settled(coord: TransactionCoordinator, partition: Any, pid: int, epoch: int,
             implicit: bool) -> bool:
    """No need to ask: confirmed already, or the local coordinator decides synchronously."""
    if partition.txns.verified.get(pid) == epoch:
        return True
    if not coord.knows(pid):
        return False
    if not implicit:
        return True   # Partition._verify_txn asks the local coordinator
    return coord.verify(pid, epoch, partition.topic, partition.index) == E.NONE


async def _ask(broker: Any, coord: TransactionCoordinator, partition: Any, tid: str, pid: int,
               epoch: int, add: bool) -> int:
    topic, index = partition.topic, partition.index
    if coord.owns(tid):
        if not add:
            return E.NONE   # verified synchronously by the append
        errs = await coord.add_partitions(tid, pid, epoch, [(topic, index)], lambda t, i: True)
        return _produce_error(errs[(topic, index)])
    node = transaction_coordinator(broker, tid)
    if node < 0:
        return E.NOT_ENOUGH_REPLICAS
    guard = object()
    partition.txns.guards[pid] = guard
    Req = protocol.request_class(ADD_PARTITIONS_TO_TXN)
    Tx = Req.AddPartitionsToTxnTransaction
    T = Req.AddPartitionsToTxnTopic
    req = Req(transactions=[Tx(transactional_id=tid, producer_id=pid, producer_epoch=epoch,
                               verify_only=not add, topics=[T(name=topic, partitions=[index])])])
    try:
        resp = await coord.peers.call(node, ADD_PARTITIONS_TO_TXN, 5 if add else 4, req)
    except PeerError as e:
        log.warning("transaction coordinator not reached node=%d: %s", node, e)
        return E.NOT_ENOUGH_REPLICAS
    err = E.INVALID_TXN_STATE
    for txn in resp.results_by_transaction or []:
        for t in txn.topic_results or []:
            for p in t.results_by_partition or []:
                err = int(p.partition_error_code)
    if resp.error_code:
        err = int(resp.error_code)
    if err == E.NONE:
        if partition.txns.guards.get(pid) is not guard:
            return E.INVALID_TXN_STATE   # a marker ended the transaction meanwhile
        partition.txns.verified[pid] = epoch
    return _produce_error(err)


def _produce_error(err: int) -> int:
    if err in _RETRIABLE:
        return E.NOT_ENOUGH_REPLICAS
    if err == E.PRODUCER_FENCED:
        return E.INVALID_PRODUCER_EPOCH
    return err
