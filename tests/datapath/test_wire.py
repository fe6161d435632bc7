"""Datapath handlers over real sockets against a running broker, with exact field checks."""
from __future__ import annotations

import threading
import uuid

import pytest

from kafka.protocol.admin import (DeleteRecordsRequest, DeleteRecordsResponse,
                                  DescribeProducersRequest, DescribeProducersResponse)
from kafka.protocol.consumer import (OffsetForLeaderEpochRequest,
                                     OffsetForLeaderEpochResponse)
from kafka.protocol.producer import ProduceResponse

from .batches import batch_headers, make_batch, read_records
from .conftest import SMALL_WAL
from .wire import WireClient

pytestmark = pytest.mark.e2e

E_NONE, E_OUT_OF_RANGE, E_CORRUPT, E_UNKNOWN = 0, 1, 2, 3
E_TOO_LARGE, E_OUT_OF_ORDER, E_INVALID_EPOCH, E_UNSUPPORTED_COMPRESSION = 10, 45, 47, 76


def _topic() -> str:
    return "dp-" + uuid.uuid4().hex[:10]


@pytest.fixture
def client(module_broker):
    with WireClient(module_broker.host, module_broker.port) as c:
        yield c


@pytest.mark.parametrize("acks", [0, 1, -1])
def test_acks(client, acks):
    t = _topic()
    client.create_topic(t)
    r = client.produce(t, make_batch([b"a", b"b"]), acks=acks)
    if acks == 0:
        assert r is None
        # the connection stays usable and the data lands
        part = client.fetch(t, 0, max_wait_ms=10000, min_bytes=1)
    else:
        assert (r.error_code, r.base_offset) == (E_NONE, 0)
        part = client.fetch(t, 0)
    assert [v for _, _, v in read_records(part.records)] == [b"a", b"b"]
    assert part.high_watermark == 2 and part.log_start_offset == 0


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_codecs_stored_as_sent(client, codec):
    t = _topic()
    client.create_topic(t)
    batch = make_batch([b"v" * 200, b"w" * 50], codec=codec)
    r = client.produce(t, batch, version=9)
    assert r.error_code == E_NONE
    part = client.fetch(t, 0)
    assert [v for _, _, v in read_records(part.records)] == [b"v" * 200, b"w" * 50]
    assert batch_headers(part.records)[0].compression_type == batch_headers(batch)[0].compression_type


def test_zstd_rejected_before_produce_v7(client):
    t = _topic()
    client.create_topic(t)
    r = client.produce(t, make_batch([b"z" * 500], codec="zstd"), version=6)
    assert r.error_code == E_UNSUPPORTED_COMPRESSION


def test_corrupt_batch_and_unknown_partition(client):
    t = _topic()
    client.create_topic(t)
    raw = bytearray(make_batch([b"payload-payload"]))
    raw[-2] ^= 0x55
    assert client.produce(t, bytes(raw)).error_code == E_CORRUPT
    assert client.produce(t, make_batch([b"x"]), partition=7).error_code == E_UNKNOWN
    # the connection still works
    assert client.produce(t, make_batch([b"x"])).error_code == E_NONE


def test_message_too_large(client):
    t = _topic()
    client.create_topic(t, configs={"max.message.bytes": "1000"})
    assert client.produce(t, make_batch([bytes(range(256)) * 8])).error_code == E_TOO_LARGE


def test_kip74_first_oversized_batch_returned(client):
    t = _topic()
    client.create_topic(t)
    big = make_batch([bytes(range(256)) * 400])  # ~100 KiB, incompressible enough
    small = make_batch([b"s"])
    client.produce(t, big)
    client.produce(t, small)
    part = client.fetch(t, 0, max_bytes=1000, partition_max_bytes=1000)
    recs = read_records(part.records)
    assert len(recs) == 1 and len(part.records) == len(big)
    # the next fetch from offset 1 gets the small one
    assert [v for _, _, v in read_records(client.fetch(t, 1).records)] == [b"s"]


def test_offset_out_of_range(client):
    t = _topic()
    client.create_topic(t)
    client.produce(t, make_batch([b"a"]))
    assert client.fetch(t, 5).error_code == E_OUT_OF_RANGE
    assert client.fetch(t, 1).error_code == E_NONE  # at the HW: empty, no error


