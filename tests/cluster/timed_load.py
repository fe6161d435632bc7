"""A topic under a steady idempotent load, for the cluster, failover and fencing tests
(test_cluster, test_failover, test_fencing, test_zombie, test_metadata_locks): create it,
keep writing unique values to it with their acknowledgement times, and check afterwards that
every acknowledged value is read back once at its acknowledged offset."""
from __future__ import annotations

import collections
import threading
import time

from confluent_kafka import Producer
from kafka.admin import KafkaAdminClient, NewTopic

from .kit import leaders, read_all, wait_for, wait_leaders, wait_live

PARTITIONS = 6


class TimedLoad:
    """An idempotent acks=all producer of unique values; every ack with its arrival time."""

    def __init__(self, bootstrap: str, topic: str, keyed: bool = False) -> None:
        self.keyed = keyed     # keyed records, partitioned by the client (97 keys)
        self.acked: list[tuple[int, int, bytes, float]] = []
        self.errors: list[str] = []
        self.sent = 0
        self.sent_at: list[float] = []      # send time of value v{i}
        self._stop = threading.Event()
        self._p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                            "acks": "all", "linger.ms": 5, "message.timeout.ms": 60000,
                            "topic.metadata.refresh.interval.ms": 500,
                            "retry.backoff.max.ms": 200})
        self._topic = topic
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _cb(self, err, msg) -> None:
        if err is not None:
            self.errors.append(str(err))
        else:
            self.acked.append((msg.partition(), msg.offset(), msg.value(), time.monotonic()))

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in range(20):
                self.sent_at.append(time.monotonic())
                if self.keyed:
                    self._p.produce(self._topic, key=str(self.sent % 97).encode(),
                                    value=f"v{self.sent}".encode(), on_delivery=self._cb)
                else:
                    self._p.produce(self._topic, value=f"v{self.sent}".encode(),
                                    partition=self.sent % PARTITIONS, on_delivery=self._cb)
                self.sent += 1
            self._p.poll(0.05)
        self._p.flush(60)

    def wait_every_partition(self) -> None:
        """Until every partition acknowledged at least one value."""
        wait_for(lambda: {p for p, *_ in self.acked} >= set(range(PARTITIONS)), what="acks")

    def stop(self) -> None:
        self._stop.set()
        self._t.join(90)


def create_topic(boot: str, topic: str, live: int = 0,
                 settle: bool = False) -> dict[int, tuple[int, int]]:
    """Once ``live`` brokers are up, create ``topic`` (PARTITIONS partitions, one replica)
    and wait for every partition's leader; with ``settle``, half a second more (every
    broker's view follows the database within a poll interval). Returns the leaders."""
    admin = KafkaAdminClient(bootstrap_servers=boot)
    try:
        if live:
            wait_live(admin, live)
        admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
        wait_leaders(admin, topic, PARTITIONS)
        if settle:
            time.sleep(0.5)
        return leaders(admin, topic)
    finally:
        admin.close()


def check_read_back(boot: str, topic: str, acked_list: list) -> int:
    """Every acknowledged value read back once, at its acknowledged partition and offset;
    no two acknowledgements of one offset. Returns how many were acknowledged."""
    ends: dict[int, int] = {}
    acked: dict[bytes, tuple[int, int]] = {}
    at: dict[tuple[int, int], bytes] = {}
    for p, off, v, _ in acked_list:
        assert v not in acked, f"value {v!r} acknowledged twice"
        assert (p, off) not in at, f"offset {(p, off)} acknowledged for {at[(p, off)]!r} and {v!r}"
        acked[v] = (p, off)
        at[(p, off)] = v
        ends[p] = max(ends.get(p, 0), off + 1)
    got = read_all(boot, topic, ends)
    where: dict[bytes, list[tuple[int, int]]] = collections.defaultdict(list)
    for p, off, v in got:
        where[v].append((p, off))
    lost = [v for v in acked if v not in where]
    twice = [v for v, w in where.items() if len(w) > 1]
    moved = [v for v, w in acked.items() if v in where and where[v][0] != w]
    assert not lost, f"{len(lost)} acknowledged records lost, e.g. {lost[:5]}"
    assert not twice, f"{len(twice)} values at two offsets, e.g. {twice[:5]}"
    assert not moved, f"{len(moved)} records not at their acknowledged offset, e.g. {moved[:5]}"
    return len(acked)
