"""The shipped deployment files stay in step with the broker's configuration surface."""
from __future__ import annotations

import pathlib

import yaml

from broker.config import build_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_example_config_file_is_accepted_by_the_broker() -> None:
    cfg = build_config({"config": str(ROOT / "deploy" / "s3kafka.toml")}, env={})
    assert (cfg.advertised_host, cfg.advertised_port) == ("kafka.example.internal", 9092)
    assert cfg.default_partitions == 3


def test_compose_environment_names_real_options() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = compose["services"]["broker"]["environment"]
    s3k = {k: v for k, v in env.items() if k.startswith("S3KAFKA_")}
    cfg = build_config({}, env=s3k)
    assert cfg.advertised_port == 9092
    assert cfg.object_store.startswith("s3://s3kafka/cluster1?endpoint_url=http://minio:9000")
