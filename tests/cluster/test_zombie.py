"""Fencing on real processes, from the chaos suite's findings (docs/FINDINGS.md, 17:40/17:58):

- a zombie (SIGSTOP past the lease, fenced and taken over while stopped) that resumes with
  Produce and Fetch requests queued in its sockets acknowledges none and serves none of them
  (its lease, on its monotonic clock, lapsed while it was stopped);
- a PostgreSQL outage longer than lease + margin, shared by every broker, fences nobody (a
  controller cut off itself cannot tell a dead broker from one cut off as it was);
- a fenced broker restarted while its taker still holds its WAL waits for the takeover
  instead of exiting 1 with "WAL ... is in use by another broker".

Short lease (2 s) and margin (0.5 s); confluent-kafka idempotent acks=all producers; every
acknowledged record must be read back exactly once at its acknowledged offset.
"""
from __future__ import annotations

import contextlib
import re
import signal
import socket
import time
from collections.abc import Iterator

import pytest
from kafka.protocol.consumer import FetchResponse
from kafka.protocol.producer import ProduceResponse

from datapath.batches import make_batch
from datapath.wire import WireClient

from .kit import FAILOVER_FLAGS, ask, brokers_behind_proxy, read_all, wait_for
from .timed_load import PARTITIONS, TimedLoad, check_read_back, create_topic

pytestmark = pytest.mark.slow

FLAGS = (*FAILOVER_FLAGS, "--upload-interval-s", "30")
NOT_LEADER_OR_FOLLOWER = 6


