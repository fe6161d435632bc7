"""Transactions across the brokers of a cluster (3 broker processes, one file:// object store,
one SQLite database, short leases).

Transactional ids are coordinated by different brokers (FindCoordinator key type 1); a
transaction holds partitions led by every broker; the coordinator writes the markers of
partitions led elsewhere with WriteTxnMarkers and the group's offsets are committed by the
group's coordinator. read_committed readers see exactly the committed transactions. Then the
coordinator of an open transaction is killed (kill -9): the transaction ends (committed by the
producer's retry at the new coordinator, or aborted after its timeout), never half visible, and
a transaction committed before the kill stays committed.
"""
from __future__ import annotations

import collections
import os
import signal
import time

import protocol
import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from clients.e2e_helpers import CLIENT_BROKER_ARGS, JavaCli, compile_java, unique
from datapath.wire import WireClient

from .test_librdkafka import consume_all, txn_producer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PARTITIONS = 6
FLAGS = ("--cluster-lease-ms", "2000", "--cluster-takeover-margin-ms", "500")


def start_cluster(broker_factory, tmp_path, n: int = 3) -> tuple[list, str, KafkaAdminClient]:
    """n brokers on shared stores, their bootstrap list, and an admin client once all are live."""
    shared = ["--object-store", f"file://{tmp_path}/objects",
              "--metadata", f"sqlite:///{tmp_path}/meta.db", "--upload-interval-s", "2",
              *FLAGS, *CLIENT_BROKER_ARGS]
    brokers = [broker_factory(["--node-id", str(i), "--rack", f"r{i}", *shared])
               for i in range(n)]
    boot = ",".join(b.bootstrap for b in brokers)
    admin = KafkaAdminClient(bootstrap_servers=boot)
    wait_for(lambda: len(admin.describe_cluster()["brokers"]) == n, what=f"{n} live brokers")
    return brokers, boot, admin


def wait_for(cond, timeout: float = 60.0, what: str = ""):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            v = cond()
        except Exception as exc:  # noqa: BLE001 - a broker may be going away
            last, v = exc, None
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")


def spread_topic(admin: KafkaAdminClient, topic: str, brokers: int) -> dict[int, int]:
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])

    def leaders():
        d = admin.describe_topics([topic])[0]
        got = {p["partition_index"]: p["leader_id"] for p in d["partitions"]}
        return got if len(got) == PARTITIONS and len(set(got.values())) == brokers else None
    return wait_for(leaders, what=f"{topic} led by all {brokers} brokers")


def coordinator(bootstrap_broker, key: str, key_type: int) -> int:
    """The node FindCoordinator v3 names for a group (key_type 0) or transactional id (1)."""
    with WireClient(bootstrap_broker.host, bootstrap_broker.port, timeout=30) as c:
        r = c.call(protocol.request_class(10)(key=key, key_type=key_type),
                   protocol.response_class(10), 3)
        assert r.error_code == 0, r
        return r.node_id


def txn_coordinator(bootstrap_broker, tid: str) -> int:
    return coordinator(bootstrap_broker, tid, 1)


def group_coordinator(bootstrap_broker, group: str) -> int:
    return coordinator(bootstrap_broker, group, 0)


def apart(brokers: list, make) -> tuple[str, str, int, int]:
    """A (group, transactional id) pair ``make(i)`` whose coordinators are different brokers:
    TxnOffsetCommit then reaches a broker that does not coordinate the transaction."""
    for i in range(200):
        group, tid = make(i)
        g, t = group_coordinator(brokers[0], group), txn_coordinator(brokers[0], tid)
        if g != t:
            return group, tid, g, t
    raise AssertionError("no group/transaction pair on different brokers")


