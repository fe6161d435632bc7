"""A metadata store (PostgreSQL) that goes away is answered the way Kafka clients expect:
retriable errors on the same connection (never a closed connection), one WARNING for the
outage and one INFO when it is back, and what clients retried lands afterwards.

PostgreSQL sits behind a TcpProxy (tests/tcp_proxy.py) that is cut (connections reset) or
black-holed (connections silent) and then restored.
"""
from __future__ import annotations

import re
import threading
import time

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.protocol.admin import CreateTopicsRequest, CreateTopicsResponse
from kafka.protocol.consumer import (OffsetCommitRequest, OffsetCommitResponse,
                                     OffsetFetchRequest, OffsetFetchResponse)
from kafka.protocol.producer import InitProducerIdRequest, InitProducerIdResponse
from kafka.structs import OffsetAndMetadata

from datapath.wire import WireClient
from tcp_proxy import TcpProxy, proxied_url

pytestmark = pytest.mark.e2e

COORDINATOR_NOT_AVAILABLE, REQUEST_TIMED_OUT, COORDINATOR_LOAD_IN_PROGRESS = 15, 7, 14
ARGS = ["--group-min-session-timeout-ms", "1000", "--group-initial-rebalance-delay-ms", "0"]


def _proxied(postgres) -> tuple[TcpProxy, str]:
    return proxied_url(postgres.new_database())


def _commit(c: WireClient, group: str, topic: str, offset: int, version: int = 8) -> int:
    req = OffsetCommitRequest(
        group_id=group, generation_id_or_member_epoch=-1, member_id="", group_instance_id=None,
        retention_time_ms=-1,
        topics=[OffsetCommitRequest.OffsetCommitRequestTopic(name=topic, partitions=[
            OffsetCommitRequest.OffsetCommitRequestTopic.OffsetCommitRequestPartition(
                partition_index=0, committed_offset=offset, committed_leader_epoch=-1,
                committed_metadata="")])])
    resp = c.call(req, OffsetCommitResponse, version)
    (t,) = resp.topics
    (p,) = t.partitions
    return p.error_code


def _fetch_offset(c: WireClient, group: str, topic: str, version: int = 8) -> tuple[int, int]:
    """(error code of the group, committed offset of partition 0)."""
    G = OffsetFetchRequest.OffsetFetchRequestGroup
    req = OffsetFetchRequest(groups=[G(group_id=group, member_id=None, member_epoch=-1, topics=[
        G.OffsetFetchRequestTopics(name=topic, partition_indexes=[0])])], require_stable=False)
    (g,) = c.call(req, OffsetFetchResponse, version).groups
    offset = g.topics[0].partitions[0].committed_offset if g.topics else -1
    return g.error_code, offset


def _create_topic(c: WireClient, name: str) -> int:
    T = CreateTopicsRequest.CreatableTopic
    req = CreateTopicsRequest(topics=[T(name=name, num_partitions=1, replication_factor=1,
                                        assignments=[], configs=[])],
                              timeout_ms=10000, validate_only=False)
    (t,) = c.call(req, CreateTopicsResponse, 5).topics
    return t.error_code


def _init_producer_id(c: WireClient) -> int:
    req = InitProducerIdRequest(transactional_id=None, transaction_timeout_ms=60000,
                                producer_id=-1, producer_epoch=-1)
    return c.call(req, InitProducerIdResponse, 4).error_code


def _ended_log(broker, timeout: float = 30.0) -> str:
    """The broker's log once the outage episode has ended (the first call answered 2 s after
    the last failure ends it: the broker's own calls, e.g. its lease renewal every second)."""
    deadline = time.monotonic() + timeout
    while True:
        text = broker.log_text()
        if "episode=metadata_unreachable state=ended" in text or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def _episode_lines(text: str) -> tuple[list[str], list[str]]:
    started = re.findall(r".*episode=metadata_unreachable state=started.*", text)
    ended = re.findall(r".*episode=metadata_unreachable state=ended.*", text)
    return started, ended


