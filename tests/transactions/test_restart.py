"""Broker restarts (SIGTERM and kill -9) in the middle of transactions.

Before the restart: a committed transaction, an aborted one, and an open one whose producer
process is killed (never ends it). After the restart: the committed records are visible to
read_committed, the aborted ones never; the open transaction holds the last stable offset until
the broker aborts it after its timeout, then it is invisible too; a new transaction commits.
No record of a transaction is ever visible without the rest of it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from bench.common import tied_popen
from clients.e2e_helpers import create_topic, unique

from .test_librdkafka import consume_all, txn_producer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
OPEN_TIMEOUT_MS = 6000
PARTS = 2

OPEN_TXN_SCRIPT = """
import sys, time
from confluent_kafka import Producer
p = Producer({"bootstrap.servers": sys.argv[1], "transactional.id": sys.argv[2],
              "transaction.timeout.ms": int(sys.argv[4]), "log_level": 0})
p.init_transactions(30)
p.begin_transaction()
for i in range(20):
    p.produce(sys.argv[3], f"open-{i}".encode(), partition=i % 2)
assert p.flush(30) == 0
print("ready", flush=True)
time.sleep(600)
"""


def offsets(bootstrap: str, topic: str, isolation: str) -> list[int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("w"),
                  "isolation.level": isolation, "log_level": 0})
    try:
        return [c.get_watermark_offsets(TopicPartition(topic, i), timeout=10)[1]
                for i in range(PARTS)]
    finally:
        c.close()


@pytest.mark.parametrize("hard", [False, True], ids=["sigterm", "kill-9"])
def test_restart_in_the_middle_of_transactions(broker_factory, hard):
    broker = broker_factory(["--group-min-session-timeout-ms", "1000"])
    topic = unique("txr")
    create_topic(broker.bootstrap, topic, PARTS)
    p = txn_producer(broker.bootstrap, unique("txr-c"))
    p.begin_transaction()
    for i in range(20):
        p.produce(topic, f"committed-{i}".encode(), partition=i % PARTS)
    p.commit_transaction(30)
    p.begin_transaction()
    for i in range(20):
        p.produce(topic, f"aborted-{i}".encode(), partition=i % PARTS)
    p.flush(30)
    p.abort_transaction(30)
    # a producer process killed in the middle of its transaction
    zombie = tied_popen([sys.executable, "-c", OPEN_TXN_SCRIPT, broker.bootstrap,
                         unique("txr-open"), topic, str(OPEN_TIMEOUT_MS)],
                        stdout=subprocess.PIPE, text=True)
    try:
        assert zombie.stdout.readline().strip() == "ready"
    finally:
        os.kill(zombie.pid, signal.SIGKILL)
        zombie.wait(10)
    hw = offsets(broker.bootstrap, topic, "read_uncommitted")
    lso = offsets(broker.bootstrap, topic, "read_committed")
    assert all(s < h for s, h in zip(lso, hw)), (lso, hw)  # the open transaction holds the LSO

    broker.restart(hard=hard)
    t0 = time.monotonic()
    seen = consume_all(broker.bootstrap, topic, PARTS, "read_committed", expect=20)
    assert sorted(seen) == sorted(f"committed-{i}" for i in range(20)), seen
    # the broker aborts the open transaction after its timeout
    deadline = time.monotonic() + OPEN_TIMEOUT_MS / 1000 + 20
    while True:
        hw = offsets(broker.bootstrap, topic, "read_uncommitted")
        lso = offsets(broker.bootstrap, topic, "read_committed")
        if lso == hw:
            break
        assert time.monotonic() < deadline, (lso, hw, broker.log_tail())
        time.sleep(0.5)
    assert time.monotonic() - t0 < OPEN_TIMEOUT_MS / 1000 + 20

    p2 = txn_producer(broker.bootstrap, unique("txr-after"))
    p2.begin_transaction()
    for i in range(10):
        p2.produce(topic, f"after-{i}".encode(), partition=i % PARTS)
    p2.commit_transaction(30)
    seen = consume_all(broker.bootstrap, topic, PARTS, "read_committed", expect=30)
    assert sorted(seen) == sorted([f"committed-{i}" for i in range(20)]
                                  + [f"after-{i}" for i in range(10)]), seen
    everything = consume_all(broker.bootstrap, topic, PARTS, "read_uncommitted", expect=70)
    assert len(everything) == 70, len(everything)
    p.flush(5)
