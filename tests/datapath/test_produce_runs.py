"""Pipelined Produce requests read together are appended as one run (broker/server.py
``_start_run``, broker/handlers/produce.py ``handle_produce_run``): each request is answered
with exactly the offsets it would have had alone, in request order, and anything the run
cannot take (an idempotent producer, a corrupt batch) is handled one request at a time."""
from __future__ import annotations

import uuid

import pytest

from kafka.protocol.metadata import MetadataRequest, MetadataResponse
from kafka.protocol.producer import ProduceResponse

from tests.conftest import free_port

from .batches import make_batch, read_records
from .conftest import SMALL_WAL
from .wire import WireClient, metric

pytestmark = pytest.mark.e2e

E_NONE, E_CORRUPT = 0, 2


@pytest.fixture(scope="module")
def broker(module_broker_factory):
    port = free_port()
    b = module_broker_factory([*SMALL_WAL, "--metrics-listen", f"127.0.0.1:{port}"])
    b.metrics_url = f"http://127.0.0.1:{port}/metrics"
    return b


@pytest.fixture
def client(broker):
    with WireClient(broker.host, broker.port) as c:
        yield c


def _topic() -> str:
    return "run-" + uuid.uuid4().hex[:10]


def _metric(broker, name: str) -> float:
    return metric(broker.metrics_url, name)


def _pipeline(client: WireClient, topic: str, batches: list[bytes], version: int = 9,
              partition: int = 0) -> list:
    """Send one Produce per batch in a single write; the partition answers, in order."""
    corrs, data = [], b""
    for b in batches:
        corr, frame = client.frame(client.produce_request(topic, {partition: b}), version)
        corrs.append(corr)
        data += frame
    client.sock.sendall(data)
    return [client.recv(ProduceResponse, version, c).responses[0].partition_responses[0]
            for c in corrs]


def _values(client: WireClient, topic: str, end: int) -> list[bytes]:
    out: list[bytes] = []
    while len(out) < end:
        part = client.fetch(topic, len(out))
        got = [v for _, _, v in read_records(part.records)]
        assert got, f"fetch at {len(out)} returned nothing"
        out += got
    return out


@pytest.mark.parametrize("version", [3, 9])
def test_pipelined_requests_get_the_offsets_they_would_have_alone(broker, client, version):
    t = _topic()
    client.create_topic(t)
    runs_before = _metric(broker, "s3kafka_request_run_members_total")
    sizes = [1 + (i % 4) for i in range(40)]
    batches = [make_batch([f"{i}-{j}".encode() for j in range(n)]) for i, n in enumerate(sizes)]
    resps = _pipeline(client, t, batches, version)
    assert [r.error_code for r in resps] == [E_NONE] * len(batches)
    expected = [sum(sizes[:i]) for i in range(len(sizes))]
    assert [r.base_offset for r in resps] == expected
    assert _values(client, t, sum(sizes)) == [f"{i}-{j}".encode() for i, n in enumerate(sizes)
                                              for j in range(n)]
    # the requests were read together: at least some went through a run
    assert _metric(broker, "s3kafka_request_run_members_total") > runs_before
    # and the next request appends after them
    assert client.produce(t, make_batch([b"after"])).base_offset == sum(sizes)


def test_a_corrupt_request_in_a_run_fails_alone(client):
    t = _topic()
    client.create_topic(t)
    batches = [make_batch([f"v{i}".encode()]) for i in range(6)]
    bad = bytearray(batches[3])
    bad[-2] ^= 0x55
    batches[3] = bytes(bad)
    resps = _pipeline(client, t, batches)
    assert [r.error_code for r in resps] == [E_NONE, E_NONE, E_NONE, E_CORRUPT, E_NONE, E_NONE]
    assert [r.base_offset for r in resps if r.error_code == E_NONE] == [0, 1, 2, 3, 4]
    assert _values(client, t, 5) == [b"v0", b"v1", b"v2", b"v4", b"v5"]


def test_idempotent_pipelined_batches_and_their_retries(client):
    t = _topic()
    client.create_topic(t)
    pid, epoch = client.init_producer_id()
    batches = [make_batch([f"i{s}".encode()], producer_id=pid, epoch=epoch, base_sequence=s)
               for s in range(8)]
    first = _pipeline(client, t, batches)
    assert [(r.error_code, r.base_offset) for r in first] == [(E_NONE, s) for s in range(8)]
    again = _pipeline(client, t, batches[3:])      # retries: answered with their offsets
    assert [(r.error_code, r.base_offset) for r in again] == [(E_NONE, s) for s in range(3, 8)]
    assert _values(client, t, 8) == [f"i{s}".encode() for s in range(8)]


def test_a_run_broken_by_another_request_keeps_the_order(client):
    t = _topic()
    client.create_topic(t)
    T = MetadataRequest.MetadataRequestTopic
    frames, corrs = b"", []
    for i in range(3):
        c, f = client.frame(client.produce_request(t, {0: make_batch([f"a{i}".encode()])}), 9)
        frames += f
        corrs.append(("p", c))
    c, f = client.frame(MetadataRequest(topics=[T(name=t)], allow_auto_topic_creation=False,
                                        include_topic_authorized_operations=False), 12)
    frames += f
    corrs.append(("m", c))
    for i in range(3, 6):
        c, f = client.frame(client.produce_request(t, {0: make_batch([f"a{i}".encode()])}), 9)
        frames += f
        corrs.append(("p", c))
    client.sock.sendall(frames)
    offsets = []
    for kind, c in corrs:
        if kind == "m":
            assert client.recv(MetadataResponse, 12, c).topics[0].name == t
        else:
            r = client.recv(ProduceResponse, 9, c).responses[0].partition_responses[0]
            assert r.error_code == E_NONE
            offsets.append(r.base_offset)
    assert offsets == list(range(6))
    assert _values(client, t, 6) == [f"a{i}".encode() for i in range(6)]


