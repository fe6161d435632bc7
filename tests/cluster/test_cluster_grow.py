"""A cluster's life under all three client libraries: it grows from 2 to 3 brokers, a partition
is reassigned, the coordinator of a group is stopped with SIGTERM (its groups move to another
broker and carry on) and started again, while Java kafka-clients, confluent-kafka and
kafka-python each produce (idempotent, acks=all) and consume in a group.

The joining broker gets its share of partitions (moves, no data copy); the clients follow the
moves (NOT_LEADER answers, metadata refreshes, OffsetForLeaderEpoch after each epoch bump: a
false truncation would reset or duplicate). Checked at the end: every acknowledged record is in
the log exactly once at the offset it was acknowledged with, each producer's records in send
order per partition; every group read every record, in offset order per partition (a group
may re-read from its committed offsets after a coordinator change, never skip); the groups'
committed offsets are the log ends and read back from the broker that joined. SQLite only:
the metadata store is exercised on both backends by test_cluster.py, and PostgreSQL would
double this test's time.
"""
from __future__ import annotations

import collections
import pathlib
import threading
import time

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka import TopicPartition as CTP
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

import protocol
from clients.e2e_helpers import JavaCli, compile_java
from datapath.wire import WireClient

from .kit import KAFKA_PYTHON_GROUP_FLAGS, leaders, read_all, wait_for

pytestmark = pytest.mark.slow

PARTITIONS = 6
JAVA_COUNT = 6000          # paced 10 records / 40 ms: at least 24 s, past the reassignment
PY_COUNT = 3000            # each Python producer, 100 records/s: at least 30 s
PER_S = 100
# quick session timeouts (as the client tests), and Kafka's first-join delay for the
# kafka-python member (kit.py) instead of their 0
BROKER_ARGS = ("--group-min-session-timeout-ms", "1000", *KAFKA_PYTHON_GROUP_FLAGS)


@pytest.fixture
def metadata_url(tmp_path: pathlib.Path) -> str:
    """SQLite only (see the module docstring)."""
    return f"sqlite:///{tmp_path}/meta.db"


class PacedProducer:
    """An idempotent acks=all producer of PY_COUNT unique values "<kind>-<i>", paced:
    confluent-kafka (``kind="c"``) or kafka-python (``kind="k"``)."""

    def __init__(self, kind: str, bootstrap: str, topic: str) -> None:
        self.kind = kind
        self.acked: list[tuple[int, int, bytes]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        if kind == "c":
            self._p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                                "acks": "all", "linger.ms": 5, "message.timeout.ms": 60000,
                                "topic.metadata.refresh.interval.ms": 1000})
        else:
            self._p = KafkaProducer(bootstrap_servers=bootstrap.split(","), acks="all",
                                    enable_idempotence=True, linger_ms=5,
                                    metadata_max_age_ms=1000, delivery_timeout_ms=60000)
        self._t = threading.Thread(target=self._run, args=(topic,), daemon=True)
        self._t.start()

    def _cb(self, err, msg) -> None:       # confluent-kafka
        if err is not None:
            self.errors.append(str(err))
        else:
            self.acked.append((msg.partition(), msg.offset(), msg.value()))

    def _run(self, topic: str) -> None:
        i = 0
        while not self._stop.is_set() and i < PY_COUNT:
            for _ in range(10):
                value = f"{self.kind}-{i}".encode()
                if self.kind == "c":
                    self._p.produce(topic, key=value, value=value, on_delivery=self._cb)
                else:
                    f = self._p.send(topic, key=value, value=value)
                    f.add_callback(lambda md, v=value: self.acked.append(
                        (md.partition, md.offset, v)))
                    f.add_errback(lambda e: self.errors.append(repr(e)))
                i += 1
            if self.kind == "c":
                self._p.poll(0)
            time.sleep(10 / PER_S)
        self._p.flush(60)
        if self.kind == "k":
            self._p.close(10)

    @property
    def running(self) -> bool:
        return self._t.is_alive()

    def join(self) -> None:
        self._t.join(120)


