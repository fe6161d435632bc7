"""A broker stopped (SIGTERM) while its metadata store is out of reach.

Its controlled shutdown cannot mark it draining nor move its partitions: that is the store's
outage, logged as the store's one-line episode, not `controlled shutdown failed` with a
traceback at ERROR (session 23's robust helper saw it when a chaos run's PostgreSQL proxies
went away); the broker still exits 0 once the store is back, and the other broker serves on.
"""
from __future__ import annotations

import time

import pytest

from .kit import FAILOVER_FLAGS, brokers_behind_proxy, wait_for
from .timed_load import create_topic


def test_sigterm_during_a_metadata_outage_logs_the_outage_not_a_traceback(broker_factory,
                                                                          tmp_path,
                                                                          metadata_url):
    if metadata_url.startswith("sqlite"):
        pytest.skip("a database outage through a TCP proxy: PostgreSQL only")
    proxy, brokers = brokers_behind_proxy(broker_factory, tmp_path, metadata_url,
                                          FAILOVER_FLAGS)
    boot = ",".join(b.bootstrap for b in brokers)
    try:
        create_topic(boot, "so", live=2)
        victim = brokers[1]
        proxy.cut()
        time.sleep(0.5)
        victim.proc.send_signal(15)
        # the drain's first store call fails at once (connections reset); then the store
        # comes back so the rest of the stop (its last upload's commit) can finish
        wait_for(lambda: "controlled shutdown" in victim.log_text()
                 or "episode=metadata_unreachable state=started" in victim.log_text(),
                 timeout=30, what="the stop to meet the outage")
        time.sleep(1.0)
        proxy.restore()
        assert victim.proc.wait(60) == 0, victim.log_tail()
    finally:
        proxy.close()
    text = victim.log_text()
    assert "episode=metadata_unreachable state=started" in text, text[-3000:]
    errors = [ln for ln in text.splitlines() if "level=ERROR" in ln or "Traceback" in ln]
    assert not errors, errors[:5]
    assert brokers[0].running
