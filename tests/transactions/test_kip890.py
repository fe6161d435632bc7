"""KIP-890 part 2: the producer epoch is bumped at the end of every transaction.

The broker advertises the finalized feature ``transaction.version`` 2 in ApiVersions, as
Kafka 4.x does. Java kafka-clients 4.x then end every transaction with EndTxn v5, which bumps
the epoch (the markers carry the new one, so a late batch of the ended transaction is refused),
and add partitions and offsets implicitly (Produce v12+, TxnOffsetCommit v5) instead of
AddPartitionsToTxn/AddOffsetsToTxn; 3.9 clients, and 4.x clients of a broker started with
``--transaction-version 1``, stay on the old protocol (one epoch per producer session).
"""
from __future__ import annotations

import protocol
import pytest
from protocol import ErrorCode as E

from clients.e2e_helpers import CLIENT_BROKER_ARGS, JavaCli, compile_java, unique
from datapath.wire import WireClient

from .test_wire import call, init, txn_batch

TXN_TIMEOUT_MS = 60_000


def produce12(c: WireClient, topic: str, records: bytes, tid: str, partition: int = 0):
    """Produce v12: a KIP-890 part 2 client's produce (adds the partition implicitly)."""
    r = c.produce_request(topic, {partition: records})
    r.transactional_id = tid
    resp = c.call(r, protocol.response_class(0), 12)
    return resp.responses[0].partition_responses[0]


def end_txn(c: WireClient, tid: str, pid: int, epoch: int, commit: bool, version: int = 5):
    return call(c, 26, version, transactional_id=tid, producer_id=pid, producer_epoch=epoch,
                committed=commit)


def control_epochs(c: WireClient, topic: str) -> list[int]:
    """Producer epochs of the control batches (markers) of partition 0."""
    f = c.fetch(topic, 0)
    return [b.producer_epoch for b in protocol.iter_batches(bytes(f.records or b""))
            if b.is_control]


def test_transaction_version_is_advertised(tbroker):
    with WireClient(tbroker.host, tbroker.port, timeout=30) as c:
        r = call(c, 18, 4, client_software_name="t", client_software_version="1")
    assert [(f.name, f.min_version_level, f.max_version_level)
            for f in r.finalized_features] == [("transaction.version", 2, 2)]
    assert r.finalized_features_epoch >= 0
    assert [(f.name, f.min_version, f.max_version) for f in r.supported_features] == \
        [("transaction.version", 0, 2)]


def test_epoch_bump_fences_late_writes_over_the_wire(tbroker):
    topic, tid = unique("k890"), unique("k890tid")
    with WireClient(tbroker.host, tbroker.port, timeout=30) as c:
        c.create_topic(topic, 1)
        pid, epoch = init(c, tid)
        # no AddPartitionsToTxn: Produce v12 adds the partition to the transaction
        assert produce12(c, topic, txn_batch(pid, epoch, 0, [b"a"]), tid).error_code == 0
        r = end_txn(c, tid, pid, epoch, True)
        assert (r.error_code, r.producer_id, r.producer_epoch) == (0, pid, epoch + 1)
        assert control_epochs(c, topic) == [epoch + 1]   # the marker has the new epoch
        # a late (zombie) write of the ended transaction is refused, nothing appended
        late = produce12(c, topic, txn_batch(pid, epoch, 1, [b"late"]), tid)
        assert late.error_code == E.INVALID_PRODUCER_EPOCH
        assert c.list_offsets(topic, -1).offset == 2
        # a retried EndTxn names the old epoch: answered NONE with the current pair
        r = end_txn(c, tid, pid, epoch, True)
        assert (r.error_code, r.producer_id, r.producer_epoch) == (0, pid, epoch + 1)
        assert end_txn(c, tid, pid, epoch, False).error_code == E.PRODUCER_FENCED
        # the next transaction runs at the new epoch; offsets join it without AddOffsetsToTxn
        epoch += 1
        assert produce12(c, topic, txn_batch(pid, epoch, 0, [b"b"]), tid).error_code == 0
        T = protocol.request_class(28).TxnOffsetCommitRequestTopic
        P = T.TxnOffsetCommitRequestPartition
        group = unique("k890g")
        o = call(c, 28, 5, transactional_id=tid, group_id=group, producer_id=pid,
                 producer_epoch=epoch, generation_id=-1, member_id="", group_instance_id=None,
                 topics=[T(name=topic, partitions=[P(partition_index=0, committed_offset=2,
                                                     committed_leader_epoch=-1,
                                                     committed_metadata=None)])])
        assert o.topics[0].partitions[0].error_code == 0
        d = call(c, 65, 0, transactional_ids=[tid]).transaction_states[0]
        assert (d.transaction_state, d.producer_epoch) == ("Ongoing", epoch)
        r = end_txn(c, tid, pid, epoch, False)
        assert (r.error_code, r.producer_epoch) == (0, epoch + 1)
        assert control_epochs(c, topic) == [epoch, epoch + 1]
        f = c.fetch(topic, 0, isolation_level=1)
        assert f.last_stable_offset == f.high_watermark == 4
        assert [(a.producer_id, a.first_offset) for a in f.aborted_transactions] == [(pid, 2)]
        # the aborted transaction's offsets never reach the group
        OF = protocol.request_class(9)
        got = call(c, 9, 7, group_id=group, require_stable=False,
                   topics=[OF.OffsetFetchRequestTopic(name=topic, partition_indexes=[0])])
        assert got.topics[0].partitions[0].committed_offset == -1
        # an EndTxn v4 (old protocol) never bumps
        epoch += 1
        assert produce12(c, topic, txn_batch(pid, epoch, 0, [b"c"]), tid).error_code == 0
        r = end_txn(c, tid, pid, epoch, True, version=4)
        assert r.error_code == 0
        d = call(c, 65, 0, transactional_ids=[tid]).transaction_states[0]
        assert (d.transaction_state, d.producer_epoch) == ("CompleteCommit", epoch)


def _java(java_classpath, version: str) -> JavaCli:
    if version not in java_classpath:
        pytest.skip(f"kafka-clients {version} not cached")
    return JavaCli(version, compile_java(version, java_classpath[version]))


def _run_epochs(cli: JavaCli, bootstrap: str) -> dict:
    topic = unique("jep")
    out = cli("txn-epochs", bootstrap=bootstrap, topic=topic, tid=unique("jep-tid"), count=3,
              timeout=180)
    assert out["states"] == ["CompleteCommit", "CompleteAbort", "CompleteCommit"], out
    assert out["committed"] == ["v0", "v2"], out
    return out


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("version", ["3.9", "4.3"])
def test_java_epoch_per_transaction(tbroker, java_classpath, version):
    """4.x clients bump the epoch at every transaction end; 3.9 keeps one epoch."""
    out = _run_epochs(_java(java_classpath, version), tbroker.bootstrap)
    first = out["epochs"][0]
    if version == "3.9":
        assert out["epochs"] == [first] * 4, out
    else:
        assert out["epochs"] == [first, first + 1, first + 2, first + 3], out


@pytest.mark.e2e
@pytest.mark.slow
def test_java4_stays_on_v1_when_the_broker_says_so(broker_factory, java_classpath):
    """``--transaction-version 1``: a 4.x client keeps the old protocol (no epoch bumps)."""
    cli = _java(java_classpath, "4.3")
    b = broker_factory(CLIENT_BROKER_ARGS + ["--transaction-version", "1"])
    out = _run_epochs(cli, b.bootstrap)
    assert len(set(out["epochs"])) == 1, out
