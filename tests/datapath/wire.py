"""A tiny blocking Kafka wire client for exact protocol assertions in tests.

Real clients hide the fields these tests check (base offsets of duplicates, error codes,
KIP-74 sizes), so requests are built with kafka-python's message classes and sent over a plain
socket.
"""
from __future__ import annotations

import itertools
import socket
import struct
import uuid
from typing import Any

from kafka.protocol.admin import CreateTopicsRequest, CreateTopicsResponse
from kafka.protocol.consumer import (FetchRequest, FetchResponse, ListOffsetsRequest,
                                     ListOffsetsResponse)
from kafka.protocol.metadata import MetadataRequest, MetadataResponse
from kafka.protocol.producer import (InitProducerIdRequest, InitProducerIdResponse,
                                     ProduceRequest, ProduceResponse)


class WireClient:
    """One connection; ``call`` sends a request and returns the decoded response."""

    def __init__(self, host: str, port: int, timeout: float = 60.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self._corr = itertools.count(1)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "WireClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, req: Any, version: int) -> int:
        corr = next(self._corr)
        req.with_header(correlation_id=corr, client_id="datapath-tests")
        self.sock.sendall(req.encode(version=version, header=True, framed=True))
        return corr

    def recv(self, resp_cls: Any, version: int, corr: int) -> Any:
        (size,) = struct.unpack(">i", self._exact(4))
        data = self._exact(size)
        resp = resp_cls.decode(data, version=version, header=True)
        assert resp.header.correlation_id == corr
        return resp

    def call(self, req: Any, resp_cls: Any, version: int) -> Any:
        return self.recv(resp_cls, version, self.send(req, version))

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("broker closed the connection")
            buf += chunk
        return bytes(buf)

    # --- conveniences ---------------------------------------------------------------------
    def create_topic(self, name: str, partitions: int = 1,
                     configs: dict[str, str] | None = None) -> None:
        T = CreateTopicsRequest.CreatableTopic
        C = T.CreatableTopicConfig
        req = CreateTopicsRequest(
            topics=[T(name=name, num_partitions=partitions, replication_factor=1, assignments=[],
                      configs=[C(name=k, value=v) for k, v in (configs or {}).items()])],
            timeout_ms=30000, validate_only=False)
        resp = self.call(req, CreateTopicsResponse, 5)
        assert resp.topics[0].error_code in (0, 36), resp

    def topic_id(self, name: str) -> uuid.UUID:
        T = MetadataRequest.MetadataRequestTopic
        resp = self.call(MetadataRequest(topics=[T(name=name)], allow_auto_topic_creation=False,
                                         include_topic_authorized_operations=False),
                         MetadataResponse, 12)
        return resp.topics[0].topic_id

    def produce(self, topic: str, records: bytes, partition: int = 0, acks: int = -1,
                version: int = 9) -> Any:
        """Partition response of a one-partition Produce (None for acks=0)."""
        TD = ProduceRequest.TopicProduceData
        PD = TD.PartitionProduceData
        req = ProduceRequest(transactional_id=None, acks=acks, timeout_ms=30000,
                             topic_data=[TD(name=topic, partition_data=[
                                 PD(index=partition, records=records)])])
        corr = self.send(req, version)
        if acks == 0:
            return None
        resp = self.recv(ProduceResponse, version, corr)
        return resp.responses[0].partition_responses[0]

    def fetch_request(self, topic: str, offset: int, *, partition: int = 0,
                      max_wait_ms: int = 0, min_bytes: int = 0, max_bytes: int = 50 << 20,
                      partition_max_bytes: int = 10 << 20, isolation_level: int = 0,
                      topic_id: uuid.UUID | None = None) -> Any:
        FT = FetchRequest.FetchTopic
        FP = FT.FetchPartition
        part = FP(partition=partition, current_leader_epoch=-1, fetch_offset=offset,
                  last_fetched_epoch=-1, log_start_offset=-1,
                  partition_max_bytes=partition_max_bytes)
        topic_kw = {"topic_id": topic_id} if topic_id is not None else {"topic": topic}
        return FetchRequest(replica_id=-1, max_wait_ms=max_wait_ms, min_bytes=min_bytes,
                            max_bytes=max_bytes, isolation_level=isolation_level,
                            session_id=0, session_epoch=-1,
                            topics=[FT(partitions=[part], **topic_kw)],
                            forgotten_topics_data=[], rack_id="")

    def fetch(self, topic: str, offset: int, version: int = 11, **kw: Any) -> Any:
        """Partition data of a one-partition Fetch."""
        resp = self.call(self.fetch_request(topic, offset, **kw), FetchResponse, version)
        return resp.responses[0].partitions[0]

    def list_offsets(self, topic: str, timestamp: int, partition: int = 0, version: int = 7,
                     isolation_level: int = 0) -> Any:
        LT = ListOffsetsRequest.ListOffsetsTopic
        LP = LT.ListOffsetsPartition
        req = ListOffsetsRequest(replica_id=-1, isolation_level=isolation_level, topics=[
            LT(name=topic, partitions=[LP(partition_index=partition, current_leader_epoch=-1,
                                         timestamp=timestamp, max_num_offsets=1)])])
        resp = self.call(req, ListOffsetsResponse, version)
        return resp.topics[0].partitions[0]

    def init_producer_id(self, version: int = 4) -> tuple[int, int]:
        resp = self.call(InitProducerIdRequest(transactional_id=None,
                                               transaction_timeout_ms=60000, producer_id=-1,
                                               producer_epoch=-1),
                         InitProducerIdResponse, version)
        assert resp.error_code == 0
        return resp.producer_id, resp.producer_epoch