def test_lone_small_requests_are_appended_without_a_task(broker, client):
    """A small plain request that arrives alone goes the task-less path (Partition.append_now:
    offsets taken in the read's loop step, answered from the WAL completion) with the same
    answers and log as the task path."""
    t = _topic()
    client.create_topic(t)
    direct = _metric(broker, "s3kafka_request_direct_total")
    offsets = [client.produce(t, make_batch([f"d{i}".encode(), b"x"])).base_offset
               for i in range(5)]
    assert offsets == [0, 2, 4, 6, 8]
    assert _metric(broker, "s3kafka_request_direct_total") >= direct + 5
    assert _values(client, t, 10) == [v for i in range(5) for v in (f"d{i}".encode(), b"x")]
    bad = bytearray(make_batch([b"bad"]))
    bad[-2] ^= 0x55
    r = client.produce(t, bytes(bad))
    assert r.error_code == E_CORRUPT
    assert client.produce(t, make_batch([b"after"])).base_offset == 10


def test_a_request_behind_a_task_path_produce_keeps_the_order(client):
    """A Produce that needs a task (two partitions) and a small one for the same partition
    read together: the small one must not take its offsets before the task's first step."""
    t = _topic()
    client.create_topic(t, partitions=2)
    frames, corrs = b"", []
    for records in ({0: make_batch([b"a"])}, {0: make_batch([b"b"]), 1: make_batch([b"z"])},
                    {0: make_batch([b"c"])}, {0: make_batch([b"d"])}):
        c, f = client.frame(client.produce_request(t, records), 9)
        frames += f
        corrs.append(c)
    client.sock.sendall(frames)
    resps = [client.recv(ProduceResponse, 9, c).responses[0].partition_responses
             for c in corrs]
    by_req = [{p.index: (p.error_code, p.base_offset) for p in parts} for parts in resps]
    assert by_req == [{0: (E_NONE, 0)}, {0: (E_NONE, 1), 1: (E_NONE, 0)}, {0: (E_NONE, 2)},
                      {0: (E_NONE, 3)}]
    assert _values(client, t, 4) == [b"a", b"b", b"c", b"d"]


def test_a_lone_request_over_the_run_size_is_appended_without_a_task_and_never_merged(
        broker, client):
    """Requests of 16-64 KiB of batches (a linger-0 client's backlog after a stall) are not
    merged into runs (the merge copies) but still take the task-less path, each alone."""
    t = _topic()
    client.create_topic(t)
    direct = _metric(broker, "s3kafka_request_direct_total")
    members = _metric(broker, "s3kafka_request_run_members_total")
    big = [make_batch([f"{i}-{j}".encode() * 50 for j in range(200)]) for i in range(4)]
    assert all(16 << 10 < len(b) < 60 << 10 for b in big)
    resps = _pipeline(client, t, big)
    assert [(r.error_code, r.base_offset) for r in resps] == [(E_NONE, 200 * i) for i in range(4)]
    assert _metric(broker, "s3kafka_request_direct_total") >= direct + 4
    assert _metric(broker, "s3kafka_request_run_members_total") == members
    assert _values(client, t, 800) == [f"{i}-{j}".encode() * 50 for i in range(4)
                                       for j in range(200)]


def test_a_large_lone_request_is_appended_without_a_task_its_crc_checked_in_the_wal_copy(
        broker, client):
    """A request of one large plain batch (received into a pooled frame of its own) takes the
    task-less path too: its batch CRC is checked in the WAL's copy (EngineStream.append_now
    ``check``), so a corrupt one is answered CORRUPT_MESSAGE with nothing appended - also when
    it is over max.message.bytes as well - and the next one gets the next offsets."""
    t = _topic()
    client.create_topic(t, configs={"max.message.bytes": str(400 << 10)})
    direct = _metric(broker, "s3kafka_request_direct_total")
    big = [make_batch([f"{i}-{j}".encode() * 100 for j in range(500)]) for i in range(3)]
    assert all(200 << 10 < len(b) < 400 << 10 for b in big)
    resps = [client.produce(t, b) for b in big[:2]]
    assert [(r.error_code, r.base_offset) for r in resps] == [(E_NONE, 0), (E_NONE, 500)]
    assert _metric(broker, "s3kafka_request_direct_total") >= direct + 2
    bad = bytearray(big[2])
    bad[len(bad) // 2] ^= 0x55                       # inside the records: the batch CRC fails
    assert client.produce(t, bytes(bad)).error_code == E_CORRUPT
    huge = bytearray(make_batch([b"h" * 1000] * 500))     # > max.message.bytes, and corrupt
    assert len(huge) > 400 << 10
    huge[len(huge) // 2] ^= 0x55
    assert client.produce(t, bytes(huge)).error_code == E_CORRUPT
    r = client.produce(t, big[2])
    assert (r.error_code, r.base_offset) == (E_NONE, 1000)
    assert _values(client, t, 1500) == [f"{i}-{j}".encode() * 100 for i in range(3)
                                        for j in range(500)]
