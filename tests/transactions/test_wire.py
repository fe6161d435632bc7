"""The transaction APIs over a raw socket: what no client shows directly.

Server-side verification (a transactional batch outside its transaction, an older epoch, a
client's control batch), AddPartitionsToTxn v4 verify_only, DescribeTransactions,
ListTransactions and DescribeProducers consistent with the coordinator, read_committed Fetch
and ListOffsets around an open and then an aborted transaction, fencing on EndTxn.
"""
from __future__ import annotations

import protocol
from protocol import ErrorCode as E

from clients.e2e_helpers import unique
from datapath.wire import WireClient

TXN_TIMEOUT_MS = 60_000


def req(key: int, **fields):
    return protocol.request_class(key)(**fields)


def call(c: WireClient, key: int, version: int, **fields):
    return c.call(req(key, **fields), protocol.response_class(key), version)


def init(c: WireClient, tid: str) -> tuple[int, int]:
    r = call(c, 22, 4, transactional_id=tid, transaction_timeout_ms=TXN_TIMEOUT_MS,
             producer_id=-1, producer_epoch=-1)
    assert r.error_code == 0, r
    return r.producer_id, r.producer_epoch


def add_partitions(c: WireClient, tid: str, pid: int, epoch: int, topic: str, parts: list[int]):
    T = protocol.request_class(24).AddPartitionsToTxnTopic
    r = call(c, 24, 3, v3_and_below_transactional_id=tid, v3_and_below_producer_id=pid,
             v3_and_below_producer_epoch=epoch,
             v3_and_below_topics=[T(name=topic, partitions=parts)])
    return {p.partition_index: p.partition_error_code
            for t in r.results_by_topic_v3_and_below for p in t.results_by_partition}


def txn_batch(pid: int, epoch: int, seq: int, values: list[bytes], control: bool = False):
    return protocol.build_batch([(None, v) for v in values], producer_id=pid,
                                producer_epoch=epoch, base_sequence=seq, transactional=True,
                                control=control, timestamp=1_700_000_000_000)


def produce(c: WireClient, topic: str, records: bytes, tid: str, partition: int = 0):
    r = c.produce_request(topic, {partition: records})
    r.transactional_id = tid
    resp = c.call(r, protocol.response_class(0), 9)
    return resp.responses[0].partition_responses[0]