def ids_on_every_broker(brokers: list, prefix: str) -> dict[int, str]:
    """One transactional id coordinated by each broker."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < len(brokers):
        tid = f"{prefix}-{i}"
        out.setdefault(txn_coordinator(brokers[0], tid), tid)
        i += 1
        assert i < 200
    return out


def test_transactions_span_every_broker(broker_factory, tmp_path, java_classpath):
    brokers, boot, admin = start_cluster(broker_factory, tmp_path)
    topic = unique("ctx")
    spread_topic(admin, topic, 3)
    tids = ids_on_every_broker(brokers, unique("ctid"))
    assert sorted(tids) == [0, 1, 2]
    expected: list[str] = []
    for node, tid in sorted(tids.items()):
        p = txn_producer(boot, tid)
        for n, commit in enumerate((True, False, True)):
            p.begin_transaction()
            values = [f"{node}-{n}-{i}" for i in range(PARTITIONS)]
            for i, v in enumerate(values):
                p.produce(topic, v.encode(), partition=i)
            if commit:
                p.commit_transaction(60)
                expected += values
            else:
                assert p.flush(30) == 0   # written (abort_transaction drops unsent records)
                p.abort_transaction(60)
    committed = consume_all(boot, topic, PARTITIONS, "read_committed", expect=len(expected),
                            timeout=60)
    assert sorted(committed) == sorted(expected)
    # read_uncommitted sees the aborted records too (they are in the log)
    assert len(consume_all(boot, topic, PARTITIONS, "read_uncommitted",
                           expect=len(expected) * 3 // 2, timeout=60)) == len(expected) * 3 // 2

    # Java consume-transform-produce with sendOffsetsToTransaction, the group and the
    # transaction coordinated by different brokers (KafkaCli txn: group <prefix>-ctp,
    # transactional id <prefix>-ctp-tid), 3.9 and 4.x (KIP-890 part 2)
    for version in sorted(java_classpath):
        cli = JavaCli(version, compile_java(version, java_classpath[version]))
        base = unique(f"cj{version.replace('.', '')}")
        _g, _t, gnode, tnode = apart(brokers, lambda i: (f"{base}{i}-ctp", f"{base}{i}-ctp-tid"))
        prefix = _g[:-len("-ctp")]
        print(f"java {version}: group at broker {gnode}, transaction at broker {tnode}")
        out = cli("txn", bootstrap=boot, topic=prefix, count=40, timeout=300)
        assert sorted(out["ctp_out"]) == sorted(f"out-{i}" for i in range(40)), out
        assert out["ctp_group_offsets"] == 40, out
        assert out["fence_values"] == ["second"], out
        assert out["zombie_commit"] in {"ProducerFencedException",
                                        "InvalidProducerEpochException"}, out
    admin.close()


def test_coordinator_killed_mid_transaction(broker_factory, tmp_path):
    brokers, boot, admin = start_cluster(broker_factory, tmp_path)
    topic = unique("ckill")
    spread_topic(admin, topic, 3)
    admin.close()
    # an id coordinated by a broker that is not the first (so its bootstrap stays up)
    tids = ids_on_every_broker(brokers, unique("kt"))
    victim = 2
    tid = tids[victim]
    p = txn_producer(boot, tid, **{"transaction.timeout.ms": 8000})
    p.begin_transaction()
    for i in range(PARTITIONS):
        p.produce(topic, f"done-{i}".encode(), partition=i)
    p.commit_transaction(60)
    p.begin_transaction()
    for i in range(PARTITIONS):
        p.produce(topic, f"open-{i}".encode(), partition=i)
    assert p.flush(30) == 0          # every record of the open transaction acknowledged
    os.kill(brokers[victim].proc.pid, signal.SIGKILL)
    brokers[victim].proc.wait(10)
    outcome = "commit"
    try:
        p.commit_transaction(90)     # retried at the id's next coordinator
    except KafkaException as e:
        outcome = f"failed: {e}"     # then the new coordinator aborts it after its timeout
    live = ",".join(b.bootstrap for b in brokers[:victim])
    want_open = [f"open-{i}" for i in range(PARTITIONS)]

    def settled():
        got = consume_all(live, topic, PARTITIONS, "read_committed", timeout=20)
        c = collections.Counter(v.rsplit("-", 1)[0] for v in got)
        return got if c["done"] == PARTITIONS and c["open"] in (0, PARTITIONS) else None
    got = wait_for(settled, timeout=120, what="the open transaction to end")
    assert sorted(v for v in got if v.startswith("done")) == \
        sorted(f"done-{i}" for i in range(PARTITIONS))
    opened = sorted(v for v in got if v.startswith("open"))
    assert opened in ([], sorted(want_open)), got
    if outcome == "commit":
        assert opened == sorted(want_open), got
    print(f"coordinator kill: producer outcome={outcome} open records visible={len(opened)}")


def test_offsets_committed_at_a_remote_group_coordinator(broker_factory, tmp_path):
    """confluent-kafka consume-transform-produce where the group's coordinator is not the
    transaction's: TxnOffsetCommit reaches the group's coordinator, which hands the offsets to
    the transaction; they become the group's only when the transaction commits (the
    coordinator's marker for __consumer_offsets at the group's broker), never on abort."""
    brokers, boot, admin = start_cluster(broker_factory, tmp_path)
    src, dst = unique("rin"), unique("rout")
    spread_topic(admin, src, 3)
    admin.create_topics([NewTopic(dst, PARTITIONS, 1)])
    admin.close()
    base = unique("rg")
    group, tid, gnode, tnode = apart(brokers, lambda i: (f"{base}-g{i}", f"{base}-t{i}"))
    print(f"group {group} at broker {gnode}, transaction {tid} at broker {tnode}")
    plain = Producer({"bootstrap.servers": boot, "log_level": 0})
    for i in range(60):
        plain.produce(src, f"v{i}".encode(), partition=i % PARTITIONS)
    assert plain.flush(30) == 0
    c = Consumer({"bootstrap.servers": boot, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "isolation.level": "read_committed",
                  "log_level": 0})
    c.subscribe([src])
    p = txn_producer(boot, tid)

    def committed() -> dict[int, int]:
        got = c.committed([TopicPartition(src, i) for i in range(PARTITIONS)], timeout=30)
        return {tp.partition: tp.offset for tp in got if tp.offset >= 0}

    def poll_all() -> list:
        msgs, deadline = [], time.monotonic() + 90
        while len(msgs) < 60 and time.monotonic() < deadline:
            msgs += [m for m in c.consume(60, 1.0) if not m.error()]
        assert len(msgs) == 60, len(msgs)
        return msgs

    def unstable_at_group_coordinator() -> set[int]:
        """Partitions OffsetFetch v7 require_stable answers UNSTABLE_OFFSET_COMMIT for, asked
        at the group's coordinator (the transaction holding the offsets is elsewhere)."""
        T = protocol.request_class(9).OffsetFetchRequestTopic
        with WireClient(brokers[gnode].host, brokers[gnode].port, timeout=30) as w:
            r = w.call(protocol.request_class(9)(
                group_id=group, require_stable=True,
                topics=[T(name=src, partition_indexes=list(range(PARTITIONS)))]),
                protocol.response_class(9), 7)
        return {p.partition_index for t in r.topics for p in t.partitions
                if p.error_code == 88}          # UNSTABLE_OFFSET_COMMIT

    def transform(msgs, commit: bool) -> dict[int, int]:
        p.begin_transaction()
        for m in msgs:
            p.produce(dst, m.value().replace(b"v", b"out"), partition=m.partition())
        ends: dict[int, int] = {}
        for m in msgs:
            ends[m.partition()] = max(ends.get(m.partition(), 0), m.offset() + 1)
        p.send_offsets_to_transaction(
            [TopicPartition(src, part, off) for part, off in ends.items()],
            c.consumer_group_metadata(), 30)
        assert unstable_at_group_coordinator() == set(ends)   # pending in the transaction
        if commit:
            p.commit_transaction(60)
        else:
            assert p.flush(30) == 0
            p.abort_transaction(60)
        return ends

    transform(poll_all(), commit=False)
    assert committed() == {}, "an aborted transaction's offsets reached the group"
    for part in range(PARTITIONS):     # reprocess from the group's (absent) offsets
        c.seek(TopicPartition(src, part, 0))
    ends = transform(poll_all(), commit=True)
    assert wait_for(lambda: committed() == ends, timeout=30, what="offsets committed")
    assert unstable_at_group_coordinator() == set()
    c.close()
    out = consume_all(boot, dst, PARTITIONS, "read_committed", expect=60, timeout=60)
    assert sorted(out) == sorted(f"out{i}" for i in range(60))
