"""A confluent-kafka group member whose OffsetFetch meets a metadata-store outage still reads.

Session 23's chaos run (CHAOS_SEED=202, docs/FINDINGS.md): group chaos-ck completed its first
rebalance just before a PostgreSQL cut; its members received their partitions, asked the
coordinator for the committed offsets (OffsetFetch) during the cut, and the coordinator, which
re-reads a group's offsets from the store before each OffsetFetch in a cluster, answered the
request-level COORDINATOR_NOT_AVAILABLE. librdkafka does not retry that OffsetFetch (for it
COORDINATOR_NOT_AVAILABLE means "look the coordinator up again", not "retry") and leaves the
partitions waiting for an offset until the next rebalance, which never came: the members
heartbeated (answered NONE) for 3.5 minutes and read nothing.

Here two brokers share PostgreSQL through a TcpProxy; the store is cut from inside the
member's on_assign callback, so the OffsetFetch that follows the assignment is the one that
meets the outage, every time; the cut ends 3 s later and the member must read every record.
The second test checks the answer itself on the wire: COORDINATOR_LOAD_IN_PROGRESS (what
Kafka answers while it loads a group's offsets; every client retries it in place) at the top
level (v2-7), per group (v8+) or per partition (v0-1, which have no top-level error).
"""
from __future__ import annotations

import logging
import time

import pytest
from confluent_kafka import Consumer, Producer
from kafka.protocol.consumer import OffsetFetchRequest, OffsetFetchResponse

from broker.cluster.coordinators import coordinator_for
from datapath.wire import WireClient

from .kit import brokers_behind_proxy, wait_for
from .timed_load import PARTITIONS, create_topic

pytestmark = pytest.mark.slow
TOPIC = "go"
RECORDS = 60


class _Lines(logging.Handler):
    """librdkafka's debug lines, kept for the failure message."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("metadata_url", ["postgresql"], indirect=True)
def test_member_reads_after_its_offset_fetch_met_a_store_outage(broker_factory, tmp_path,
                                                                 metadata_url):
    proxy, brokers = brokers_behind_proxy(broker_factory, tmp_path, metadata_url)
    boot = ",".join(b.bootstrap for b in brokers)
    lines = _Lines()
    rdlog = logging.getLogger(f"rdkafka-{tmp_path.name}")
    rdlog.addHandler(lines)
    rdlog.setLevel(logging.DEBUG)
    rdlog.propagate = False
    c = None
    try:
        create_topic(boot, TOPIC, live=2)
        p = Producer({"bootstrap.servers": boot, "acks": "all"})
        for i in range(RECORDS):
            p.produce(TOPIC, value=f"v{i}".encode(), partition=i % PARTITIONS)
        assert p.flush(60) == 0

        cut_at: list[float] = []

        def on_assign(_c, tps) -> None:
            # runs before librdkafka asks for the committed offsets of ``tps``
            if tps and not cut_at:
                proxy.cut()
                cut_at.append(time.monotonic())

        c = Consumer({"bootstrap.servers": boot, "group.id": "outage-ck",
                      "auto.offset.reset": "earliest", "enable.auto.commit": False,
                      "session.timeout.ms": 10000, "heartbeat.interval.ms": 500,
                      "debug": "cgrp", "logger": rdlog})
        c.subscribe([TOPIC], on_assign=on_assign)
        seen: set[bytes] = set()
        errors: list[str] = []
        start, restored_at = time.monotonic(), None
        while len(seen) < RECORDS:
            for m in c.consume(100, timeout=0.2):
                if m.error():
                    errors.append(str(m.error()))
                else:
                    seen.add(m.value())
            now = time.monotonic()
            if restored_at is None:
                assert cut_at or now - start < 60, "the member was never assigned partitions"
                if cut_at and now - cut_at[0] > 3.0:
                    proxy.restore()
                    restored_at = now
            elif now - restored_at > 45:
                break
        if len(seen) < RECORDS:
            offset_lines = [ln for ln in lines.lines if "OFFSET" in ln or "ffset" in ln]
            pytest.fail(f"the member read {len(seen)} of {RECORDS} records in 45 s after the "
                        f"outage; client errors {errors[:5]}; librdkafka: {offset_lines[-12:]}")
    finally:
        if c is not None:
            c.close()
        proxy.close()
        rdlog.removeHandler(lines)


def _offset_fetch(c: WireClient, group: str, version: int) -> tuple[int, list[tuple[int, int]]]:
    """(top-level or group error, [(partition, error)]) of an OffsetFetch of partitions 0, 1
    of TOPIC."""
    if version >= 8:
        G = OffsetFetchRequest.OffsetFetchRequestGroup
        req = OffsetFetchRequest(groups=[G(group_id=group, member_id=None, member_epoch=-1,
                                           topics=[G.OffsetFetchRequestTopics(
                                               name=TOPIC, partition_indexes=[0, 1])])],
                                 require_stable=True)
        (g,) = c.call(req, OffsetFetchResponse, version).groups
        return g.error_code, [(p.partition_index, p.error_code)
                              for t in g.topics for p in t.partitions]
    T = OffsetFetchRequest.OffsetFetchRequestTopic
    req = OffsetFetchRequest(group_id=group, topics=[T(name=TOPIC, partition_indexes=[0, 1])],
                             require_stable=version >= 7)
    r = c.call(req, OffsetFetchResponse, version)
    return (r.error_code if version >= 2 else 0), [(p.partition_index, p.error_code)
                                                    for t in r.topics for p in t.partitions]


@pytest.mark.parametrize("metadata_url", ["postgresql"], indirect=True)
def test_offset_fetch_answers_load_in_progress_while_the_store_is_cut(broker_factory, tmp_path,
                                                                      metadata_url):
    proxy, brokers = brokers_behind_proxy(broker_factory, tmp_path, metadata_url)
    boot = ",".join(b.bootstrap for b in brokers)
    load, none = 14, 0      # COORDINATOR_LOAD_IN_PROGRESS
    try:
        create_topic(boot, TOPIC, live=2)
        group = "outage-wire"
        coord = brokers[coordinator_for(group, [0, 1])]
        with WireClient(coord.host, coord.port, timeout=60, client_id="outage-wire") as c:
            wait_for(lambda: _offset_fetch(c, group, 8) == (none, [(0, none), (1, none)]),
                     what="the coordinator to answer for the group")
            proxy.cut()
            assert _offset_fetch(c, group, 8) == (load, [])
            assert _offset_fetch(c, group, 5) == (load, [])
            assert _offset_fetch(c, group, 1) == (0, [(0, load), (1, load)])
            proxy.restore()
            wait_for(lambda: _offset_fetch(c, group, 8) == (none, [(0, none), (1, none)]),
                     what="OffsetFetch to answer again once the store is back")
    finally:
        proxy.close()
