"""docker-compose.yml's topology as local processes: the three brokers, started with the
compose file's own S3KAFKA_* settings (hosts swapped for a moto S3 server, a real PostgreSQL and
free 127.0.0.1 ports), come up on one object store and one metadata database."""
from __future__ import annotations

import os
import pathlib
import time
from urllib.parse import urlsplit

import boto3
import psycopg
import pytest
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from conftest import free_port

pytestmark = pytest.mark.e2e
ROOT = pathlib.Path(__file__).resolve().parents[2]
BROKERS = ["broker-1", "broker-2", "broker-3"]


def _broker_env(svc: dict, *, metadata: str, endpoint: str, bucket: str,
                data_dir: pathlib.Path) -> tuple[list[str], dict[str, str]]:
    """(flags, env) for one compose service: its environment with the container-only parts
    (hosts, ports, /var/lib paths, credentials) replaced; everything else exactly as shipped."""
    env = {k: str(v) for k, v in svc["environment"].items() if k.startswith("S3KAFKA_")}
    store = urlsplit(env["S3KAFKA_OBJECT_STORE"])
    assert store.netloc == "s3kafka" and "endpoint_url=http://minio:9000" in store.query
    env["S3KAFKA_OBJECT_STORE"] = store._replace(
        netloc=bucket, query=store.query.replace("http://minio:9000", endpoint)).geturl()
    assert "@postgres:5432/" in env["S3KAFKA_METADATA"]
    env["S3KAFKA_METADATA"] = metadata
    env["S3KAFKA_DATA_DIR"] = str(data_dir)
    env["S3KAFKA_WAL_CAPACITY"] = str(64 << 20)          # small WAL files on the test disk
    env["S3KAFKA_METRICS_LISTEN"] = f"127.0.0.1:{free_port()}"
    # the two named listeners on free ports: INTERNAL advertised by its address (the
    # container name's stand-in), EXTERNAL as localhost (as published on the host)
    assert env["S3KAFKA_LISTENERS"].startswith("INTERNAL://0.0.0.0:9092,EXTERNAL://0.0.0.0:")
    port, ext = free_port(), free_port()
    env["S3KAFKA_LISTENERS"] = f"INTERNAL://127.0.0.1:{port},EXTERNAL://127.0.0.1:{ext}"
    env["S3KAFKA_ADVERTISED_LISTENERS"] = \
        f"INTERNAL://127.0.0.1:{port},EXTERNAL://localhost:{ext}"
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    flags = ["--listen", f"127.0.0.1:{port}", "--data-dir", str(data_dir),
             "--node-id", env["S3KAFKA_NODE_ID"]]
    return flags, {**os.environ, **env}


def _env_listener(b, name: str) -> str:
    """host:port a broker process advertises on a named listener (from its environment)."""
    spec = b.env["S3KAFKA_ADVERTISED_LISTENERS"]
    return next(x.split("://", 1)[1] for x in spec.split(",") if x.startswith(name + "://"))


def test_compose_topology_as_processes(broker_factory, postgres, s3_endpoint, tmp_path):
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    bucket = f"compose-{os.getpid()}-{time.time_ns()}"
    boto3.client("s3", endpoint_url=s3_endpoint.url, region_name="us-east-1",
                 aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    metadata = postgres.new_database()
    brokers = []
    for name in BROKERS:
        flags, env = _broker_env(compose["services"][name], metadata=metadata,
                                 endpoint=s3_endpoint.url, bucket=bucket,
                                 data_dir=tmp_path / name)
        brokers.append(broker_factory(flags, env=env))

    # one cluster: every broker reports the cluster id of the shared database
    ids = {AdminClient({"bootstrap.servers": b.bootstrap}).list_topics(timeout=30).cluster_id
           for b in brokers}
    with psycopg.connect(metadata) as conn:
        rows = dict(conn.execute("SELECT key, value FROM kafka_cluster").fetchall())
    assert ids == {rows["cluster_id"]}
    assert rows["object_store"] == f"s3://{bucket}/cluster1"
    # each listener advertises every broker under its own addresses
    ext = {b.bootstrap: _env_listener(b, "EXTERNAL") for b in brokers}
    for b in brokers:
        internal = AdminClient({"bootstrap.servers": b.bootstrap}).list_topics(timeout=30)
        assert sorted(f"{x.host}:{x.port}" for x in internal.brokers.values()) == \
            sorted(x.bootstrap for x in brokers)
        outside = AdminClient({"bootstrap.servers": ext[b.bootstrap]}).list_topics(timeout=30)
        assert sorted(f"{x.host}:{x.port}" for x in outside.brokers.values()) == sorted(
            ext.values())

    # records go through the S3 object store of the compose settings
    p = Producer({"bootstrap.servers": brokers[0].bootstrap, "acks": "all"})
    for i in range(20):
        p.produce("compose-t", value=b"v%02d" % i, partition=0)
    assert p.flush(30) == 0
    # the partition's leader (the cluster may have put it on any broker) stops: a controlled
    # shutdown uploads its data and hands the partition over; its WAL is then deleted, so
    # what comes back is from S3
    # asked by name: a broker that has not yet seen a topic another broker auto-created reads
    # the metadata store first (a listing of all topics shows what it knows)
    md = AdminClient({"bootstrap.servers": brokers[0].bootstrap}).list_topics("compose-t",
                                                                             timeout=30)
    leader_id = md.topics["compose-t"].partitions[0].leader
    leader = next(b for b, name in zip(brokers, BROKERS)
                  if str(compose["services"][name]["environment"]["S3KAFKA_NODE_ID"]) ==
                  str(leader_id))
    leader.stop()
    os.unlink(leader.data_dir / "wal")
    leader.start()
    c = Consumer({"bootstrap.servers": brokers[0].bootstrap, "group.id": "compose-g",
                  "auto.offset.reset": "earliest"})
    c.assign([TopicPartition("compose-t", 0, 0)])
    got = []
    deadline = time.monotonic() + 30
    while len(got) < 20 and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and not m.error():
            got.append(m.value())
    c.close()
    assert got == [b"v%02d" % i for i in range(20)]
    keys = boto3.client("s3", endpoint_url=s3_endpoint.url, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing"
                        ).list_objects_v2(Bucket=bucket, Prefix="cluster1/")
    assert keys.get("KeyCount", 0) > 0