def test_long_poll_woken_by_append(module_broker, client):
    t = _topic()
    client.create_topic(t)
    corr = client.send(client.fetch_request(t, 0, max_wait_ms=60000, min_bytes=1), 11)

    def produce_later() -> None:
        with WireClient(module_broker.host, module_broker.port) as other:
            other.produce(t, make_batch([b"wake"]))

    th = threading.Thread(target=produce_later)
    th.start()
    from kafka.protocol.consumer import FetchResponse
    resp = client.recv(FetchResponse, 11, corr)
    th.join()
    part = resp.responses[0].partitions[0]
    assert [v for _, _, v in read_records(part.records)] == [b"wake"]


def test_fetch_by_topic_id_v13(client):
    t = _topic()
    client.create_topic(t)
    client.produce(t, make_batch([b"id"]))
    tid = client.topic_id(t)
    part = client.fetch(t, 0, version=13, topic_id=tid)
    assert [v for _, _, v in read_records(part.records)] == [b"id"]


def test_read_committed_sees_stable_data(client):
    t = _topic()
    client.create_topic(t)
    client.produce(t, make_batch([b"c1", b"c2"]))
    part = client.fetch(t, 0, isolation_level=1)
    assert part.last_stable_offset == 2 and part.aborted_transactions == []
    assert len(read_records(part.records)) == 2
    assert client.list_offsets(t, -1, isolation_level=1).offset == 2


def test_list_offsets(client):
    t = _topic()
    client.create_topic(t)
    client.produce(t, make_batch([b"a", b"b"], timestamps=[1000, 2000]))
    client.produce(t, make_batch([b"c"], timestamps=[1500]))
    assert client.list_offsets(t, -2).offset == 0
    assert client.list_offsets(t, -1).offset == 3
    r = client.list_offsets(t, 1200)
    assert (r.offset, r.timestamp) == (1, 2000)
    r = client.list_offsets(t, -3)
    assert (r.offset, r.timestamp) == (1, 2000)
    assert client.list_offsets(t, 99999).offset == -1
    assert client.list_offsets(t, 1000, version=1).offset == 0


def test_log_append_time(client):
    t = _topic()
    client.create_topic(t, configs={"message.timestamp.type": "LogAppendTime"})
    r = client.produce(t, make_batch([b"a"], timestamps=[5]))
    assert r.error_code == E_NONE and r.log_append_time_ms > 1_600_000_000_000
    (h,) = batch_headers(client.fetch(t, 0).records)
    assert h.timestamp_type == 1 and h.max_timestamp == r.log_append_time_ms


def test_delete_records_and_leader_epoch(client):
    t = _topic()
    client.create_topic(t)
    for i in range(3):
        client.produce(t, make_batch([b"%d" % i]))
    DT = DeleteRecordsRequest.DeleteRecordsTopic
    req = DeleteRecordsRequest(topics=[DT(name=t, partitions=[
        DT.DeleteRecordsPartition(partition_index=0, offset=2)])], timeout_ms=1000)
    res = client.call(req, DeleteRecordsResponse, 2).topics[0].partitions[0]
    assert (res.error_code, res.low_watermark) == (E_NONE, 2)
    assert client.fetch(t, 0).error_code == E_OUT_OF_RANGE
    assert client.list_offsets(t, -2).offset == 2

    OT = OffsetForLeaderEpochRequest.OffsetForLeaderTopic
    req = OffsetForLeaderEpochRequest(replica_id=-1, topics=[OT(topic=t, partitions=[
        OT.OffsetForLeaderPartition(partition=0, current_leader_epoch=0, leader_epoch=0)])])
    res = client.call(req, OffsetForLeaderEpochResponse, 4).topics[0].partitions[0]
    assert (res.error_code, res.leader_epoch, res.end_offset) == (E_NONE, 0, 3)


def test_idempotent_producer_over_the_wire(client):
    t = _topic()
    client.create_topic(t)
    pid, epoch = client.init_producer_id()
    assert pid >= 0 and epoch == 0
    b0 = make_batch([b"a"], producer_id=pid, epoch=0, base_sequence=0)
    b1 = make_batch([b"b"], producer_id=pid, epoch=0, base_sequence=1)
    assert client.produce(t, b0).base_offset == 0
    assert client.produce(t, b1).base_offset == 1
    dup = client.produce(t, b0)
    assert (dup.error_code, dup.base_offset) == (E_NONE, 0)
    gap = client.produce(t, make_batch([b"c"], producer_id=pid, epoch=0, base_sequence=9))
    assert gap.error_code == E_OUT_OF_ORDER
    client.produce(t, make_batch([b"n"], producer_id=pid, epoch=1, base_sequence=0))
    stale = client.produce(t, make_batch([b"s"], producer_id=pid, epoch=0, base_sequence=2))
    assert stale.error_code == E_INVALID_EPOCH
    assert client.fetch(t, 0).high_watermark == 3
    req = DescribeProducersRequest(topics=[DescribeProducersRequest.TopicRequest(
        name=t, partition_indexes=[0])])
    res = client.call(req, DescribeProducersResponse, 0).topics[0].partitions[0]
    assert [(p.producer_id, p.producer_epoch, p.last_sequence)
            for p in res.active_producers] == [(pid, 1, 0)]
    assert client.init_producer_id()[0] != pid


