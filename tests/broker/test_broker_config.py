"""CLI/config: defaults, flag > env > file > default, TOML and properties files, engine knobs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from broker.cli import build_parser, parse_config
from broker.config import BrokerConfig, engine_fields, parse_int


def test_defaults_work_without_any_option(tmp_path):
    cfg = parse_config(["serve"], env={})
    assert cfg.listen == "127.0.0.1:9092"
    assert (cfg.advertised_host, cfg.advertised_port) == ("127.0.0.1", 9092)
    assert cfg.data_path == os.path.abspath("./data")
    assert cfg.wal_path == os.path.join(cfg.data_path, "wal")
    assert cfg.object_store_url == "file://" + os.path.join(cfg.data_path, "objects")
    assert cfg.metadata_url == "sqlite:///" + os.path.join(cfg.data_path, "meta.db")
    assert cfg.node_id == 0 and cfg.auto_create_topics and cfg.default_partitions == 1
    assert cfg.max_request_bytes == 100 << 20


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    f = tmp_path / "broker.toml"
    f.write_text('listen = "127.0.0.1:1111"\nnode_id = 3\ndefault_partitions = 4\n'
                 'log_level = "WARNING"\n[topic_defaults]\n"retention.ms" = 1000\n')
    env = {"S3KAFKA_LISTEN": "127.0.0.1:2222", "S3KAFKA_NODE_ID": "5"}
    cfg = parse_config(["serve", "--config", str(f), "--listen", "127.0.0.1:3333"], env=env)
    assert cfg.listen == "127.0.0.1:3333"        # flag beats env and file
    assert cfg.node_id == 5                       # env beats file
    assert cfg.default_partitions == 4            # file beats default
    assert cfg.log_level == "WARNING"
    assert cfg.topic_defaults == {"retention.ms": "1000"}
    assert cfg.auto_create_topics is True         # default


def test_properties_file_and_env_config_path(tmp_path):
    f = tmp_path / "broker.properties"
    f.write_text("# comment\nadvertised.listener=kafka.example:19092\n"
                 "auto.create.topics=false\nmax-request-bytes=1MiB\n"
                 "topic.defaults.cleanup.policy=compact\n")
    cfg = parse_config(["serve"], env={"S3KAFKA_CONFIG": str(f)})
    assert (cfg.advertised_host, cfg.advertised_port) == ("kafka.example", 19092)
    assert cfg.auto_create_topics is False
    assert cfg.max_request_bytes == 1 << 20
    assert cfg.topic_defaults == {"cleanup.policy": "compact"}


def test_topic_default_flag_is_repeatable():
    cfg = parse_config(["serve", "--topic-default", "retention.ms=5", "--topic-defaults",
                        "retention.bytes=7,cleanup.policy=delete"], env={})
    assert cfg.topic_defaults == {"retention.ms": "5", "retention.bytes": "7",
                                  "cleanup.policy": "delete"}


@pytest.mark.parametrize("argv,env", [
    (["serve", "--listen", "nonsense"], {}),
    (["serve", "--node-id", "x"], {}),
    (["serve"], {"S3KAFKA_DEFAULT_PARTITIONS": "0"}),
    (["serve", "--storage", "tape"], {}),
    (["serve", "--log-level", "chatty"], {}),
    (["serve", "--topic-default", "retention.ms=soon"], {}),
    (["serve", "--topic-default", "no.such.config=1"], {}),
    (["serve", "--cold-read-io-class", "realtime"], {}),
    (["serve", "--wal-sync-mode", "sometimes"], {}),
])
def test_bad_values_are_rejected(argv, env):
    with pytest.raises(ValueError):
        parse_config(argv, env=env)


def test_unknown_file_key_is_rejected(tmp_path):
    f = tmp_path / "b.toml"
    f.write_text("no_such_option = 1\n")
    with pytest.raises(ValueError, match="no_such_option"):
        parse_config(["serve", "--config", str(f)], env={})


def test_every_engine_knob_is_a_flag():
    knobs = engine_fields()
    if not knobs:
        pytest.skip("storage.engine not importable")
    opts = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert set(knobs) <= opts
    name, kind = next((n, k) for n, k in knobs.items() if k is int)
    cfg = parse_config(["serve", "--" + name.replace("_", "-"), "2MiB"], env={})
    assert cfg.engine[name] == 2 << 20
    assert getattr(cfg.engine_config(), name) == 2 << 20


def test_size_suffixes():
    assert parse_int("64MiB") == 64 << 20 and parse_int("2g") == 2 << 30
    assert parse_int("1_000") == 1000 and parse_int(-1) == -1


def test_bad_config_exits_2_with_message(tmp_path):
    r = subprocess.run([sys.executable, "-m", "broker", "serve", "--listen", "bogus"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "configuration error" in r.stderr


def test_env_configures_a_running_broker(broker_factory):
    b = broker_factory(env={"S3KAFKA_DEFAULT_PARTITIONS": "3"})
    from kafka.admin import KafkaAdminClient
    from kafka.admin import NewTopic
    admin = KafkaAdminClient(bootstrap_servers=b.bootstrap)
    try:
        admin.create_topics([NewTopic("env-default", -1, -1)])
        (desc,) = admin.describe_topics(["env-default"])
        assert len(desc["partitions"]) == 3
    finally:
        admin.close()


def test_dataclass_fields_have_defaults():
    BrokerConfig()  # every field has a working default


def test_advertised_listener_reaches_metadata_and_find_coordinator(broker_factory):
    from broker_wire import Wire
    b = broker_factory(["--advertised-listener", "kafka.example:19092", "--node-id", "7"])
    w = Wire(b.host, b.port)
    try:
        md = w.call(3, 12, topics=None, allow_auto_topic_creation=False,
                    include_topic_authorized_operations=False)
        assert [(x.node_id, x.host, x.port) for x in md.brokers] == [(7, "kafka.example", 19092)]
        assert md.controller_id == 7
        fc = w.call(10, 3, correlation_id=2, key="g", key_type=0)
        assert (fc.node_id, fc.host, fc.port) == (7, "kafka.example", 19092)
    finally:
        w.close()
