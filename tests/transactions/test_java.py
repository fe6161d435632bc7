"""Java kafka-clients 3.9 and 4.3 transactions against s3kafka (KafkaCli's ``txn`` command).

Consume-transform-produce with sendOffsetsToTransaction in three transactions (commit, abort,
redo and commit): a read_committed reader of the output sees every input transformed exactly
once and the group's committed offsets cover the whole input. A second producer instance with
the same transactional id fences the first, whose commit fails; only the second's record is
visible to read_committed. Admin's describeTransactions, listTransactions and describeProducers
show an open transaction consistently. A Java producer halted mid-transaction has it aborted
by the broker after its timeout.
"""
from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, TopicPartition

from clients.e2e_helpers import JavaCli, compile_java, create_topic, unique

from .test_librdkafka import consume_all, txn_producer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
COUNT = 40
FENCED = {"ProducerFencedException", "InvalidProducerEpochException"}


@pytest.mark.parametrize("version", ["3.9", "4.3"])
def test_java_transactions(tbroker, java_classpath, version):
    if version not in java_classpath:
        pytest.skip(f"kafka-clients {version} not cached")
    cli = JavaCli(version, compile_java(version, java_classpath[version]))
    prefix = unique(f"jtx{version.replace('.', '')}")
    out = cli("txn", bootstrap=tbroker.bootstrap, topic=prefix, count=COUNT, timeout=240)
    assert "abort" in out["ctp_txns"] and out["ctp_txns"][-1] == "commit", out
    assert sorted(out["ctp_out"]) == sorted(f"out-{i}" for i in range(COUNT)), out
    assert out["ctp_group_offsets"] == COUNT, out
    assert out["zombie_commit"] in FENCED, out
    assert out["fence_values"] == ["second"], out
    assert out["describe_state"].lower() == "ongoing", out
    assert out["describe_partitions"] == f"[{prefix}-fence-0]", out
    assert out["list_has"] and out["producer_txn_start_matches"], out
    assert out["lso_is_txn_start"] and out["hw_past_txn"], out


def test_java_producer_dies_mid_transaction(tbroker, java_classpath):
    """A Java transactional producer halted in the middle of its transaction: its records hold
    the LSO until the broker aborts the transaction after transaction.timeout.ms; read_committed
    readers never see them, and the transactional id is usable again."""
    version = sorted(java_classpath)[-1]
    cli = JavaCli(version, compile_java(version, java_classpath[version]))
    topic, tid = unique("jdie"), unique("jdie-tid")
    create_topic(tbroker.bootstrap, topic, 1)
    out = cli("txn-die", bootstrap=tbroker.bootstrap, topic=topic, tid=tid, count=5,
              txn_timeout_ms=3000, timeout=120)
    assert out["offsets"] == [0, 1, 2, 3, 4], out

    def lso() -> int:
        c = Consumer({"bootstrap.servers": tbroker.bootstrap, "group.id": unique("w"),
                      "isolation.level": "read_committed", "log_level": 0})
        try:
            return c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
        finally:
            c.close()

    assert lso() == 0
    deadline = time.monotonic() + 30
    while lso() != 6:   # 5 records + the broker's ABORT marker
        assert time.monotonic() < deadline, "the dead producer's transaction was not aborted"
        time.sleep(0.5)
    p = txn_producer(tbroker.bootstrap, tid)   # the same id, a new instance
    p.begin_transaction()
    p.produce(topic, b"alive", partition=0)
    p.commit_transaction(30)
    assert consume_all(tbroker.bootstrap, topic, 1, "read_committed", expect=1) == ["alive"]
