"""Topic administration and configs through real admin clients (kafka-python, confluent-kafka)."""
from __future__ import annotations

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import (AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource,
                                   NewPartitions, NewTopic)
from kafka import errors as kerr
from kafka.admin import ConfigResource as KConfigResource
from kafka.admin import ConfigResourceType, KafkaAdminClient
from kafka.admin import NewPartitions as KNewPartitions
from kafka.admin import NewTopic as KNewTopic

from protocol import ErrorCode

from broker_wire import Wire, md_topic

TIMEOUT = 15


@pytest.fixture(scope="module")
def cadmin(module_broker):
    return AdminClient({"bootstrap.servers": module_broker.bootstrap})


@pytest.fixture
def kadmin(module_broker):
    a = KafkaAdminClient(bootstrap_servers=module_broker.bootstrap, request_timeout_ms=10000)
    yield a
    a.close()


def _wait(futures: dict) -> dict:
    return {k: f.result(timeout=TIMEOUT) for k, f in futures.items()}


def _error_code(fut) -> int:
    with pytest.raises(KafkaException) as ei:
        fut.result(timeout=TIMEOUT)
    return ei.value.args[0].code()


def test_confluent_create_list_describe_delete(cadmin):
    _wait(cadmin.create_topics([NewTopic("c-admin", num_partitions=4, replication_factor=1,
                                         config={"retention.ms": "60000"})]))
    md = cadmin.list_topics(timeout=TIMEOUT)
    assert len(md.topics["c-admin"].partitions) == 4
    part = md.topics["c-admin"].partitions[0]
    assert part.leader == 0 and part.replicas == [0] and part.isrs == [0]
    assert md.controller_id == 0 and md.cluster_id
    _wait(cadmin.create_partitions([NewPartitions("c-admin", 6)]))
    assert len(cadmin.list_topics(timeout=TIMEOUT).topics["c-admin"].partitions) == 6
    _wait(cadmin.delete_topics(["c-admin"]))
    assert "c-admin" not in cadmin.list_topics(timeout=TIMEOUT).topics


def test_confluent_create_errors(cadmin):
    _wait(cadmin.create_topics([NewTopic("c-dup", 1, 1)]))
    codes = {t: None for t in ("c-dup", "bad name!", "c-rf3", "c-badcfg", "c-zero")}
    futs = cadmin.create_topics([
        NewTopic("c-dup", 1, 1), NewTopic("bad name!", 1, 1), NewTopic("c-rf3", 1, 3),
        NewTopic("c-badcfg", 1, 1, config={"retention.ms": "soon"}),
        NewTopic("c-zero", 0, 1)])
    for t in codes:
        codes[t] = _error_code(futs[t])
    assert codes == {"c-dup": ErrorCode.TOPIC_ALREADY_EXISTS, "bad name!": ErrorCode.INVALID_TOPIC,
                     "c-rf3": ErrorCode.INVALID_REPLICATION_FACTOR,
                     "c-badcfg": ErrorCode.INVALID_CONFIG, "c-zero": ErrorCode.INVALID_PARTITIONS}
    assert _error_code(cadmin.create_topics(
        [NewTopic("c-unknown-cfg", 1, 1, config={"no.such.config": "1"})])["c-unknown-cfg"]) \
        == ErrorCode.INVALID_CONFIG
    # validate_only creates nothing
    _wait(cadmin.create_topics([NewTopic("c-validate", 2, 1)], validate_only=True))
    assert "c-validate" not in cadmin.list_topics(timeout=TIMEOUT).topics
    assert _error_code(cadmin.delete_topics(["c-never"])["c-never"]) \
        == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    assert _error_code(cadmin.create_partitions([NewPartitions("c-dup", 1)])["c-dup"]) \
        == ErrorCode.INVALID_PARTITIONS