def test_pg_cut_answers_retriable_errors_on_the_same_connection(broker_factory, postgres):
    """While PostgreSQL is cut: OffsetCommit/OffsetFetch answer COORDINATOR_NOT_AVAILABLE,
    CreateTopics REQUEST_TIMED_OUT, InitProducerId COORDINATOR_LOAD_IN_PROGRESS - all on one
    connection that stays open; a kafka-python commit started during the cut lands once the
    database is back; the log has one WARNING for the outage, one INFO at its end, no ERROR."""
    proxy, url = _proxied(postgres)
    broker = broker_factory([*ARGS, "--metadata", url])
    c = WireClient(broker.host, broker.port, timeout=60, client_id="outage-test")
    try:
        assert _create_topic(c, "ot") == 0
        assert _commit(c, "og", "ot", 3) == 0
        assert _fetch_offset(c, "og", "ot") == (0, 3)

        proxy.cut()
        assert _commit(c, "og", "ot", 5) == COORDINATOR_NOT_AVAILABLE
        assert _commit(c, "og", "ot", 5, version=2) == COORDINATOR_NOT_AVAILABLE
        assert _create_topic(c, "ot2") == REQUEST_TIMED_OUT
        assert _init_producer_id(c) == COORDINATOR_LOAD_IN_PROGRESS
        # a real client's synchronous commit keeps retrying through the outage
        consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id="kp",
                                 enable_auto_commit=False, request_timeout_ms=30000,
                                 retry_backoff_ms=200)
        outcome: list[object] = []

        def commit() -> None:
            try:
                consumer.commit({TopicPartition("ot", 0): OffsetAndMetadata(7, "", -1)})
                outcome.append("ok")
            except Exception as exc:  # noqa: BLE001 - reported below
                outcome.append(exc)

        t = threading.Thread(target=commit)
        t.start()
        time.sleep(3.0)
        assert _commit(c, "og", "ot", 5) == COORDINATOR_NOT_AVAILABLE   # same connection
        proxy.restore()
        t.join(60)
        assert outcome == ["ok"], outcome
        assert consumer.committed(TopicPartition("ot", 0)) == 7
        consumer.close()

        # the same raw connection: everything works again
        _until_commits_work(c, "og", "ot", 30)
        assert _create_topic(c, "ot2") == 0
        assert _init_producer_id(c) == 0
        text = _ended_log(broker)
    finally:
        c.close()
        proxy.close()
    assert "handler failed" not in text and "closing connection" not in text, text[-3000:]
    started, ended = _episode_lines(text)
    assert len(started) == 1 and "level=WARNING" in started[0], started
    assert len(ended) == 1 and "level=INFO" in ended[0], ended
    errors = [ln for ln in text.splitlines() if "level=ERROR" in ln]
    assert not errors, errors[:5]


def _until_commits_work(c: WireClient, group: str, topic: str, timeout: float) -> None:
    """After the store is back: commit offset 5 until it is accepted (within ``timeout`` s),
    then read it back."""
    deadline = time.monotonic() + timeout
    while _commit(c, group, topic, 5) != 0:
        assert time.monotonic() < deadline, "commits still refused after the restore"
        time.sleep(0.2)
    assert _fetch_offset(c, group, topic) == (0, 5)


@pytest.mark.slow
def test_black_holed_pg_fails_a_commit_within_a_bound_then_recovers(broker_factory, postgres):
    """PostgreSQL black-holed (connections silent, as on a dropped route; the proxy's kernel
    still acknowledges, so TCP keepalives and tcp_user_timeout cannot see it - the broker's
    call watch cuts a call running longer than the lease, at least 5 s): an OffsetCommit is
    answered COORDINATOR_NOT_AVAILABLE within a bound instead of hanging for TCP's
    retransmission timeout, and commits work again once the route is back."""
    proxy, url = _proxied(postgres)
    lease_ms = 4000
    broker = broker_factory([*ARGS, "--metadata", url, "--cluster-lease-ms", str(lease_ms)])
    c = WireClient(broker.host, broker.port, timeout=90, client_id="outage-test")
    try:
        assert _create_topic(c, "bh") == 0
        assert _commit(c, "bg", "bh", 3) == 0
        proxy.blackhole()
        t0 = time.monotonic()
        assert _commit(c, "bg", "bh", 5) == COORDINATOR_NOT_AVAILABLE
        took = time.monotonic() - t0
        # the call watch (5 s) + a reconnect attempt (connect timeout 5 s) at most + slack
        assert took < 30, f"a commit during a black hole took {took:.1f} s"
        proxy.restore()
        _until_commits_work(c, "bg", "bh", 60)
        text = _ended_log(broker)
    finally:
        c.close()
        proxy.close()
    assert "handler failed" not in text, text[-3000:]
    started, _ = _episode_lines(text)
    assert len(started) == 1, started      # calls cut after the restore: the same episode
    print(f"\ncommit during the black hole answered COORDINATOR_NOT_AVAILABLE in {took:.1f} s")


