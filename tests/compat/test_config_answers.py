"""Topic configs as Kafka 3.x/4.x take them (issue 18): every name accepted, deprecated ones
too (taken and ignored), described with Kafka's defaults and sources; SUBTRACT of a list's last
value leaves it empty."""
from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource,
                                   ConfigSource, NewTopic, ResourceType)

from clients.e2e_helpers import unique

pytestmark = pytest.mark.e2e

# Every topic config of Kafka 4.1's TopicConfig plus those Kafka 3.x still takes, with Kafka's
# default (what DescribeConfigs reports as DEFAULT_CONFIG) and a valid non-default value.
KAFKA_TOPIC_CONFIGS = {
    "cleanup.policy": ("delete", "compact"),
    "compression.type": ("producer", "zstd"),
    "compression.gzip.level": ("-1", "5"),
    "compression.lz4.level": ("9", "4"),
    "compression.zstd.level": ("3", "7"),
    "delete.retention.ms": ("86400000", "1000"),
    "file.delete.delay.ms": ("60000", "1000"),
    "flush.messages": ("9223372036854775807", "100"),
    "flush.ms": ("9223372036854775807", "1000"),
    "follower.replication.throttled.replicas": ("", "0:0"),
    "index.interval.bytes": ("4096", "8192"),
    "leader.replication.throttled.replicas": ("", "0:0"),
    "local.retention.bytes": ("-2", "1000000"),
    "local.retention.ms": ("-2", "100000"),
    "max.compaction.lag.ms": ("9223372036854775807", "100000"),
    "max.message.bytes": ("1048588", "2000000"),
    "message.downconversion.enable": ("true", "false"),
    "message.format.version": ("3.0-IV1", "2.8"),
    "message.timestamp.after.max.ms": ("3600000", "1000"),
    "message.timestamp.before.max.ms": ("9223372036854775807", "1000"),
    "message.timestamp.difference.max.ms": ("9223372036854775807", "1000"),
    "message.timestamp.type": ("CreateTime", "LogAppendTime"),
    "min.cleanable.dirty.ratio": ("0.5", "0.1"),
    "min.compaction.lag.ms": ("0", "1000"),
    "min.insync.replicas": ("1", "1"),
    "preallocate": ("false", "true"),
    "remote.log.copy.disable": ("false", "false"),
    "remote.log.delete.on.disable": ("false", "false"),
    "remote.storage.enable": ("false", "false"),
    "retention.bytes": ("-1", "1000000"),
    "retention.ms": ("604800000", "100000"),
    "segment.bytes": ("1073741824", "1000000"),
    "segment.index.bytes": ("10485760", "100000"),
    "segment.jitter.ms": ("0", "10"),
    "segment.ms": ("604800000", "100000"),
    "unclean.leader.election.enable": ("false", "true"),
}


def describe(admin: AdminClient, topic: str) -> dict:
    res = ConfigResource(ResourceType.TOPIC, topic)
    return admin.describe_configs([res])[res].result(30)


def test_every_kafka_topic_config_is_accepted_and_described(abroker):
    admin = AdminClient({"bootstrap.servers": abroker.bootstrap})
    plain, tuned = unique("cfg-plain"), unique("cfg-all")
    configs = {n: v for n, (_, v) in KAFKA_TOPIC_CONFIGS.items()}
    futures = admin.create_topics([NewTopic(plain, 1, 1), NewTopic(tuned, 1, 1, config=configs)])
    for f in futures.values():
        f.result(30)
    got = describe(admin, plain)
    for name, (default, _) in KAFKA_TOPIC_CONFIGS.items():
        entry = got[name]
        assert (entry.value, entry.source) == (default, ConfigSource.DEFAULT_CONFIG.value), name
        assert entry.is_default, name
    got = describe(admin, tuned)
    for name, value in configs.items():
        entry = got[name]
        assert (entry.value, entry.source) == (value, ConfigSource.DYNAMIC_TOPIC_CONFIG.value), name
    # synonyms: the topic's own value first, then the broker default it overrides
    syn = [(s.name, s.value, s.source) for s in got["message.format.version"].synonyms.values()]
    assert syn == [("message.format.version", "2.8", ConfigSource.DYNAMIC_TOPIC_CONFIG.value),
                   ("log.message.format.version", "3.0-IV1", ConfigSource.DEFAULT_CONFIG.value)]
    bad = unique("bad")   # a value Kafka refuses is still refused
    with pytest.raises(KafkaException) as info:
        admin.create_topics([NewTopic(bad, 1, 1, config={
            "message.format.version": "latest"})])[bad].result(30)
    assert info.value.args[0].code() == KafkaError.INVALID_CONFIG


def test_subtract_last_list_value_leaves_it_empty(abroker):
    admin = AdminClient({"bootstrap.servers": abroker.bootstrap})
    topic = unique("subtract")
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    res = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[ConfigEntry(
        "cleanup.policy", "delete", incremental_operation=AlterConfigOpType.SUBTRACT)])
    admin.incremental_alter_configs([res])[res].result(30)
    entry = describe(admin, topic)["cleanup.policy"]
    assert (entry.value, entry.source) == ("", ConfigSource.DYNAMIC_TOPIC_CONFIG.value)
    res = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[ConfigEntry(
        "cleanup.policy", "compact", incremental_operation=AlterConfigOpType.APPEND)])
    admin.incremental_alter_configs([res])[res].result(30)
    assert describe(admin, topic)["cleanup.policy"].value == "compact"


def test_java_configs_and_log_dirs(java_answers):
    for version, out in java_answers.items():
        assert out["subtract_last"] == "[]", (version, out)
        cfg = out["deprecated_configs"]
        assert cfg["message.format.version"] == "3.0-IV1/DYNAMIC_TOPIC_CONFIG", (version, cfg)
        assert cfg["message.downconversion.enable"] == "false/DYNAMIC_TOPIC_CONFIG", cfg
        assert cfg["message.timestamp.difference.max.ms"] == "1000/DYNAMIC_TOPIC_CONFIG", cfg
        assert cfg["message.timestamp.type"] == "CreateTime/DEFAULT_CONFIG", cfg
        dirs = out["log_dirs"]
        assert dirs["dirs"] == 1, (version, dirs)
        sizes = [v for k, v in dirs.items() if k.endswith("-compacted-0")]
        assert len(sizes) == 1 and sizes[0] > 0, (version, dirs)   # the keyed record's batch


def test_kafka_python_describe_log_dirs(abroker):
    """DescribeLogDirs answers: one log dir with its volume sizes, each partition's bytes."""
    from kafka import KafkaAdminClient, KafkaProducer

    topic = unique("logdirs")
    p = KafkaProducer(bootstrap_servers=abroker.bootstrap)
    try:
        for _ in range(10):
            p.send(topic, key=b"k", value=b"x" * 1000, partition=0).get(timeout=30)
    finally:
        p.close(timeout=10)
    admin = KafkaAdminClient(bootstrap_servers=abroker.bootstrap)
    try:
        [node] = admin.describe_log_dirs()
        [d] = node["log_dirs"]
        assert d["error_code"] == 0 and d["log_dir"] == str(abroker.data_dir)
        assert d["total_bytes"] >= d["usable_bytes"] > 0
        sizes = {t["name"]: [p["partition_size"] for p in t["partitions"]] for t in d["topics"]}
        assert sizes[topic][0] >= 10_000 and sizes["__consumer_offsets"] == [0]
    finally:
        admin.close()
