"""Every datapath handler over its whole advertised version range, through the real codecs.

Requests are encoded by kafka-python (as a client would), decoded by protocol.parse_request,
handled, encoded by protocol.encode_response and decoded again by kafka-python: this catches
version-specific fields the handlers fill wrongly, without needing a server process.
"""
from __future__ import annotations

import struct
import types
import uuid

import pytest

import broker.handlers.fetch  # noqa: F401 - registers handlers
import broker.handlers.offsets_list  # noqa: F401
import broker.handlers.produce  # noqa: F401
import broker.handlers.producers  # noqa: F401
import broker.handlers.records_admin  # noqa: F401
import protocol
from broker.handlers.registry import HANDLERS, Framed, RequestContext
from broker.partition import Partition
from storage.memory import MemoryStreamStore

from .batches import make_batch, read_records

TID = uuid.UUID("11111111-2222-3333-4444-555555555555")


async def make_broker(tmp_path, name: str = "t", partitions: int = 2):
    store = MemoryStreamStore()
    b = types.SimpleNamespace(config=types.SimpleNamespace(data_dir=str(tmp_path)), topics={},
                              store=store)
    parts = [await Partition.open(b, name, TID, i, await store.create_stream(), {})
             for i in range(partitions)]
    b.topics[name] = types.SimpleNamespace(name=name, topic_id=TID, partitions=parts,
                                           configs={})
    return b


async def roundtrip(b, api_key: int, version: int, req):
    req.with_header(correlation_id=77, client_id="t")
    frame = req.encode(version=version, header=True, framed=False)
    header, decoded = protocol.parse_request(bytearray(frame))
    resp = await HANDLERS[api_key](RequestContext(broker=b, header=header, conn=None), decoded)
    if resp is None:
        return None
    # a one-partition Produce success comes framed whole (Framed), as the server writes it
    out = b"".join(resp) if type(resp) is Framed else protocol.encode_response(header, resp)
    (size,) = struct.unpack_from(">i", out, 0)
    assert size == len(out) - 4
    return protocol.response_class(api_key).decode(out[4:], version=version, header=True)


def versions(api_key: int) -> list[int]:
    lo, hi = protocol.SUPPORTED_APIS[api_key]
    return list(range(lo, hi + 1))


@pytest.mark.parametrize("version", versions(0))
async def test_produce_versions(tmp_path, version):
    b = await make_broker(tmp_path)
    Req = protocol.request_class(0)
    TD, PD = Req.TopicProduceData, Req.TopicProduceData.PartitionProduceData
    magic = 1 if version < 3 else 2
    td = TD(topic_id=TID) if version >= 13 else TD(name="t")
    td.partition_data = [PD(index=1, records=make_batch([b"a", b"b"], magic=magic)),
                         PD(index=5, records=make_batch([b"c"], magic=magic))]
    req = Req(transactional_id=None, acks=-1, timeout_ms=1000, topic_data=[td])
    resp = await roundtrip(b, 0, version, req)
    p1, p5 = resp.responses[0].partition_responses
    assert (p1.index, p1.error_code, p1.base_offset) == (1, 0, 0)
    assert (p5.index, p5.error_code) == (5, 3)
    assert b.topics["t"].partitions[1].high_watermark == 2


@pytest.mark.parametrize("version", versions(0))
async def test_a_one_partition_produce_success_is_framed_whole(tmp_path, version):
    """The task path's common answer (handle_produce, one partition appended) comes framed in
    one piece (``Framed``: no body encoding in the handler, no header encoding in the server's
    flush), byte for byte what the generic body encoder writes behind its response header."""
    from protocol.produce_fast import encode_produce_response  # noqa: PLC0415
    b = await make_broker(tmp_path)
    Req = protocol.request_class(0)
    TD, PD = Req.TopicProduceData, Req.TopicProduceData.PartitionProduceData
    magic = 1 if version < 3 else 2
    td = TD(topic_id=TID) if version >= 13 else TD(name="t")
    td.partition_data = [PD(index=1, records=make_batch([b"a", b"b"], magic=magic))]
    req = Req(transactional_id=None, acks=-1, timeout_ms=1000, topic_data=[td])
    req.with_header(correlation_id=91, client_id="t")
    header, decoded = protocol.parse_request(bytearray(
        req.encode(version=version, header=True, framed=False)))
    for base in (0, 2):
        got = await HANDLERS[0](RequestContext(broker=b, header=header, conn=None), decoded)
        assert type(got) is Framed
        p = protocol.response_class(0).decode(b"".join(got)[4:], version=version,
                                              header=True).responses[0].partition_responses[0]
        assert (p.index, p.error_code, p.base_offset) == (1, 0, base)
        want = protocol.encode_response_parts(header, [encode_produce_response(version, [(
            TID if version >= 13 else "t",
            [(1, 0, base, getattr(p, "log_append_time_ms", -1),
              getattr(p, "log_start_offset", -1), None)])])])
        assert b"".join(got) == b"".join(bytes(x) for x in want)
        decoded = protocol.parse_request(bytearray(
            req.encode(version=version, header=True, framed=False)))[1]


async def test_produce_acks0_has_no_response(tmp_path):
    b = await make_broker(tmp_path)
    Req = protocol.request_class(0)
    TD, PD = Req.TopicProduceData, Req.TopicProduceData.PartitionProduceData
    req = Req(transactional_id=None, acks=0, timeout_ms=1000,
              topic_data=[TD(name="t", partition_data=[PD(index=0, records=make_batch([b"x"]))])])
    assert await roundtrip(b, 0, 9, req) is None
    assert b.topics["t"].partitions[0].high_watermark == 1


