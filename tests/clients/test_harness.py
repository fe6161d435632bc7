"""The shared harness itself: the moto S3 fixture keeps its port across stop/start, the broker
fixture restarts on its address, the group-of-three run counts what members deliver."""
import time

import boto3


def test_s3_endpoint_restart_keeps_port(s3_endpoint):
    s3 = boto3.client("s3", endpoint_url=s3_endpoint.url, region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="harness")
    s3.put_object(Bucket="harness", Key="k", Body=b"v")
    assert s3.get_object(Bucket="harness", Key="k")["Body"].read() == b"v"
    url = s3_endpoint.url
    s3_endpoint.stop()
    s3_endpoint.start()
    assert s3_endpoint.url == url
    s3.create_bucket(Bucket="harness2")
    assert "harness2" in [b["Name"] for b in s3.list_buckets()["Buckets"]]


def test_broker_fixture_restarts_on_the_same_port(broker):
    """stop() (SIGTERM, clean exit) and kill() both leave a broker that start() brings back
    on the same address with the same data directory."""
    from datapath.wire import api_versions_roundtrip
    address = broker.bootstrap
    assert broker.running and api_versions_roundtrip(broker.host, broker.port)
    broker.stop()
    assert not broker.running and not api_versions_roundtrip(broker.host, broker.port)
    broker.start()
    assert broker.bootstrap == address and api_versions_roundtrip(broker.host, broker.port)
    broker.kill()
    assert not broker.running
    broker.start()
    assert broker.running and broker.data_dir.exists()
    assert broker.log_text().count("===== start") == 3


class _ScriptedMember:
    """A consumer that splits 6 partitions with the live members (3 ways, then 2, then 1) and,
    like a consumer process, hands over its last values only while closing."""

    def __init__(self, i: int, alive: set[int], late: list[str]) -> None:
        self.i, self.alive, self.late, self.closed = i, alive, late, False
        alive.add(i)

    def poll_once(self) -> list[str]:
        time.sleep(0.01)
        return [f"v{self.i}"]

    def assignment(self) -> set[int]:
        if self.closed:
            return set()
        if 2 in self.alive:
            return {0: {0, 1}, 1: {2, 3}, 2: {4, 5}}[self.i]
        if {0, 1} <= self.alive:
            return {0: {0, 1, 2}, 1: {3, 4, 5}}[self.i]
        return {0, 1, 2, 3, 4, 5}

    def close(self) -> None:
        self.closed = True
        self.alive.discard(self.i)

    def drain(self) -> list[str]:
        return self.late


def test_group_run_counts_values_a_member_delivers_while_closing():
    """Values a member hands over while it closes (kcat prints records after its last poll
    and commits them on exit) count as seen: the others will never receive them again."""
    from clients.e2e_helpers import run_group_of_three
    alive: set[int] = set()
    late = {2: ["late-0", "late-1"]}
    run = run_group_of_three(lambda i: _ScriptedMember(i, alive, late.get(i, [])), 6,
                             {"v0", "v1", "v2", "late-0", "late-1"}, timeout=15)
    assert {"late-0", "late-1"} <= run.seen