class GroupMember:
    """One consumer in a group, committing as it goes: confluent-kafka or kafka-python."""

    def __init__(self, kind: str, bootstrap: str, topic: str, group: str) -> None:
        self.kind = kind
        self.seen: list[tuple[int, int, bytes]] = []
        self._stop = threading.Event()
        if kind == "c":
            self._c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                                "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                "topic.metadata.refresh.interval.ms": 1000,
                                "session.timeout.ms": 10000})
            self._c.subscribe([topic])
        else:
            self._c = KafkaConsumer(topic, bootstrap_servers=bootstrap.split(","),
                                    group_id=group, auto_offset_reset="earliest",
                                    enable_auto_commit=False, metadata_max_age_ms=1000,
                                    session_timeout_ms=10000, heartbeat_interval_ms=1000)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _poll(self) -> list[tuple[int, int, bytes]]:
        if self.kind == "c":
            m = self._c.poll(0.2)
            return [] if m is None or m.error() else [(m.partition(), m.offset(), m.value())]
        got = self._c.poll(timeout_ms=200)
        return [(r.partition, r.offset, r.value) for recs in got.values() for r in recs]

    def _commit(self) -> None:
        if self.kind == "c":
            try:
                self._c.commit(asynchronous=False)
            except KafkaException as e:
                if e.args[0].code() != KafkaError._NO_OFFSET:   # all committed already
                    raise
        else:
            self._c.commit()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            for r in self._poll():
                self.seen.append(r)
                n += 1
            if n >= 50:
                n = 0
                try:
                    self._commit()
                except Exception:  # noqa: BLE001 - a commit during a coordinator move: next one
                    pass

    def finish(self) -> None:
        self._stop.set()
        self._t.join(30)
        self._commit()
        self._c.close()


def coordinator(brokers: list, group: str) -> int:
    """The node id FindCoordinator v3 names for ``group``, asked of the first broker that
    answers (-1 on an error answer, e.g. COORDINATOR_NOT_AVAILABLE while groups move)."""
    for b in brokers:
        host, port = b.bootstrap.split(":")
        try:
            with WireClient(host, int(port), timeout=5) as c:
                r = c.call(protocol.request_class(10)(key=group, key_type=0),
                           protocol.response_class(10), 3)
        except OSError:
            continue            # a stopped broker: ask the next
        return r.node_id if r.error_code == 0 else -1
    return -1


def read_in_order(seen: list[tuple[int, int, bytes]], log: list[tuple[int, int, bytes]],
                  who: str) -> None:
    """``seen`` holds every record of ``log`` and, per partition, goes forward one offset at
    a time (a re-read after a group change starts at or before where it was; never a skip)."""
    assert set(seen) >= set(log), (who, len(set(log) - set(seen)), sorted(set(log) - set(seen))[:5])
    assert set(seen) <= set(log), (who, sorted(set(seen) - set(log))[:5])
    last: dict[int, int] = {}
    for p, o, _ in seen:
        prev = last.get(p, -1)
        assert o <= prev + 1, f"{who}: partition {p} skipped from {prev} to {o}"
        last[p] = o


