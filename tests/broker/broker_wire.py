"""A tiny raw-socket Kafka client for the broker core tests (frames built by hand)."""
from __future__ import annotations

import socket
import struct
from typing import Any

from datapath.wire import recv_exact, recv_frame
from protocol import is_flexible, request_class
from protocol.frames import parse_response


def encode_request(api_key: int, version: int, correlation_id: int, body_obj: Any,
                   client_id: str = "broker-tests") -> bytes:
    """Length-prefixed request frame: header v1 or v2 (flexible) plus the encoded body."""
    cid = client_id.encode()
    header = struct.pack(">hhih", api_key, version, correlation_id, len(cid)) + cid
    if is_flexible(api_key, version):
        header += b"\x00"
    body = bytes(body_obj.encode(version=version))
    return struct.pack(">i", len(header) + len(body)) + header + body


def request(api_key: int, version: int, **fields: Any) -> Any:
    return request_class(api_key)(version=version, **fields)


class Wire:
    """One blocking connection; send frames, read raw or decoded responses."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_exact(self, n: int) -> bytes:
        return recv_exact(self.sock, n)

    def recv_frame(self) -> bytes:
        return recv_frame(self.sock)

    def call(self, api_key: int, version: int, correlation_id: int = 1, **fields: Any) -> Any:
        self.send(encode_request(api_key, version, correlation_id, request(api_key, version,
                                                                             **fields)))
        corr, resp = parse_response(api_key, version, self.recv_frame())
        assert corr == correlation_id
        return resp

    def is_closed_by_peer(self) -> bool:
        """True when the broker closed this connection (EOF or reset)."""
        try:
            return self.sock.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True

    def close(self) -> None:
        self.sock.close()


def md_topic(name: str) -> Any:
    """A MetadataRequest topic entry by name."""
    return request_class(3).MetadataRequestTopic(name=name, topic_id=None)