@pytest.mark.slow
def test_pg_cut_under_confluent_and_java_groups(broker_factory, postgres, java_classpath):
    """Real clients through a PostgreSQL cut shorter than the lease: a confluent-kafka group
    member committing synchronously after every batch sees only retriable commit errors and
    never a connection closed by the broker; a Java consumer group (kafka-clients 3.9) joining,
    reading and committing while the database is cut finishes with its offsets committed; the
    broker logs one WARNING/INFO episode and no ERROR."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
    from confluent_kafka import TopicPartition as CkTopicPartition

    from clients.e2e_helpers import JavaCli, compile_java

    version = "3.9" if "3.9" in java_classpath else sorted(java_classpath)[0]
    java = JavaCli(version, compile_java(version, java_classpath[version]))
    proxy, url = _proxied(postgres)
    broker = broker_factory([*ARGS, "--metadata", url])
    boot = broker.bootstrap
    try:
        with WireClient(broker.host, broker.port, timeout=60) as c:
            T = CreateTopicsRequest.CreatableTopic
            req = CreateTopicsRequest(topics=[T(name="cj", num_partitions=2, replication_factor=1,
                                                assignments=[], configs=[])],
                                      timeout_ms=10000, validate_only=False)
            assert c.call(req, CreateTopicsResponse, 5).topics[0].error_code == 0
        p = Producer({"bootstrap.servers": boot, "enable.idempotence": True, "linger.ms": 5})
        for i in range(400):
            p.produce("cj", value=b"v%04d" % i, partition=i % 2)
        assert p.flush(30) == 0
        consumer = Consumer({"bootstrap.servers": boot, "group.id": "ck-outage",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest",
                             "session.timeout.ms": 10000, "fetch.wait.max.ms": 100})
        consumer.subscribe(["cj"])
        commit_errors: list[KafkaError] = []
        got = 0

        def poll_and_commit(seconds: float) -> None:
            nonlocal got
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for i in range(10):              # records keep coming: commits keep going
                    p.produce("cj", value=b"w%d" % i, partition=i % 2)
                p.poll(0)
                msgs = consumer.consume(20, 0.2)
                got += sum(1 for m in msgs if not m.error())
                if msgs:
                    try:
                        consumer.commit(asynchronous=False)
                    except KafkaException as exc:
                        commit_errors.append(exc.args[0])

        poll_and_commit(3.0)
        proxy.cut()
        jproc = java.start("consume-group", bootstrap=boot, topic="cj", group="java-outage",
                           count=400, timeout_ms=60000)
        poll_and_commit(5.0)
        proxy.restore()
        poll_and_commit(3.0)
        result = java.finish(jproc, timeout=120)
        assert sum(v for v in result["committed"].values()) >= 400, result["committed"]
        assert p.flush(30) == 0
        # everything the confluent member read is committed once the database is back
        deadline = time.monotonic() + 30
        while True:
            try:
                consumer.commit(asynchronous=False)
                break
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError._NO_OFFSET:
                    break
                commit_errors.append(exc.args[0])
                assert time.monotonic() < deadline, commit_errors[-3:]
                time.sleep(0.5)
        positions = consumer.position([CkTopicPartition("cj", 0), CkTopicPartition("cj", 1)])
        committed = consumer.committed([CkTopicPartition("cj", 0), CkTopicPartition("cj", 1)],
                                       timeout=30)
        assert [t.offset for t in committed] == [t.offset for t in positions]
        consumer.close()
        text = _ended_log(broker)
    finally:
        proxy.close()
    retriable = {KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
                 KafkaError._WAIT_COORD, KafkaError.COORDINATOR_LOAD_IN_PROGRESS}
    assert all(e.code() in retriable for e in commit_errors), commit_errors
    assert "handler failed" not in text and "closing connection" not in text, text[-3000:]
    started, ended = _episode_lines(text)
    assert len(started) == 1 and len(ended) == 1, (started, ended)
    errors = [ln for ln in text.splitlines() if "level=ERROR" in ln]
    assert not errors, errors[:5]
    print(f"\nconfluent member read {got}, commit errors during the cut: "
          f"{sorted({e.name() for e in commit_errors})}; java committed {result['committed']}")