@pytest.mark.parametrize("hard", [False, True], ids=["sigterm", "kill9"])
def test_producer_state_survives_restart(broker_factory, hard):
    broker = broker_factory(SMALL_WAL)
    t = _topic()
    with WireClient(broker.host, broker.port) as c:
        c.create_topic(t)
        pid, _ = c.init_producer_id()
        batches = [make_batch([b"%d" % i], producer_id=pid, epoch=0, base_sequence=i)
                   for i in range(3)]
        for i, b in enumerate(batches):
            assert c.produce(t, b).base_offset == i
    broker.restart(hard=hard)
    with WireClient(broker.host, broker.port) as c:
        # the whole durable log is visible as soon as the broker answers
        assert c.list_offsets(t, -1).offset == 3
        assert c.fetch(t, 0).high_watermark == 3
        dup = c.produce(t, batches[2])
        assert (dup.error_code, dup.base_offset) == (E_NONE, 2)
        gap = c.produce(t, make_batch([b"x"], producer_id=pid, epoch=0, base_sequence=5))
        assert gap.error_code == E_OUT_OF_ORDER
        nxt = c.produce(t, make_batch([b"3"], producer_id=pid, epoch=0, base_sequence=3))
        assert (nxt.error_code, nxt.base_offset) == (E_NONE, 3)
        assert c.init_producer_id()[0] > pid
        part = c.fetch(t, 0)
        assert [v for _, _, v in read_records(part.records)] == [b"0", b"1", b"2", b"3"]


def test_retention_in_a_running_broker(broker_factory):
    """retention.ms applied by the background task: old chunks go, the log start advances."""
    import os
    import time

    broker = broker_factory(["--retention-check-interval-ms", "50", *SMALL_WAL])
    t = _topic()
    old = int(time.time() * 1000) - 3_600_000
    with WireClient(broker.host, broker.port) as c:
        c.create_topic(t, configs={"retention.ms": "600000"})
        blob = os.urandom(600_000)
        for i in range(3):
            assert c.produce(t, make_batch([blob], timestamps=[old + i])).error_code == E_NONE
        assert c.produce(t, make_batch([b"fresh"])).error_code == E_NONE
        for _ in range(600):  # the task runs every 50 ms; give it up to a minute
            if c.list_offsets(t, -2).offset > 0:
                break
            time.sleep(0.1)
        assert c.list_offsets(t, -2).offset == 2
        part = c.fetch(t, 2)
        assert part.log_start_offset == 2
        assert [v for _, _, v in read_records(part.records)][-1] == b"fresh"


def test_pipelined_produces_append_in_request_order(client):
    """A request for several partitions and a one-partition request behind it on the same
    connection (the Java producer pipelines up to five): every partition sees the batches in
    request order. Appending the single-partition request first put sequence 1 ahead of
    sequence 0, and the client then re-sent record 0 under a new epoch, after its successors."""
    t = _topic()
    client.create_topic(t, partitions=2)
    pid, epoch = client.init_producer_id()
    first = client.produce_request(t, {p: make_batch([b"first-%d" % p], producer_id=pid,
                                                     epoch=epoch, base_sequence=0)
                                       for p in (0, 1)})
    second = client.produce_request(t, {0: make_batch([b"second-0"], producer_id=pid,
                                                      epoch=epoch, base_sequence=1)})
    (c1, f1), (c2, f2) = client.frame(first, 9), client.frame(second, 9)
    client.sock.sendall(f1 + f2)  # one write: the broker reads both frames at once
    r1 = client.recv(ProduceResponse, 9, c1)
    r2 = client.recv(ProduceResponse, 9, c2)
    assert [(p.index, p.error_code, p.base_offset)
            for p in r1.responses[0].partition_responses] == [(0, E_NONE, 0), (1, E_NONE, 0)]
    assert [(p.error_code, p.base_offset)
            for p in r2.responses[0].partition_responses] == [(E_NONE, 1)]
    assert [v for _, _, v in read_records(client.fetch(t, 0).records)] == [b"first-0",
                                                                         b"second-0"]