def test_transaction_apis_over_the_wire(tbroker):
    topic, tid = unique("wtx"), unique("wtid")
    with WireClient(tbroker.host, tbroker.port, timeout=30) as c:
        c.create_topic(topic, 2)
        pid, epoch = init(c, tid)
        # outside any transaction: refused, nothing appended
        r = produce(c, topic, txn_batch(pid, epoch, 0, [b"early"]), tid)
        assert r.error_code == E.INVALID_TXN_STATE
        assert add_partitions(c, tid, pid, epoch, topic, [0]) == {0: 0}
        # KIP-890 part 1: verify_only tells which partitions are in the transaction
        Tx = protocol.request_class(24).AddPartitionsToTxnTransaction
        T = protocol.request_class(24).AddPartitionsToTxnTopic
        v = call(c, 24, 4, transactions=[Tx(transactional_id=tid, producer_id=pid,
                                             producer_epoch=epoch, verify_only=True,
                                             topics=[T(name=topic, partitions=[0, 1])])])
        got = {p.partition_index: p.partition_error_code
               for t in v.results_by_transaction[0].topic_results for p in t.results_by_partition}
        assert got == {0: 0, 1: E.INVALID_TXN_STATE}
        r = produce(c, topic, txn_batch(pid, epoch, 0, [b"t0", b"t1"]), tid)
        assert r.error_code == 0 and r.base_offset == 0
        # not added: partition 1 refuses the same producer's batch
        assert produce(c, topic, txn_batch(pid, epoch, 0, [b"x"]), tid, 1).error_code \
            == E.INVALID_TXN_STATE
        # clients may not write markers
        assert produce(c, topic, txn_batch(pid, epoch, 2, [b"m"], control=True), tid).error_code \
            == E.INVALID_RECORD

        d = call(c, 65, 0, transactional_ids=[tid, "nope-" + tid]).transaction_states
        assert (d[0].error_code, d[0].transaction_state, d[0].producer_id) == (0, "Ongoing", pid)
        assert [(t.topic, list(t.partitions)) for t in d[0].topics] == [(topic, [0])]
        assert d[1].error_code == E.TRANSACTIONAL_ID_NOT_FOUND
        lt = call(c, 66, 1, state_filters=["Ongoing", "Bogus"], producer_id_filters=[],
                  duration_filter=-1)
        assert tid in [s.transactional_id for s in lt.transaction_states]
        assert list(lt.unknown_state_filters) == ["Bogus"]
        TR = protocol.request_class(61).TopicRequest
        dp = call(c, 61, 0, topics=[TR(name=topic, partition_indexes=[0])])
        [state] = dp.topics[0].partitions[0].active_producers
        assert (state.producer_id, state.current_txn_start_offset) == (pid, 0)

        # open transaction: read_committed sees nothing, its latest offset is the LSO
        assert c.list_offsets(topic, -1, isolation_level=1).offset == 0
        assert c.list_offsets(topic, -1).offset == 2
        f = c.fetch(topic, 0, isolation_level=1)
        assert (f.high_watermark, f.last_stable_offset, f.records) == (2, 0, None) or \
            (f.high_watermark, f.last_stable_offset) == (2, 0) and not f.records
        assert c.fetch(topic, 0).records

        r = call(c, 26, 3, transactional_id=tid, producer_id=pid, producer_epoch=epoch,
                 committed=False)
        assert r.error_code == 0
        f = c.fetch(topic, 0, isolation_level=1)
        assert (f.high_watermark, f.last_stable_offset) == (3, 3)  # 2 records + the marker
        assert [(a.producer_id, a.first_offset) for a in f.aborted_transactions] == [(pid, 0)]
        assert c.list_offsets(topic, -1, isolation_level=1).offset == 3
        d = call(c, 65, 0, transactional_ids=[tid]).transaction_states[0]
        assert d.transaction_state == "CompleteAbort" and not d.topics

        # a new instance fences the old epoch everywhere
        pid2, epoch2 = init(c, tid)
        assert (pid2, epoch2) == (pid, epoch + 1)
        r = call(c, 26, 3, transactional_id=tid, producer_id=pid, producer_epoch=epoch,
                 committed=True)
        assert r.error_code == E.PRODUCER_FENCED
        assert add_partitions(c, tid, pid2, epoch2, topic, [0, 1]) == {0: 0, 1: 0}
        assert produce(c, topic, txn_batch(pid, epoch, 2, [b"zombie"]), tid).error_code \
            == E.INVALID_PRODUCER_EPOCH
        assert produce(c, topic, txn_batch(pid2, epoch2, 0, [b"new"]), tid).error_code == 0
        r = call(c, 26, 3, transactional_id=tid, producer_id=pid2, producer_epoch=epoch2,
                 committed=True)
        assert r.error_code == 0
        f = c.fetch(topic, 3, isolation_level=1)
        assert f.last_stable_offset == f.high_watermark == 5
        assert list(f.aborted_transactions) == []
        # a retried EndTxn of a completed transaction is answered NONE
        assert call(c, 26, 3, transactional_id=tid, producer_id=pid2, producer_epoch=epoch2,
                    committed=True).error_code == 0


def test_transaction_timeout_bounds(tbroker):
    with WireClient(tbroker.host, tbroker.port, timeout=30) as c:
        for timeout in (0, 900_001):
            r = call(c, 22, 4, transactional_id=unique("tmo"), transaction_timeout_ms=timeout,
                     producer_id=-1, producer_epoch=-1)
            assert r.error_code == E.INVALID_TRANSACTION_TIMEOUT