def end_offsets(boot: str, topic: str) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition  # noqa: PLC0415
    c = Consumer({"bootstrap.servers": boot, "group.id": "ends"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(PARTITIONS)}
    finally:
        c.close()


@contextlib.contextmanager
def load_then_read_back(boot: str, topic: str) -> Iterator[TimedLoad]:
    """A TimedLoad on a new topic, producing to every partition on entry; on a clean exit every
    acknowledged record must be read back once at its acknowledged offset."""
    create_topic(boot, topic, live=2)
    load = TimedLoad(boot, topic)
    try:
        load.wait_every_partition()
        yield load
    finally:
        load.stop()
    assert not load.errors, load.errors[:5]
    print(f"acknowledged {check_read_back(boot, topic, load.acked)} records, all read back once")


def restarted_after_its_takeover(brokers: list, load: TimedLoad) -> str:
    """Broker 1's log since its restart, which waited for broker 0's takeover of its WAL and
    then formatted a fresh one at node epoch 1; producers go on being acknowledged."""
    text1 = brokers[1].log_text().rsplit("===== start", 1)[1]
    # by broker 0, or (read in the few ms between a failed attempt of broker 0's - the WAL
    # still locked - and the controller's next pick: CI, session 22) by the next taker
    assert re.search(r"waiting for the takeover of this node's WAL by (broker 0|the next "
                     r"taker)", text1), text1[-2000:]
    assert "formatting it afresh node_epoch=1" in text1, text1[-2000:]
    assert "takeover finished node_id=1 " in brokers[0].log_text()
    n = len(load.acked)
    wait_for(lambda: len(load.acked) > n + 200, what="acks after the restart")
    return text1


def test_zombie_after_sigcont_acknowledges_and_serves_nothing(cluster_factory, metadata_url):
    """Broker 1 is stopped past its lease with raw Produce (acks=-1) and Fetch requests sent
    to it while stopped, is fenced and taken over; after SIGCONT every queued Produce is
    answered NOT_LEADER_OR_FOLLOWER (or the connection closes), no Fetch returns records, it
    exits 4, none of the zombie's values exist in the log, and every acknowledged value of the
    idempotent producer running throughout is read back once at its offset."""
    if metadata_url.startswith("sqlite"):
        # stopped inside a write transaction, it would keep SQLite's file lock and nobody could
        # fence it (docs/cluster.md); PostgreSQL ends that session's transaction
        pytest.skip("a stopped broker may hold SQLite's write lock: PostgreSQL only")
    brokers = cluster_factory(2, extra=FLAGS)
    boot = ",".join(b.bootstrap for b in brokers)
    before = create_topic(boot, "zb", live=2, settle=True)
    victim = brokers[1]
    mine = sorted(p for p, (lead, _) in before.items() if lead == 1)
    assert mine, before
    load = TimedLoad(boot, "zb")
    produce = WireClient(victim.host, victim.port, timeout=30)
    fetch = WireClient(victim.host, victim.port, timeout=30)
    try:
        load.wait_every_partition()
        time.sleep(0.5)
        victim.proc.send_signal(signal.SIGSTOP)
        # queued in the stopped broker's sockets: 5 Produce requests, 2 Fetch requests
        corrs = [produce.send(produce.produce_request("zb", {
            p: make_batch([f"zombie-{i}-{p}".encode()]) for p in mine}), 9) for i in range(5)]
        fcorrs = [fetch.send(fetch.fetch_request("zb", 0, partition=p), 11) for p in mine[:2]]
        wait_for(lambda: "partitions reassigned node_id=1 " in brokers[0].log_text(),
                 timeout=40, what="broker 1 fenced and its partitions reassigned")
        n = len(load.acked)
        wait_for(lambda: len(load.acked) > n + 100, what="acks from the new leader")
        victim.proc.send_signal(signal.SIGCONT)
        answered = refused = 0
        for corr in corrs:
            try:
                resp = produce.recv(ProduceResponse, 9, corr)
            except (ConnectionError, socket.timeout):
                break            # it exited (fenced) before answering the rest: not acked
            answered += 1
            for t in resp.responses:
                for pr in t.partition_responses:
                    assert pr.error_code == NOT_LEADER_OR_FOLLOWER, \
                        f"the zombie answered {pr} after SIGCONT"
                    refused += 1
        served = 0
        for corr in fcorrs:
            try:
                resp = fetch.recv(FetchResponse, 11, corr)
            except (ConnectionError, socket.timeout):
                break
            pr = resp.responses[0].partitions[0]
            assert pr.error_code == NOT_LEADER_OR_FOLLOWER and not pr.records, \
                f"the zombie served a Fetch after SIGCONT: {pr.error_code}"
            served += 1
        assert victim.proc.wait(20) == 4
        zombie = victim.log_text()
        assert "this broker was fenced" in zombie
        print(f"\nzombie after SIGCONT: {answered} of {len(corrs)} queued Produce answered "
              f"({refused} partitions refused), {served} of {len(fcorrs)} Fetch answered "
              f"(refused); lease lapse logged: {'lease lapsed' in zombie}")
        n = len(load.acked)
        wait_for(lambda: len(load.acked) > n + 100, what="acks after the zombie exited")
    finally:
        produce.close()
        fetch.close()
        load.stop()
    assert not load.errors, load.errors[:5]
    survivor = brokers[0].bootstrap
    got = read_all(survivor, "zb", end_offsets(survivor, "zb"))
    ghosts = [(p, o, v) for p, o, v in got if v.startswith(b"zombie-")]
    assert not ghosts, f"values the zombie received after its lease are in the log: {ghosts[:5]}"
    print(f"acknowledged {check_read_back(survivor, 'zb', load.acked)} records, all read back "
          f"once")


def test_metadata_outage_longer_than_lease_fences_nobody(broker_factory, tmp_path, metadata_url):
    """PostgreSQL unreachable for every broker (one TCP proxy cut) for lease + margin + 1.5 s:
    every broker stops acknowledging within its lease, and after the database is back nobody
    is fenced, both brokers keep running and acknowledging, nothing acknowledged is lost."""
    if metadata_url.startswith("sqlite"):
        pytest.skip("a database outage through a TCP proxy: PostgreSQL only")
    proxy, brokers = brokers_behind_proxy(broker_factory, tmp_path, metadata_url, FLAGS)
    boot = ",".join(b.bootstrap for b in brokers)
    create_topic(boot, "pg", live=2)
    load = TimedLoad(boot, "pg")
    try:
        load.wait_every_partition()
        time.sleep(1.0)
        proxy.cut()
        time.sleep(2.0 + 0.5 + 1.5)
        proxy.restore()
        t_back = time.monotonic()
        wait_for(lambda: len([1 for *_, t in list(load.acked) if t > t_back]) > 300,
                 timeout=30, what="acks after the database is back")
        time.sleep(3.0)      # past lease + margin after the database came back
        logs = "\n".join(b.log_text() for b in brokers)
        assert all(b.running for b in brokers), logs[-3000:]
        assert "broker fenced" not in logs, re.findall(r".*broker fenced.*", logs)
        assert "lease lapsed" in logs          # they did stop acknowledging meanwhile
        live = ask(boot, lambda a: len(a.describe_cluster()["brokers"]))
        assert live == 2
    finally:
        load.stop()
        proxy.close()
    assert not load.errors, load.errors[:5]
    print(f"\nacknowledged {check_read_back(boot, 'pg', load.acked)} records, all read back "
          f"once; nobody fenced after a {2.0 + 0.5 + 1.5:.1f} s database outage")


def test_fenced_node_restarted_during_its_takeover_waits_for_it(broker_factory, cluster_factory,
                                                                metadata_url):
    """Broker 1 is killed; broker 0 takes its WAL over and sits in the middle of it (a pause
    point, holding the WAL's lock); broker 1 restarted meanwhile waits for the takeover (logged)
    instead of exiting 1, then starts at node epoch 1 on a fresh WAL; nothing acknowledged lost."""
    if not metadata_url.startswith("sqlite"):
        pytest.skip("the takeover path is the same on PostgreSQL; SQLite keeps this lean")
    brokers = [broker_factory(["--node-id", "0", "--rack", "r0", *cluster_factory.shared, *FLAGS],
                              env={"S3KAFKA_PAUSE_POINT": "takeover_before_commit",
                                   "S3KAFKA_PAUSE_S": "6"})]
    brokers += cluster_factory(1, first_id=1, extra=FLAGS)
    boot = ",".join(b.bootstrap for b in brokers)
    with load_then_read_back(boot, "rs") as load:
        time.sleep(0.5)
        brokers[1].kill()
        wait_for(lambda: "pause point takeover_before_commit" in brokers[0].log_text(),
                 timeout=40, what="broker 0 in the middle of taking over broker 1")
        t0 = time.monotonic()
        brokers[1].start()           # returns once it answers; raised if it exited
        waited = time.monotonic() - t0
        restarted_after_its_takeover(brokers, load)
        print(f"\nrestart during the takeover: waited, answered {waited:.1f} s after the start")


def test_restart_that_locked_its_wal_before_the_fence_lets_the_taker_in(broker_factory,
                                                                        cluster_factory,
                                                                        metadata_url):
    """Broker 1 is killed and restarted at once: the restart locks its WAL before the
    controller fences the node (a pause point holds it right there, as a slow start would),
    then finds the row fenced. It must give the WAL's lock up while it waits, or the taker
    can never open the WAL and the restart waits for a takeover it blocks (a livelock seen by
    the chaos suite, FINDINGS rack-land 20:25). Then it starts at node epoch 1 on a fresh WAL;
    nothing acknowledged is lost."""
    if not metadata_url.startswith("sqlite"):
        pytest.skip("the takeover path is the same on PostgreSQL; SQLite keeps this lean")
    # a 12 s lease: the restart (interpreter start included: 2-6 s at load 20) locks the WAL
    # before the fence
    brokers = cluster_factory(2, extra=("--cluster-lease-ms", "12000",
                                        "--cluster-takeover-margin-ms", "500",
                                        "--upload-interval-s", "30"))
    boot = ",".join(b.bootstrap for b in brokers)
    with load_then_read_back(boot, "rl") as load:
        time.sleep(0.5)
        brokers[1].kill()
        brokers[1].env = {**(brokers[1].env or {}), "S3KAFKA_PAUSE_POINT": "startup_wal_locked",
                          "S3KAFKA_PAUSE_S": "17"}
        brokers[1].start()   # returns once it answers; raises if it exited or hung 60 s
        text1 = restarted_after_its_takeover(brokers, load)
        assert "pause point startup_wal_locked" in text1, text1[-2000:]
