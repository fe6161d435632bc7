"""kafka-python 3.x, unmodified, against s3kafka."""
from __future__ import annotations

import time

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import (ConfigResource, ConfigResourceType, KafkaAdminClient, NewPartitions,
                         NewTopic)
from kafka.errors import TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from clients.e2e_helpers import (ACKS, CODECS, group_of_three_then_resume, kp_poll_records,
                                 produce_values, unique)

pytestmark = pytest.mark.e2e
N = 20


def _acks(a: str) -> int | str:
    return "all" if a == "all" else int(a)


def consume_partition(bootstrap: str, topic: str, count: int, partition: int = 0) -> list:
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                      auto_offset_reset="earliest")
    try:
        tp = TopicPartition(topic, partition)
        c.assign([tp])
        c.seek_to_beginning(tp)
        return kp_poll_records(c, count)
    finally:
        c.close()


def test_produce_every_acks_and_codec(cbroker, topic_name):
    for acks in ACKS:
        for codec in CODECS:
            p = KafkaProducer(bootstrap_servers=cbroker.bootstrap, acks=_acks(acks),
                              compression_type=None if codec == "none" else codec,
                              enable_idempotence=acks == "all", linger_ms=5)
            futs = [p.send(topic_name, value=f"{acks}-{codec}-{i}".encode(), partition=0)
                    for i in range(N)]
            p.flush(30)
            mds = [f.get(30) for f in futs]
            p.close(10)
            if acks != "0":
                offs = [m.offset for m in mds]
                assert offs == sorted(offs) and len(set(offs)) == N
    total = N * len(ACKS) * len(CODECS)
    got = consume_partition(cbroker.bootstrap, topic_name, total)
    assert [r.offset for r in got] == list(range(total))
    assert {r.value.decode() for r in got} == {
        f"{a}-{c}-{i}" for a in ACKS for c in CODECS for i in range(N)}


class Member:
    """A kafka-python group member with quick session timeouts."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self.c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group,
                               session_timeout_ms=10000, heartbeat_interval_ms=300,
                               auto_offset_reset="earliest", enable_auto_commit=False,
                               fetch_max_wait_ms=200)
        # Subscribe only once the topic's metadata is loaded: kafka-python 3.0.12 loses a
        # rebalance that a metadata change triggers while poll() times out mid-join (the member
        # never sends SyncGroup and expires); see tests/groups/test_e2e_clients.py.
        deadline = time.monotonic() + 30
        while not self.c.partitions_for_topic(topic) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.c.subscribe([topic])

    def poll_once(self) -> list[str]:
        return [r.value.decode() for recs in self.c.poll(timeout_ms=1000).values() for r in recs]

    def assignment(self) -> set[int]:
        return {tp.partition for tp in self.c.assignment()}

    def close(self) -> None:
        if self.c.assignment():
            self.c.commit()
        self.c.close()


def test_group_of_three_rebalances_then_resumes_after_restart(cbroker, topic_name):
    admin = KafkaAdminClient(bootstrap_servers=cbroker.bootstrap)
    admin.create_topics([NewTopic(topic_name, 6, 1)])
    admin.close()
    group_of_three_then_resume(cbroker, topic_name,
                               lambda group: Member(cbroker.bootstrap, group, topic_name))


def test_admin_operations(cbroker, topic_name):
    admin = KafkaAdminClient(bootstrap_servers=cbroker.bootstrap)
    try:
        admin.create_topics([NewTopic(topic_name, 2, 1, topic_configs={"retention.ms": "3600000"})])
        with pytest.raises(TopicAlreadyExistsError):
            admin.create_topics([NewTopic(topic_name, 2, 1)])
        assert topic_name in admin.list_topics()
        admin.create_partitions({topic_name: NewPartitions(3)})
        descr = {t["name"]: t for t in admin.describe_topics([topic_name])}
        assert len(descr[topic_name]["partitions"]) == 3

        produce_values(cbroker.bootstrap, topic_name, [f"v{i}" for i in range(10)], partition=0)
        tp = TopicPartition(topic_name, 0)
        admin.delete_records({tp: 4})
        c = KafkaConsumer(bootstrap_servers=cbroker.bootstrap)
        assert c.beginning_offsets([tp])[tp] == 4 and c.end_offsets([tp])[tp] == 10
        c.close()

        cfg = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic_name)],
                                     config_filter="all")
        text = repr(cfg)
        assert "retention.ms" in text and "3600000" in text and "cleanup.policy" in text

        group = unique("adm")
        c = KafkaConsumer(bootstrap_servers=cbroker.bootstrap, group_id=group,
                          enable_auto_commit=False)
        c.assign([tp])
        c.commit({tp: OffsetAndMetadata(6, "", -1)})
        c.close()
        assert group in repr(admin.list_groups())
        assert group in repr(admin.describe_groups([group]))
        admin.delete_groups([group])
        admin.delete_topics([topic_name])
        deadline = time.monotonic() + 10
        while topic_name in admin.list_topics() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert topic_name not in admin.list_topics()
    finally:
        admin.close()


@pytest.mark.parametrize("api_version", [(0, 10, 1), (0, 11), (2, 0)])
def test_older_protocol_versions_round_trip(cbroker, topic_name, api_version):
    """kafka-python pinned to older brokers' protocol (magic 1 message sets for 0.10, v2
    batches from 0.11): what it produces comes back intact, offsets in order."""
    p = KafkaProducer(bootstrap_servers=cbroker.bootstrap, api_version=api_version, acks=1,
                      compression_type="gzip", enable_idempotence=False)
    futs = [p.send(topic_name, key=b"k%d" % i, value=b"old-%d" % i, partition=0)
            for i in range(30)]
    p.flush(30)
    assert [f.get(30).offset for f in futs] == list(range(30))
    p.close(10)
    c = KafkaConsumer(bootstrap_servers=cbroker.bootstrap, api_version=api_version,
                      enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        tp = TopicPartition(topic_name, 0)
        c.assign([tp])
        c.seek(tp, 0)
        got: list = []
        deadline = time.monotonic() + 30
        while len(got) < 30 and time.monotonic() < deadline:
            for recs in c.poll(timeout_ms=500).values():
                got.extend(recs)
    finally:
        c.close()
    assert [(r.offset, r.key, r.value) for r in got] == [
        (i, b"k%d" % i, b"old-%d" % i) for i in range(30)]
