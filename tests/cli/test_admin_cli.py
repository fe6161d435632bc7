"""The admin CLI (``s3kafka topics|groups|cluster``) against a running broker.

Every subcommand runs as a real process (the ``s3kafka`` console script when installed, else
``python -m broker``), and its effects are checked with a separate Kafka client: topics really
exist with their partitions and configs, reset offsets are what a consumer of the group reads
next, and a group with a live member is refused as Kafka refuses it.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition

from conftest import REPO, BrokerFactory, BrokerProcess, free_port

SCRIPT = pathlib.Path(sys.executable).with_name("s3kafka")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "broker"]


@pytest.fixture(scope="module")
def cli_broker(module_broker_factory: BrokerFactory) -> BrokerProcess:
    # members that subscribe one after the other need no initial rebalance delay here
    return module_broker_factory(["--group-initial-rebalance-delay-ms", "0"])


class Cli:
    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap

    def run(self, *args: str, ok: bool = True, bootstrap: str | None = None
            ) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        env.pop("S3KAFKA_BOOTSTRAP_SERVER", None)
        proc = subprocess.run([*COMMAND, *args, "--bootstrap-server", bootstrap or self.bootstrap],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
        if ok:
            assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout)

    def fails(self, *args: str, code: int = 1, bootstrap: str | None = None) -> str:
        """Runs a command that must fail; returns its single stderr line."""
        proc = self.run(*args, ok=False, bootstrap=bootstrap)
        assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert proc.stdout == ""
        return lines[0]


@pytest.fixture(scope="module")
def cli(cli_broker: BrokerProcess) -> Cli:
    return Cli(cli_broker.bootstrap)


def _produce(bootstrap: str, topic: str, per_partition: dict[int, int], ts0: int = 0) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        for p, n in per_partition.items():
            for i in range(n):
                producer.send(topic, f"{p}-{i}".encode(), partition=p,
                              timestamp_ms=(ts0 + i * 1000) if ts0 else None)
        producer.flush(30)
    finally:
        producer.close()


def _consumer(bootstrap: str, group: str, topic: str) -> KafkaConsumer:
    return KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group,
                         auto_offset_reset="earliest", enable_auto_commit=False,
                         session_timeout_ms=10000, heartbeat_interval_ms=500)


def _poll_until(consumer: KafkaConsumer, count: int, timeout_s: float = 30) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=500).values():
            got.extend(records)
    assert len(got) >= count, f"consumed {len(got)} of {count}"
    return got


def test_cluster_describe(cli: Cli, cli_broker: BrokerProcess) -> None:
    out = cli.run("cluster", "describe").stdout
    assert "Cluster ID: " in out and "Controller: 0" in out
    assert f"127.0.0.1  {cli_broker.port}" in out
    info = cli.json("cluster", "describe")
    assert info["controller_id"] == 0 and len(info["cluster_id"]) == 22
    assert info["brokers"] == [{"node_id": 0, "host": "127.0.0.1", "port": cli_broker.port,
                                "rack": None}]


def test_topics_lifecycle(cli: Cli, cli_broker: BrokerProcess) -> None:
    t = "cli-topic"
    out = cli.run("topics", "create", t, "--partitions", "3", "--replication-factor", "1",
                  "--config", "retention.ms=3600000", "--config", "max.message.bytes=200000")
    assert out.stdout.strip() == f"Created topic {t}."
    assert "already exists" in cli.fails("topics", "create", t)
    assert cli.run("topics", "create", t, "--if-not-exists").returncode == 0
    line = cli.fails("topics", "create", "cli-rf", "--replication-factor", "3")
    assert line.startswith("Error: cannot create topic 'cli-rf'") and "REPLICATION_FACTOR" in line
    assert "INVALID_CONFIG" in cli.fails("topics", "create", "cli-bad", "--config", "no.such=1")

    # really there: a producer writes to partition 2, the log end moves
    _produce(cli_broker.bootstrap, t, {2: 4})
    listed = {d["name"]: d for d in cli.json("topics", "list")}
    assert listed[t]["partitions"] == 3 and listed[t]["replication_factor"] == 1
    assert "cli-rf" not in listed and "cli-bad" not in listed
    row = next(ln for ln in cli.run("topics", "list").stdout.splitlines() if ln.startswith(t))
    assert row.split() == [t, "3", "1", "no"]

    desc = cli.json("topics", "describe", t)[0]
    assert desc["partition_count"] == 3 and desc["replication_factor"] == 1
    assert desc["configs"] == {"max.message.bytes": "200000", "retention.ms": "3600000"}
    assert [(p["partition"], p["leader"], p["log_start_offset"], p["log_end_offset"])
            for p in desc["partitions"]] == [(0, 0, 0, 0), (1, 0, 0, 0), (2, 0, 0, 4)]
    text = cli.run("topics", "describe", t).stdout
    assert "Configs: max.message.bytes=200000,retention.ms=3600000" in text
    assert "PartitionCount: 3" in text
    full = cli.json("topics", "describe", t, "--all-configs")[0]["all_configs"]
    assert full["retention.ms"]["source"] == "DYNAMIC_TOPIC_CONFIG"
    assert full["cleanup.policy"] == {"value": "delete", "source": "DEFAULT_CONFIG",
                                      "read_only": False}

    altered = cli.json("topics", "alter-config", t, "--set", "retention.ms=7200000,segment.ms=60000",
                       "--delete", "max.message.bytes")
    assert altered["configs"] == {"retention.ms": "7200000", "segment.ms": "60000"}
    assert cli.json("topics", "describe", t)[0]["configs"] == altered["configs"]
    assert "INVALID_CONFIG" in cli.fails("topics", "alter-config", t, "--set", "no.such=1")
    assert "does not exist" in cli.fails("topics", "alter-config", "cli-nope", "--set", "a=1")
    assert cli.fails("topics", "alter-config", t, code=1).startswith("Error: nothing to change")

    grown = cli.json("topics", "add-partitions", t, "--total", "5")
    assert grown == {"topic": t, "partitions_before": 3, "partitions": 5}
    _produce(cli_broker.bootstrap, t, {4: 2})
    assert cli.json("topics", "describe", t)[0]["partitions"][4]["log_end_offset"] == 2
    assert "INVALID_PARTITIONS" in cli.fails("topics", "add-partitions", t, "--total", "2")

    assert cli.run("topics", "delete", t).stdout.strip() == f"Deleted topic {t}."
    assert t not in {d["name"] for d in cli.json("topics", "list")}
    assert cli.fails("topics", "describe", t) == f"Error: topic '{t}' does not exist"
    assert cli.fails("topics", "delete", t) == f"Error: topic '{t}' does not exist"
    assert cli.json("topics", "delete", t, "--if-exists") == [{"topic": t, "deleted": False}]


def _committed(cli: Cli, group: str) -> dict[int, int | None]:
    return {r["partition"]: r["current_offset"] for r in cli.json("groups", "describe", group)["offsets"]}


def test_groups_describe_reset_delete(cli: Cli, cli_broker: BrokerProcess) -> None:
    t, g = "cli-grp-topic", "cli-group"
    ts0 = int(time.time() * 1000) - 60_000
    cli.run("topics", "create", t, "--partitions", "2")
    _produce(cli_broker.bootstrap, t, {0: 6, 1: 4}, ts0=ts0)

    consumer = _consumer(cli_broker.bootstrap, g, t)
    try:
        _poll_until(consumer, 10)
        consumer.commit({TopicPartition(t, 0): OffsetAndMetadata(5, "", -1),
                         TopicPartition(t, 1): OffsetAndMetadata(4, "", -1)})
        listed = {d["group"]: d for d in cli.json("groups", "list")}
        assert listed[g] == {"group": g, "state": "Stable", "protocol_type": "consumer"}
        desc = cli.json("groups", "describe", g)
        assert desc["state"] == "Stable" and desc["protocol_type"] == "consumer"
        assert len(desc["members"]) == 1
        member = desc["members"][0]
        assert member["assignment"] == [{"topic": t, "partition": 0}, {"topic": t, "partition": 1}]
        assert [(r["partition"], r["current_offset"], r["log_end_offset"], r["lag"], r["member_id"])
                for r in desc["offsets"]] == [(0, 5, 6, 1, member["member_id"]),
                                              (1, 4, 4, 0, member["member_id"])]
        assert desc["total_lag"] == 1
        text = cli.run("groups", "describe", g).stdout
        assert f"Group: {g}  State: Stable" in text and "Total lag: 1" in text
        assert any(ln.split()[:5] == [t, "0", "5", "6", "1"] for ln in text.splitlines())

        # a live group is refused, as kafka-consumer-groups.sh refuses it (dry run too)
        for extra in ([], ["--execute"]):
            line = cli.fails("groups", "reset-offsets", g, "--topic", t, "--to-earliest", *extra)
            assert line == (f"Error: Assignments can only be reset if the group '{g}' is "
                            "inactive, but the current state is Stable.")
        assert "NON_EMPTY_GROUP" in cli.fails("groups", "delete", g)
        assert "GROUP_SUBSCRIBED_TO_TOPIC" in cli.fails("groups", "delete-offsets", g, "--topic", t)
    finally:
        consumer.close()
    assert _committed(cli, g) == {0: 5, 1: 4}
    assert cli.json("groups", "describe", g)["state"] == "Empty"

    # dry run (the default): the plan, nothing committed
    plan = cli.json("groups", "reset-offsets", g, "--topic", t, "--to-earliest")
    assert plan == {"group": g, "executed": False, "partitions": [
        {"topic": t, "partition": 0, "current_offset": 5, "new_offset": 0},
        {"topic": t, "partition": 1, "current_offset": 4, "new_offset": 0}]}
    dry = cli.run("groups", "reset-offsets", g, "--topic", t, "--to-earliest")
    assert "Dry run" in dry.stderr
    assert [ln.split() for ln in dry.stdout.splitlines()][1] == [g, t, "0", "5", "0"]
    assert _committed(cli, g) == {0: 5, 1: 4}

    # each way of choosing the offset, checked on its plan
    def new(*how: str) -> list[int]:
        return [p["new_offset"] for p in
                cli.json("groups", "reset-offsets", g, *how)["partitions"]]

    assert new("--all-topics", "--to-latest") == [6, 4]
    assert new("--topic", f"{t}:0", "--shift-by", "-2") == [3]
    assert new("--topic", f"{t}:0,1", "--shift-by", "-100") == [0, 0]   # clamped to the start
    assert new("--topic", t, "--to-offset", "3") == [3, 3]
    assert new("--topic", t, "--to-offset", "99") == [6, 4]             # clamped to the end
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime((ts0 + 2000) / 1000)) + \
        f".{(ts0 + 2000) % 1000:03d}Z"
    assert new("--topic", t, "--to-datetime", iso) == [2, 2]
    assert new("--topic", t, "--to-datetime", str(ts0 + 5000)) == [5, 4]  # p1 has no such record
    assert new("--topic", t, "--by-duration", "P1D") == [0, 0]      # every record is newer
    assert new("--topic", t, "--by-duration", "PT1S") == [6, 4]     # none is (ts0 is 60 s back)
    assert "does not exist" in cli.fails("groups", "reset-offsets", g, "--topic", "cli-nope",
                                          "--to-earliest")
    assert "no partition 7" in cli.fails("groups", "reset-offsets", g, "--topic", f"{t}:7",
                                          "--to-earliest")

    # --execute commits; a consumer of the group reads from there
    done = cli.json("groups", "reset-offsets", g, "--topic", f"{t}:0", "--to-offset", "2",
                    "--execute")
    assert done["executed"] is True
    assert _committed(cli, g) == {0: 2, 1: 4}
    consumer = _consumer(cli_broker.bootstrap, g, t)
    try:
        got = _poll_until(consumer, 4)
        assert sorted((r.partition, r.offset) for r in got) == [(0, 2), (0, 3), (0, 4), (0, 5)]
    finally:
        consumer.close()

    # delete-offsets: only the partition named
    out = cli.run("groups", "delete-offsets", g, "--topic", f"{t}:1").stdout.splitlines()
    assert [ln.split() for ln in out] == [["TOPIC", "PARTITION", "STATUS"], [t, "1", "Successful"]]
    assert _committed(cli, g) == {0: 2}

    # a brand-new group gets offsets from a reset (simple commit into an empty group)
    cli.run("groups", "reset-offsets", "cli-fresh", "--topic", t, "--to-latest", "--execute")
    assert _committed(cli, "cli-fresh") == {0: 6, 1: 4}
    # deleting a topic deletes the group's offsets of it, as in Kafka
    cli.run("topics", "create", "cli-gone")
    cli.run("groups", "reset-offsets", "cli-fresh", "--topic", "cli-gone", "--to-earliest",
            "--execute")
    assert ("cli-gone", 0) in {(r["topic"], r["partition"]) for r in
                               cli.json("groups", "describe", "cli-fresh")["offsets"]}
    cli.run("topics", "delete", "cli-gone")
    assert [(r["topic"], r["partition"], r["current_offset"]) for r in
            cli.json("groups", "describe", "cli-fresh")["offsets"]] == [(t, 0, 6), (t, 1, 4)]

    out = cli.run("groups", "delete", g, "cli-fresh").stdout.strip()
    assert out == f"Deletion of requested consumer groups ('cli-fresh', '{g}') was successful."
    assert cli.fails("groups", "describe", g) == f"Error: consumer group '{g}' does not exist"
    assert "GROUP_ID_NOT_FOUND" in cli.fails("groups", "delete", g)
    assert g not in {d["group"] for d in cli.json("groups", "list")}


def test_help_lists_admin_commands() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    top = subprocess.run([*COMMAND, "--help"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert top.returncode == 0
    for word in ("serve", "topics", "groups", "cluster"):
        assert f"    {word} " in top.stdout
    groups = subprocess.run([*COMMAND, "groups", "--help"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert groups.returncode == 0 and "reset-offsets" in groups.stdout


def test_errors_are_one_line_and_bounded(cli: Cli) -> None:
    start = time.monotonic()
    line = cli.fails("topics", "list", "--timeout", "2", bootstrap=f"127.0.0.1:{free_port()}")
    assert time.monotonic() - start < 20
    assert line.startswith("Error: cannot reach a broker at 127.0.0.1:")
    assert "the port must be a number" in cli.fails("topics", "list", bootstrap="127.0.0.1:x")
    # usage mistakes: argparse's exit code 2
    proc = cli.run("groups", "reset-offsets", "g", "--topic", "t", ok=False)
    assert proc.returncode == 2 and "--to-earliest" in proc.stderr
    assert cli.fails("groups", "reset-offsets", "g", "--topic", "t", "--to-datetime", "soon") \
        .startswith("Error: --to-datetime 'soon' is not an ISO date-time")
    assert cli.fails("groups", "reset-offsets", "g", "--topic", "t", "--by-duration", "30m") \
        .startswith("Error: --by-duration '30m' is not an ISO 8601 duration")


def test_log_offsets_skip_a_topic_the_broker_refuses() -> None:
    """kafka-python fails a whole ListOffsets call on one partition's error; the CLI then asks
    topic by topic and leaves out only the refusing one (e.g. an internal topic)."""
    from kafka.errors import UnknownTopicOrPartitionError
    from kafka.structs import OffsetAndTimestamp

    from broker.admincli.common import list_offsets

    class Admin:
        def list_partition_offsets(self, specs: dict) -> dict:
            if any(tp.topic == "__consumer_offsets" for tp in specs):
                raise UnknownTopicOrPartitionError("refused")
            return {tp: OffsetAndTimestamp(7, -1, None) for tp in specs}

    tps = [TopicPartition("__consumer_offsets", 0), TopicPartition("a", 0), TopicPartition("a", 1)]
    assert list_offsets(Admin(), tps, -1) == {TopicPartition("a", 0): 7, TopicPartition("a", 1): 7}