def test_txn_offsets_visible_only_on_commit(tbroker):
    topic, tid, group = unique("wto"), unique("wto-tid"), unique("wto-group")
    with WireClient(tbroker.host, tbroker.port, timeout=30) as c:
        c.create_topic(topic, 1)

        def fetch_offset(require_stable: bool) -> tuple[int, int]:
            T = protocol.request_class(9).OffsetFetchRequestTopic
            r = call(c, 9, 7, group_id=group, require_stable=require_stable,
                     topics=[T(name=topic, partition_indexes=[0])])
            p = r.topics[0].partitions[0]
            return p.committed_offset, p.error_code

        def commit_in_txn(offset: int, commit: bool) -> None:
            pid, epoch = init(c, tid)
            assert call(c, 25, 3, transactional_id=tid, producer_id=pid, producer_epoch=epoch,
                        group_id=group).error_code == 0
            T = protocol.request_class(28).TxnOffsetCommitRequestTopic
            P = T.TxnOffsetCommitRequestPartition
            r = call(c, 28, 3, transactional_id=tid, group_id=group, producer_id=pid,
                     producer_epoch=epoch, generation_id=-1, member_id="", group_instance_id=None,
                     topics=[T(name=topic, partitions=[P(partition_index=0, committed_offset=offset,
                                                         committed_leader_epoch=-1,
                                                         committed_metadata="")])])
            assert r.topics[0].partitions[0].error_code == 0
            # pending: invisible, and unstable for a reader that asks (KIP-447)
            assert fetch_offset(False) == (prev[0], 0)
            assert fetch_offset(True)[1] == E.UNSTABLE_OFFSET_COMMIT
            assert call(c, 26, 3, transactional_id=tid, producer_id=pid, producer_epoch=epoch,
                        committed=commit).error_code == 0

        prev = [-1]
        commit_in_txn(5, commit=False)
        assert fetch_offset(True) == (-1, 0)
        commit_in_txn(9, commit=True)
        assert fetch_offset(True) == (9, 0)


def test_a_late_copy_of_a_coordinators_marker_is_not_written(tbroker):
    """A transaction coordinator's marker that reaches the leader again after the next
    transaction began (a timed-out call, retried) is answered without being written: it would
    end that transaction. DescribeProducers reports the number the last marker carried."""
    topic, tid = unique("wlate"), unique("wlatetid")
    with WireClient(tbroker.host, tbroker.port, timeout=30) as c, \
            WireClient(tbroker.host, tbroker.port, timeout=30, client_id="s3kafka-broker") as peer:
        c.create_topic(topic, 1)
        pid, epoch = init(c, tid)
        assert add_partitions(c, tid, pid, epoch, topic, [0]) == {0: 0}
        assert produce(c, topic, txn_batch(pid, epoch, 0, [b"gone"]), tid).error_code == 0
        assert call(c, 26, 3, transactional_id=tid, producer_id=pid, producer_epoch=epoch,
                    committed=False).error_code == 0                  # ABORT marker at 1
        TR = protocol.request_class(61).TopicRequest
        dp = call(c, 61, 0, topics=[TR(name=topic, partition_indexes=[0])])
        [state] = dp.topics[0].partitions[0].active_producers
        number = state.coordinator_epoch
        assert number > 0
        assert add_partitions(c, tid, pid, epoch, topic, [0]) == {0: 0}
        r = produce(c, topic, txn_batch(pid, epoch, 1, [b"kept"]), tid)
        assert (r.error_code, r.base_offset) == (0, 2)
        M = protocol.request_class(27).WritableTxnMarker
        late = call(peer, 27, 1, markers=[M(producer_id=pid, producer_epoch=epoch,
                                             transaction_result=False, coordinator_epoch=number,
                                             topics=[M.WritableTxnMarkerTopic(
                                                 name=topic, partition_indexes=[0])])])
        assert late.markers[0].topics[0].partitions[0].error_code == 0
        f = c.fetch(topic, 0, isolation_level=1)
        assert (f.high_watermark, f.last_stable_offset) == (3, 2)   # not written, still open
        assert call(c, 26, 3, transactional_id=tid, producer_id=pid, producer_epoch=epoch,
                    committed=True).error_code == 0                   # COMMIT marker at 3
        f = c.fetch(topic, 0, isolation_level=1)
        assert (f.high_watermark, f.last_stable_offset) == (4, 4)
        assert [(a.producer_id, a.first_offset) for a in f.aborted_transactions] == [(pid, 0)]