@pytest.mark.parametrize("version", versions(1))
async def test_fetch_versions(tmp_path, version):
    b = await make_broker(tmp_path)
    await b.topics["t"].partitions[0].append(make_batch([b"f1", b"f2"]))
    Req = protocol.request_class(1)
    FT, FP = Req.FetchTopic, Req.FetchTopic.FetchPartition
    ft = FT(topic_id=TID) if version >= 13 else FT(topic="t")
    ft.partitions = [FP(partition=0, current_leader_epoch=-1, fetch_offset=0,
                        last_fetched_epoch=-1, log_start_offset=-1, partition_max_bytes=1 << 20),
                     FP(partition=9, current_leader_epoch=-1, fetch_offset=0,
                        last_fetched_epoch=-1, log_start_offset=-1, partition_max_bytes=1 << 20)]
    req = Req(replica_id=-1, max_wait_ms=0, min_bytes=0, max_bytes=1 << 20, isolation_level=0,
              session_id=0, session_epoch=-1, topics=[ft], forgotten_topics_data=[], rack_id="")
    resp = await roundtrip(b, 1, version, req)
    p0, p9 = resp.responses[0].partitions
    assert p0.error_code == 0 and p0.high_watermark == 2
    assert [v for _, _, v in read_records(p0.records)] == [b"f1", b"f2"]
    assert p9.error_code in (3, 100)
    if version >= 7:
        assert resp.session_id == 0


@pytest.mark.parametrize("version", versions(2))
async def test_list_offsets_versions(tmp_path, version):
    b = await make_broker(tmp_path)
    await b.topics["t"].partitions[0].append(make_batch([b"a", b"b"], timestamps=[10, 20]))
    Req = protocol.request_class(2)
    LT, LP = Req.ListOffsetsTopic, Req.ListOffsetsTopic.ListOffsetsPartition
    ts = [-1, -2, 15] + ([-3] if version >= 7 else [])
    req = Req(replica_id=-1, isolation_level=0, topics=[LT(name="t", partitions=[
        LP(partition_index=0, current_leader_epoch=-1, timestamp=t, max_num_offsets=1)
        for t in ts])])
    resp = await roundtrip(b, 2, version, req)
    if version == 0:
        offs = [p.old_style_offsets[0] for p in resp.topics[0].partitions]
    else:
        offs = [p.offset for p in resp.topics[0].partitions]
    assert offs == [2, 0, 1] + ([1] if version >= 7 else [])


@pytest.mark.parametrize("version", versions(21))
async def test_delete_records_versions(tmp_path, version):
    b = await make_broker(tmp_path)
    await b.topics["t"].partitions[0].append(make_batch([b"a", b"b", b"c"]))
    Req = protocol.request_class(21)
    DT = Req.DeleteRecordsTopic
    req = Req(topics=[DT(name="t", partitions=[
        DT.DeleteRecordsPartition(partition_index=0, offset=2),
        DT.DeleteRecordsPartition(partition_index=1, offset=5)])], timeout_ms=100)
    resp = await roundtrip(b, 21, version, req)
    p0, p1 = resp.topics[0].partitions
    assert (p0.error_code, p0.low_watermark) == (0, 2)
    assert p1.error_code == 1


@pytest.mark.parametrize("version", versions(23))
async def test_offset_for_leader_epoch_versions(tmp_path, version):
    b = await make_broker(tmp_path)
    await b.topics["t"].partitions[0].append(make_batch([b"a"]))
    Req = protocol.request_class(23)
    OT, OP = Req.OffsetForLeaderTopic, Req.OffsetForLeaderTopic.OffsetForLeaderPartition
    req = Req(replica_id=-1, topics=[OT(topic="t", partitions=[
        OP(partition=0, current_leader_epoch=-1, leader_epoch=0),
        OP(partition=0, current_leader_epoch=-1, leader_epoch=3)])])
    resp = await roundtrip(b, 23, version, req)
    a, c = resp.topics[0].partitions
    assert (a.error_code, a.leader_epoch, a.end_offset) == (0, 0, 1)
    assert (c.leader_epoch, c.end_offset) == (-1, -1)


@pytest.mark.parametrize("version", versions(22))
async def test_init_producer_id_versions(tmp_path, version):
    b = await make_broker(tmp_path)
    Req = protocol.request_class(22)
    req = Req(transactional_id=None, transaction_timeout_ms=1000, producer_id=-1,
              producer_epoch=-1)
    r1 = await roundtrip(b, 22, version, req)
    r2 = await roundtrip(b, 22, version, Req(transactional_id=None, transaction_timeout_ms=1000,
                                             producer_id=-1, producer_epoch=-1))
    assert r1.error_code == 0 and r1.producer_epoch == 0
    assert r2.producer_id != r1.producer_id


@pytest.mark.parametrize("version", versions(61))
async def test_describe_producers_versions(tmp_path, version):
    b = await make_broker(tmp_path)
    await b.topics["t"].partitions[0].append(make_batch([b"a"], producer_id=5, epoch=2,
                                                         base_sequence=0))
    Req = protocol.request_class(61)
    req = Req(topics=[Req.TopicRequest(name="t", partition_indexes=[0, 4])])
    resp = await roundtrip(b, 61, version, req)
    p0, p4 = resp.topics[0].partitions
    assert [(s.producer_id, s.producer_epoch, s.last_sequence) for s in p0.active_producers] \
        == [(5, 2, 0)]
    assert p4.error_code == 3