def test_confluent_describe_and_incremental_alter_configs(cadmin):
    _wait(cadmin.create_topics([NewTopic("c-cfg", 1, 1, config={"retention.bytes": "1000"})]))
    (cfg,) = _wait(cadmin.describe_configs([ConfigResource("topic", "c-cfg")])).values()
    assert cfg["retention.bytes"].value == "1000"
    assert cfg["retention.ms"].value == "604800000" and cfg["retention.ms"].is_default
    assert cfg["cleanup.policy"].value == "delete"
    assert cfg["max.message.bytes"].value == "1048588"
    assert cfg["message.timestamp.type"].value == "CreateTime"
    _wait(cadmin.incremental_alter_configs([ConfigResource("topic", "c-cfg", incremental_configs=[
        ConfigEntry("retention.ms", "1234", incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("retention.bytes", None, incremental_operation=AlterConfigOpType.DELETE),
        ConfigEntry("cleanup.policy", "compact", incremental_operation=AlterConfigOpType.APPEND),
    ])]))
    (cfg,) = _wait(cadmin.describe_configs([ConfigResource("topic", "c-cfg")])).values()
    assert cfg["retention.ms"].value == "1234" and not cfg["retention.ms"].is_default
    assert cfg["retention.bytes"].value == "-1" and cfg["retention.bytes"].is_default
    assert cfg["cleanup.policy"].value == "delete,compact"
    _wait(cadmin.incremental_alter_configs([ConfigResource("topic", "c-cfg", incremental_configs=[
        ConfigEntry("cleanup.policy", "delete", incremental_operation=AlterConfigOpType.SUBTRACT),
    ])]))
    (cfg,) = _wait(cadmin.describe_configs([ConfigResource("topic", "c-cfg")])).values()
    assert cfg["cleanup.policy"].value == "compact"
    bad = cadmin.incremental_alter_configs([ConfigResource("topic", "c-cfg", incremental_configs=[
        ConfigEntry("retention.ms", "-7", incremental_operation=AlterConfigOpType.SET)])])
    (fut,) = bad.values()
    assert _error_code(fut) == ErrorCode.INVALID_CONFIG
    (broker_cfg,) = _wait(cadmin.describe_configs([ConfigResource("broker", "0")])).values()
    assert broker_cfg["auto.create.topics.enable"].value == "true"
    assert broker_cfg["log.retention.ms"].value == "604800000"


def test_confluent_describe_cluster(cadmin):
    desc = cadmin.describe_cluster().result(timeout=TIMEOUT)
    assert desc.cluster_id and [n.id for n in desc.nodes] == [0] and desc.controller.id == 0


def test_kafka_python_admin_round_trip(kadmin):
    kadmin.create_topics([KNewTopic("k-admin", 2, 1, topic_configs={"retention.ms": "1000"})])
    assert "k-admin" in kadmin.list_topics()
    (desc,) = kadmin.describe_topics(["k-admin"])
    assert [p["partition_index"] for p in desc["partitions"]] == [0, 1]
    kadmin.create_partitions({"k-admin": KNewPartitions(3)})
    (desc,) = kadmin.describe_topics(["k-admin"])
    assert len(desc["partitions"]) == 3
    # legacy AlterConfigs (kafka-python re-sends the other overrides, as it replaces the set)
    kadmin.alter_configs([KConfigResource(ConfigResourceType.TOPIC, "k-admin",
                                          configs={"retention.bytes": "2048"})],
                        incremental=False)
    res = kadmin.describe_configs([KConfigResource(ConfigResourceType.TOPIC, "k-admin")])
    overrides = res["topic"]["k-admin"]
    assert overrides["retention.bytes"]["value"] == "2048"
    assert overrides["retention.ms"]["value"] == "1000"
    with pytest.raises(kerr.TopicAlreadyExistsError):
        kadmin.create_topics([KNewTopic("k-admin", 1, 1)])
    kadmin.delete_topics(["k-admin"])
    assert "k-admin" not in kadmin.list_topics()


def test_metadata_auto_create_and_unknown(module_broker):
    w = Wire(module_broker.host, module_broker.port)
    try:
        resp = w.call(3, 12, topics=[md_topic("auto-md")], allow_auto_topic_creation=False,
                      include_topic_authorized_operations=False)
        assert resp.topics[0].error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        for v in (1, 4, 9, 12):
            resp = w.call(3, v, correlation_id=v, topics=[md_topic("auto-md")],
                          allow_auto_topic_creation=True,
                          include_topic_authorized_operations=False)
            (t,) = resp.topics
            assert t.error_code == 0 and t.name == "auto-md" and len(t.partitions) == 1
        assert resp.cluster_id and resp.controller_id == 0
        tid = resp.topics[0].topic_id
        # v12 lookup by topic id
        by_id = w.call(3, 12, correlation_id=20,
                       topics=[type(md_topic("x"))(name=None, topic_id=tid)],
                       allow_auto_topic_creation=False, include_topic_authorized_operations=False)
        assert by_id.topics[0].name == "auto-md"
        for auto in (True, False):
            bad = w.call(3, 12, correlation_id=21, topics=[md_topic("bad/name")],
                         allow_auto_topic_creation=auto,
                         include_topic_authorized_operations=False)
            assert bad.topics[0].error_code == ErrorCode.INVALID_TOPIC
        # v0: an empty list means every topic
        everything = w.call(3, 0, correlation_id=22, topics=[])
        assert "auto-md" in {t.name for t in everything.topics}
    finally:
        w.close()


def test_describe_topic_partitions_pages_with_cursor(module_broker, cadmin):
    _wait(cadmin.create_topics([NewTopic("dtp-a", 3, 1), NewTopic("dtp-b", 2, 1)]))
    w = Wire(module_broker.host, module_broker.port)
    try:
        from protocol import request_class
        rc = request_class(75)
        seen, cursor = [], None
        for _ in range(10):
            resp = w.call(75, 0, topics=[rc.TopicRequest(name="dtp-b"),
                                         rc.TopicRequest(name="dtp-a")],
                          response_partition_limit=2, cursor=cursor)
            for t in resp.topics:
                seen += [(t.name, p.partition_index) for p in t.partitions]
                # Java's admin client NPEs on null lists here
                assert all(p.eligible_leader_replicas == [] and p.last_known_elr == []
                           for p in t.partitions)
            if resp.next_cursor is None:
                break
            cursor = rc.Cursor(topic_name=resp.next_cursor.topic_name,
                               partition_index=resp.next_cursor.partition_index)
        assert seen == [("dtp-a", 0), ("dtp-a", 1), ("dtp-a", 2), ("dtp-b", 0), ("dtp-b", 1)]
    finally:
        w.close()


def test_auto_create_disabled(broker_factory):
    b = broker_factory(["--auto-create-topics", "false", "--log-format", "json"])
    admin = AdminClient({"bootstrap.servers": b.bootstrap})
    w = Wire(b.host, b.port)
    try:
        resp = w.call(3, 12, topics=[md_topic("nope")], allow_auto_topic_creation=True,
                      include_topic_authorized_operations=False)
        assert resp.topics[0].error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        assert "nope" not in admin.list_topics(timeout=TIMEOUT).topics
    finally:
        w.close()
    import json
    lines = [json.loads(x) for x in b.log_text().splitlines() if x.startswith("{")]
    assert any(x["msg"].startswith("broker started") and x["level"] == "INFO" for x in lines)


def test_topics_and_configs_survive_restart(broker_factory):
    b = broker_factory(["--topic-default", "retention.bytes=5000"])
    admin = AdminClient({"bootstrap.servers": b.bootstrap})
    _wait(admin.create_topics([NewTopic("durable", 3, 1, config={"retention.ms": "99999"})]))
    _wait(admin.create_partitions([NewPartitions("durable", 5)]))
    _wait(admin.create_topics([NewTopic("gone", 1, 1)]))
    _wait(admin.delete_topics(["gone"]))
    md = admin.list_topics(timeout=TIMEOUT)
    cluster_id, topic_id = md.cluster_id, None
    w = Wire(b.host, b.port)
    topic_id = w.call(3, 12, topics=[md_topic("durable")], allow_auto_topic_creation=False,
                      include_topic_authorized_operations=False).topics[0].topic_id
    w.close()
    for hard in (False, True):
        b.restart(hard=hard)
        admin = AdminClient({"bootstrap.servers": b.bootstrap})
        md = admin.list_topics(timeout=TIMEOUT)
        assert md.cluster_id == cluster_id
        assert len(md.topics["durable"].partitions) == 5 and "gone" not in md.topics
        w = Wire(b.host, b.port)
        assert w.call(3, 12, topics=[md_topic("durable")], allow_auto_topic_creation=False,
                      include_topic_authorized_operations=False).topics[0].topic_id == topic_id
        w.close()
        (cfg,) = _wait(admin.describe_configs([ConfigResource("topic", "durable")])).values()
        assert cfg["retention.ms"].value == "99999"
        assert cfg["retention.bytes"].value == "5000"  # broker-wide default, not an override


def test_legacy_alter_configs_replaces_the_override_set(module_broker, cadmin):
    _wait(cadmin.create_topics([NewTopic("legacy-alter", 1, 1,
                                         config={"retention.ms": "1000"})]))
    from protocol import request_class
    rc = request_class(33)
    w = Wire(module_broker.host, module_broker.port)
    try:
        res = rc.AlterConfigsResource(resource_type=2, resource_name="legacy-alter", configs=[
            rc.AlterConfigsResource.AlterableConfig(name="retention.bytes", value="4096")])
        for validate_only in (True, False):
            resp = w.call(33, 2, resources=[res], validate_only=validate_only)
            assert resp.responses[0].error_code == 0
        bad = rc.AlterConfigsResource(resource_type=2, resource_name="legacy-alter", configs=[
            rc.AlterConfigsResource.AlterableConfig(name="retention.bytes", value="x")])
        assert w.call(33, 2, resources=[bad], validate_only=False).responses[0].error_code \
            == ErrorCode.INVALID_CONFIG
    finally:
        w.close()
    (cfg,) = _wait(cadmin.describe_configs([ConfigResource("topic", "legacy-alter")])).values()
    assert cfg["retention.bytes"].value == "4096"
    assert cfg["retention.ms"].value == "604800000" and cfg["retention.ms"].is_default


def test_describe_configs_keys_synonyms_and_docs(module_broker, cadmin):
    _wait(cadmin.create_topics([NewTopic("syn-topic", 1, 1, config={"retention.ms": "42"})]))
    from protocol import request_class
    rc = request_class(32)
    w = Wire(module_broker.host, module_broker.port)
    try:
        res = rc.DescribeConfigsResource(resource_type=2, resource_name="syn-topic",
                                         configuration_keys=["retention.ms", "cleanup.policy"])
        resp = w.call(32, 4, resources=[res], include_synonyms=True, include_documentation=True)
        (result,) = resp.results
        by_name = {c.name: c for c in result.configs}
        assert set(by_name) == {"retention.ms", "cleanup.policy"}
        rm = by_name["retention.ms"]
        assert (rm.value, rm.config_source, rm.config_type) == ("42", 1, 5)  # TOPIC, LONG
        assert [(s.name, s.value, s.source) for s in rm.synonyms] == [
            ("retention.ms", "42", 1), ("log.retention.ms", "604800000", 5)]
        assert rm.documentation
        unknown = rc.DescribeConfigsResource(resource_type=2, resource_name="no-such-topic",
                                             configuration_keys=None)
        resp = w.call(32, 1, correlation_id=2, resources=[unknown], include_synonyms=False)
        assert resp.results[0].error_code == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
    finally:
        w.close()