def test_cluster_grows_moves_and_restarts_under_three_clients(cluster_factory, java_classpath):
    version = sorted(java_classpath)[-1]
    cli = JavaCli(version, compile_java(version, java_classpath[version]))
    brokers = cluster_factory(2, extra=BROKER_ARGS)
    boot = ",".join(b.bootstrap for b in brokers)
    admin = KafkaAdminClient(bootstrap_servers=boot)
    wait_for(lambda: len(admin.describe_cluster()["brokers"]) == 2, what="2 live brokers")
    time.sleep(0.5)       # every broker's view follows the database within a poll interval
    admin.create_topics([NewTopic("grow", PARTITIONS, 2)])
    wait_for(lambda: collections.Counter(
        leader for leader, _ in leaders(admin, "grow").values()) == {0: 3, 1: 3},
        what="6 partitions on 2 brokers")

    total = JAVA_COUNT + 2 * PY_COUNT
    jconsumer = cli.start("consume-group", bootstrap=boot, topic="grow", group="jg",
                          count=total, timeout_ms=150000)
    jproducer = cli.start("produce", bootstrap=boot, topic="grow", count=JAVA_COUNT,
                          prefix="j", pace_ms=40, delivery_timeout_ms=60000)
    groups = {"cg": GroupMember("c", boot, "grow", "cg"), "kg": GroupMember("k", boot, "grow", "kg")}
    producers: list[PacedProducer] = []

    def progress(what: str, parts: set[int] | None = None, n: int = 100) -> None:
        """Both Python producers get ``n`` more acks (on ``parts`` if given), or are done."""
        marks = [len(p.acked) for p in producers]
        for p, m in zip(producers, marks):
            wait_for(lambda: sum(1 for q, _, _ in p.acked[m:] if parts is None or q in parts)
                     >= n or (not p.running and len(p.acked) == PY_COUNT), timeout=45,
                     what=f"{what}: {p.kind} acks (errors {p.errors[:3]})")

    def java_acked() -> int:
        """Records in the log (the Java producer's: the Python ones start after these)."""
        c = Consumer({"bootstrap.servers": boot, "group.id": "ends"})
        try:
            return sum(c.get_watermark_offsets(CTP("grow", p), timeout=10)[1]
                       for p in range(PARTITIONS))
        finally:
            c.close()

    third = None
    try:
        # a JVM starts slowly on a loaded machine (~45 s at load 57): the Python producers
        # start once it produces, so the moves below happen under all three
        wait_for(lambda: java_acked() >= 100, timeout=120, what="the Java producer's first acks")
        producers += [PacedProducer("c", boot, "grow"), PacedProducer("k", boot, "grow")]
        progress("first acks")

        # 1. the third broker joins: the controller moves partitions to it until balanced
        (third,) = cluster_factory(1, first_id=2, extra=BROKER_ARGS)
        boot3 = boot + "," + third.bootstrap

        # (the admin client may ask any broker; each follows the database within a poll)
        def balanced() -> dict[int, tuple[int, int]] | None:
            now = leaders(admin, "grow")
            led = collections.Counter(leader for leader, _ in now.values())
            return now if led.get(2) == 2 and set(led) == {0, 1, 2} else None
        now = wait_for(balanced, what="leaders on all 3 brokers")
        moved = {p for p, (leader, _) in now.items() if leader == 2}
        assert all(now[p][1] >= 1 for p in moved), now
        progress("acks from the joined broker", moved, 20)
        assert jproducer.poll() is None, "the Java producer finished before the join: no test"

        # 2. a reassignment: partition q moves to the next broker at epoch + 1
        q = next(p for p, (leader, _) in now.items() if leader != 2)
        old, epoch = now[q]
        target = (old + 1) % 3
        admin.alter_partition_reassignments({TopicPartition("grow", q): [target]})
        wait_for(lambda: leaders(admin, "grow")[q] == (target, epoch + 1), what=f"move of p{q}")
        progress("acks after the reassignment", {q}, 20)

        # 3. SIGTERM the coordinator of group kg (controlled shutdown: its partitions and
        # groups move first), then restart it: every group carries on
        assert all(p.running for p in producers), "a producer finished before the SIGTERM"
        everyone = [brokers[0], brokers[1], third]
        down = coordinator(everyone, "kg")
        by_id = {0: brokers[0], 1: brokers[1], 2: third}
        by_id[down].stop()
        wait_for(lambda: all(leader != down for leader, _ in leaders(admin, "grow").values()),
                 what=f"no partition led by the stopped broker {down}")
        wait_for(lambda: coordinator(everyone, "kg") not in (down, -1),
                 what="another coordinator for group kg")
        progress("acks after the SIGTERM")
        by_id[down].start()
        wait_for(lambda: collections.Counter(
            leader for leader, _ in leaders(admin, "grow").values()).get(down, 0) >= 1,
            what=f"broker {down} leading partitions again")
        led = {p for p, (leader, _) in leaders(admin, "grow").items() if leader == down}
        progress("acks from the restarted broker", led, 20)

        jprod = cli.finish(jproducer, timeout=120)
        for p in producers:
            p.join()
        jcons = cli.finish(jconsumer, timeout=180)
    finally:
        for proc in (jproducer, jconsumer):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for p in producers:
            p._stop.set()

    assert jprod["errors"] == [] and jprod["acked"] == JAVA_COUNT, jprod["errors"][:5]
    for p in producers:
        assert not p.errors and len(p.acked) == PY_COUNT, (p.kind, p.errors[:5])
    ends = {p: 0 for p in range(PARTITIONS)}
    for p, offs in jprod["offsets"].items():
        ends[int(p)] = max(ends[int(p)], max(offs) + 1)
    for prod in producers:
        for p, off, _ in prod.acked:
            ends[p] = max(ends[p], off + 1)
    assert sum(ends.values()) == total

    # the log: every acknowledged record exactly once, at its acknowledged offset, each
    # producer's records in the order it sent them
    log = sorted(read_all(boot3, "grow", ends))
    assert len(log) == total and len({v for _, _, v in log}) == total
    for prod in producers:
        mine = [r for r in log if r[2].startswith(f"{prod.kind}-".encode())]
        assert mine == sorted(prod.acked), prod.kind
    for p in range(PARTITIONS):
        java = [(o, int(v[2:])) for q, o, v in log if q == p and v.startswith(b"j-")]
        assert sorted(o for o, _ in java) == sorted(jprod["offsets"].get(str(p), [])), p
        for prefix in (b"j-", b"c-", b"k-"):
            seq = [int(v[2:]) for q, _, v in log if q == p and v.startswith(prefix)]
            assert seq == sorted(seq), f"{prefix!r} records out of order in partition {p}"

    # the groups read every record in order per partition (re-reads allowed, no skips)
    got = [(r["p"], r["o"], r["v"].encode()) for r in jcons["records"]]
    read_in_order(got, log, "java group")
    assert {int(p): o for p, o in jcons["committed"].items()} == ends
    for name, member in groups.items():
        wait_for(lambda m=member: set(m.seen) >= set(log), timeout=60,
                 what=f"group {name} catching up")
        member.finish()
        read_in_order(member.seen, log, f"group {name}")

    # committed offsets survive: read through the broker that joined
    admin.close()
    admin = KafkaAdminClient(bootstrap_servers=third.bootstrap)
    for g in ("jg", "cg", "kg"):
        committed = admin.list_group_offsets(g)[g]
        assert {tp.partition: om.offset for tp, om in committed.items()} == ends, g
    admin.close()
