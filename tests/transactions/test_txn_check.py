"""A transactional queue check: several librdkafka transactional producers commit and abort
transactions across partitions while the broker is killed (-9) and restarted; a read_committed
reader then finds no aborted record, no lost committed record, no duplicate and no torn
transaction (each transaction visible whole or not at all)."""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from confluent_kafka import KafkaException, Producer

from clients.e2e_helpers import create_topic, unique

from .test_librdkafka import consume_all

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PRODUCERS, TXNS, PER_TXN, PARTS = 3, 12, 6, 3


def run_producer(bootstrap: str, topic: str, tid: str, i: int, outcome: dict[str, str],
                 stop: threading.Event, killed: threading.Event) -> None:
    def make() -> Producer:
        p = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, "log_level": 0,
                      "transaction.timeout.ms": 10000, "linger.ms": 2})
        p.init_transactions(60)
        return p

    p = make()
    for j in range(TXNS):
        if stop.is_set():
            return
        if j == TXNS * 2 // 3:
            # a third is left for after the kill even when the test's thread is starved (at
            # load it once saw all 36 transactions end before its poll)
            killed.wait(120)
        name = f"p{i}-t{j}"
        commit = j % 3 != 2
        try:
            p.begin_transaction()
            for k in range(PER_TXN):
                p.produce(topic, f"{name}-r{k}".encode(), partition=k % PARTS)
            if commit:
                for _attempt in range(10):
                    try:
                        p.commit_transaction(30)
                        outcome[name] = "committed"
                        break
                    except KafkaException as e:
                        err = e.args[0]
                        if err.retriable():
                            continue
                        if err.txn_requires_abort():
                            p.abort_transaction(30)
                            outcome[name] = "aborted"
                            break
                        raise
                else:
                    outcome[name] = "unknown"
            else:
                p.flush(30)
                p.abort_transaction(30)
                outcome[name] = "aborted"
        except KafkaException:
            outcome.setdefault(name, "unknown")
            try:
                p = make()  # a new instance aborts (or finds completed) what the old one left
            except KafkaException:
                time.sleep(1)
                p = make()


def test_transactional_queue_check_under_kill_9(broker_factory):
    broker = broker_factory(["--group-min-session-timeout-ms", "1000"])
    topic = unique("txq")
    create_topic(broker.bootstrap, topic, PARTS)
    outcome: dict[str, str] = {}
    stop, killed = threading.Event(), threading.Event()
    threads = [threading.Thread(target=run_producer, daemon=True,
                                args=(broker.bootstrap, topic, unique(f"txq{i}"), i, outcome, stop,
                                      killed))
               for i in range(PRODUCERS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(outcome) < PRODUCERS * TXNS // 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    at_kill = len(outcome)
    broker.restart(hard=True)  # kill -9 in the middle of transactions
    killed.set()
    assert at_kill < PRODUCERS * TXNS  # the producers were still running
    for t in threads:
        t.join(150)
    stop.set()
    assert not any(t.is_alive() for t in threads), outcome
    assert len(outcome) == PRODUCERS * TXNS, outcome

    # open transactions of dead instances are aborted by their next instance or the timeout
    seen = consume_all(broker.bootstrap, topic, PARTS, "read_committed",
                       expect=sum(PER_TXN for o in outcome.values() if o == "committed"),
                       timeout=40)
    counts = Counter(seen)
    assert not [v for v, n in counts.items() if n > 1], "duplicates"
    per_txn = Counter(v.rsplit("-r", 1)[0] for v in seen)
    torn = {t: n for t, n in per_txn.items() if n != PER_TXN}
    assert not torn, f"torn transactions {torn}"
    lost = [t for t, o in outcome.items() if o == "committed" and per_txn[t] != PER_TXN]
    assert not lost, f"committed but not visible {lost}"
    leaked = [t for t, o in outcome.items() if o == "aborted" and per_txn[t]]
    assert not leaked, f"aborted but visible {leaked}"
    assert sum(o == "committed" for o in outcome.values()) >= PRODUCERS * TXNS // 2
    print(f"at kill: {at_kill} done; outcomes {Counter(outcome.values())}; "
          f"{len(seen)} committed records read")
