"""Issue 17: a Jepsen-style fault suite on a 3-broker cluster (tests/chaos/cluster_faults.py).

Idempotent acks=all producers of confluent-kafka and kafka-python write unique values while
brokers are killed (-9) and paused past their lease, the object store and PostgreSQL are cut,
PostgreSQL restarts and one broker's tiny WAL fills up; consumer groups of both clients
commit as they read. Checked: no acknowledged write lost, no value at two offsets, every
acknowledged offset is where the value is read, order per producer and partition, no consumer
skipping or going backwards, committed offsets never going backwards, every error retriable.
The short schedule (each fault twice) runs here; ``make chaos`` runs 30 minutes of random faults.
"""
from __future__ import annotations

import os

import pytest

from .cluster_harness import run_cluster_chaos
from .cluster_faults import short_schedule

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _assert_clean(out, details, capsys) -> None:
    with capsys.disabled():          # the op counts show in a passing run too
        print("\n" + out.summary())
    assert out.report is not None and out.report.acked > 1000, out.summary()
    assert not out.anomalies, (out.summary() + "\nANOMALIES:\n" + "\n".join(out.anomalies)
                               + f"\n(details: {details}, broker logs beside it)")


@pytest.mark.timeout(600)
def test_three_brokers_short_fault_schedule(broker_factory, s3_endpoint, tmp_path,
                                            capsys) -> None:
    out = run_cluster_chaos(broker_factory, s3_endpoint, schedule=short_schedule(rounds=2),
                            details=tmp_path / "chaos-details.txt")
    assert all(n >= 2 for n in out.fault_counts.values()) and len(out.fault_counts) == 6, \
        out.summary()
    _assert_clean(out, tmp_path / "chaos-details.txt", capsys)


@pytest.mark.timeout(0)
@pytest.mark.skipif(not os.environ.get("CHAOS_MINUTES"),
                    reason="long schedule: make chaos (CHAOS_MINUTES=30)")
def test_three_brokers_long_fault_schedule(broker_factory, s3_endpoint, tmp_path,
                                           capsys) -> None:
    minutes = float(os.environ["CHAOS_MINUTES"])
    out = run_cluster_chaos(broker_factory, s3_endpoint, duration_s=minutes * 60,
                            seed=int(os.environ.get("CHAOS_SEED", "17")),
                            details=tmp_path / "chaos-details.txt")
    _assert_clean(out, tmp_path / "chaos-details.txt", capsys)
