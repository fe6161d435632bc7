"""Java kafka-clients 3.9 and 4.3 transactions against s3kafka (KafkaCli's ``txn`` command).

Consume-transform-produce with sendOffsetsToTransaction in three transactions (commit, abort,
redo and commit): a read_committed reader of the output sees every input transformed exactly
once and the group's committed offsets cover the whole input. A second producer instance with
the same transactional id fences the first, whose commit fails; only the second's record is
visible to read_committed. Admin's describeTransactions, listTransactions and describeProducers
show an open transaction consistently.
"""
from __future__ import annotations

import pytest

from clients.e2e_helpers import JavaCli, compile_java, unique

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
