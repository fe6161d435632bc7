"""A tiny blocking Kafka wire client for exact protocol assertions in tests.

Real clients hide the fields these tests check (base offsets of duplicates, error codes,
KIP-74 sizes), so requests are built with kafka-python's message classes and sent over a plain
socket. The socket helpers below (one exact read, one length-prefixed frame, one request on a
fresh connection) are the ones every raw-socket test in tests/ uses.
"""
from __future__ import annotations

import re
import socket
import struct
import urllib.request
import uuid
from typing import Any

from kafka.protocol.admin import CreateTopicsRequest, CreateTopicsResponse
from kafka.protocol.consumer import (FetchRequest, FetchResponse, ListOffsetsRequest,
                                     ListOffsetsResponse)
from kafka.protocol.metadata import MetadataRequest, MetadataResponse
from kafka.protocol.producer import (InitProducerIdRequest, InitProducerIdResponse,
                                     ProduceRequest, ProduceResponse)

MAX_FRAME = 1 << 30


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; ConnectionError when the broker closes the connection first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, max_size: int = MAX_FRAME) -> bytes:
    """One response frame without its 4-byte length prefix; ValueError for a length outside
    0..max_size (a broker bug, reported instead of reading garbage forever)."""
    (size,) = struct.unpack(">i", recv_exact(sock, 4))
    if not 0 <= size <= max_size:
        raise ValueError(f"response frame length {size} outside 0..{max_size}")
    return recv_exact(sock, size)


def framed(body: bytes) -> bytes:
    """``body`` with its 4-byte big-endian length prefix."""
    return struct.pack(">i", len(body)) + body


def roundtrip(host: str, port: int, body: bytes, timeout: float,
              max_size: int = MAX_FRAME) -> bytes:
    """Send one request (``body`` = header + payload, unframed) on a fresh connection and return
    the response frame. Raises OSError (connection) or ValueError (frame length)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(framed(body))
        return recv_frame(s, max_size)


def api_versions_roundtrip(host: str, port: int, timeout: float = 2.0) -> bool:
    """Send ApiVersions v0 and check a well-formed, error-free answer with our correlation id.

    A port that accepts is not enough: the broker must also decode and answer requests. The
    answer is checked from its first bytes, not with the protocol package under test.
    """
    correlation_id = 0x5EED
    client_id = b"s3kafka-tests"
    body = struct.pack(">hhih", 18, 0, correlation_id, len(client_id)) + client_id
    try:
        resp = roundtrip(host, port, body, timeout, max_size=1 << 20)
    except (OSError, ValueError):
        return False
    if len(resp) < 6:
        return False
    corr, error_code = struct.unpack_from(">ih", resp, 0)
    return corr == correlation_id and error_code == 0


def metric(url: str, name: str, missing: float | None = 0.0) -> float | None:
    """The value of the unlabelled sample ``name`` on a broker's /metrics page at ``url``
    (``missing`` when the page has none)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else missing


def metric_at(port: int, name: str) -> float | None:
    """``metric`` of the broker whose /metrics listens on 127.0.0.1:``port``; None when the
    page lacks it (so an assertion on an absent counter fails)."""
    return metric(f"http://127.0.0.1:{port}/metrics", name, None)


class WireClient:
    """One connection; ``call`` sends a request and returns the decoded response."""

    def __init__(self, host: str, port: int, timeout: float = 60.0,
                 client_id: str = "datapath-tests") -> None:
        self.addr = (host, port)
        self.timeout = timeout
        self.client_id = client_id
        self.correlation_id = 0          # of the last request sent
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=self.timeout)
        sock.settimeout(self.timeout)
        return sock

    def reconnect(self) -> None:
        """A fresh connection (after the broker closed this one on purpose)."""
        self.close()
        self.sock = self._connect()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "WireClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def frame(self, req: Any, version: int) -> tuple[int, bytes]:
        """The next correlation id and ``req`` framed with it (send several in one write)."""
        self.correlation_id += 1
        corr = self.correlation_id
        req.with_header(correlation_id=corr, client_id=self.client_id)
        return corr, req.encode(version=version, header=True, framed=True)

    def send(self, req: Any, version: int) -> int:
        corr, data = self.frame(req, version)
        self.sock.sendall(data)
        return corr

    def recv_frame(self, max_size: int = MAX_FRAME) -> bytes:
        return recv_frame(self.sock, max_size)

    def recv(self, resp_cls: Any, version: int, corr: int) -> Any:
        resp = resp_cls.decode(self.recv_frame(), version=version, header=True)
        assert resp.header.correlation_id == corr
        return resp

    def call(self, req: Any, resp_cls: Any, version: int) -> Any:
        return self.recv(resp_cls, version, self.send(req, version))

    def _exact(self, n: int) -> bytes:
        return recv_exact(self.sock, n)

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

    @staticmethod
    def produce_request(topic: str, records_by_partition: dict[int, bytes],
                        acks: int = -1) -> Any:
        """A Produce request for one topic: ``{partition: records}``."""
        TD = ProduceRequest.TopicProduceData
        PD = TD.PartitionProduceData
        return ProduceRequest(transactional_id=None, acks=acks, timeout_ms=30000,
                              topic_data=[TD(name=topic, partition_data=[
                                  PD(index=p, records=r)
                                  for p, r in records_by_partition.items()])])

    def produce(self, topic: str, records: bytes, partition: int = 0, acks: int = -1,
                version: int = 9) -> Any:
        """Partition response of a one-partition Produce (None for acks=0)."""
        corr = self.send(self.produce_request(topic, {partition: records}, acks), version)
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
