"""group.initial.rebalance.delay.ms: Kafka's 3000 ms by default, so members that subscribe
together land in one generation instead of rebalancing once per arriving member."""
from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient, NewTopic

from broker.cli import parse_config
from clients.e2e_helpers import unique

pytestmark = pytest.mark.e2e


def test_default_is_kafkas_3000_ms():
    assert parse_config(["serve"], env={}).group_initial_rebalance_delay_ms == 3000


def test_members_joining_together_share_one_generation(broker_factory):
    b = broker_factory(["--group-initial-rebalance-delay-ms", "3000",
                        "--group-min-session-timeout-ms", "1000"])
    topic, group = unique("delay"), unique("delay-g")
    admin = AdminClient({"bootstrap.servers": b.bootstrap})
    admin.create_topics([NewTopic(topic, 4, 1)])[topic].result(30)
    assigns: dict[int, list[int]] = {0: [], 1: []}
    done = threading.Event()

    def member(i: int) -> None:
        c = Consumer({"bootstrap.servers": b.bootstrap, "group.id": group,
                      "session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
        c.subscribe([topic], on_assign=lambda _c, parts: assigns[i].append(len(parts)))
        try:
            while not done.is_set():
                c.poll(0.2)
        finally:
            c.close()

    threads = [threading.Thread(target=member, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (assigns[0] and assigns[1]):
        time.sleep(0.1)
    time.sleep(1.0)   # a second generation, if there were one, would show up by now
    done.set()
    for t in threads:
        t.join(30)
    # one assignment each, splitting the 4 partitions: both joined the first generation
    assert assigns == {0: [2], 1: [2]}, assigns
