"""Requests from this broker to the other brokers of the cluster (Kafka's inter-broker calls).

The transaction coordinator sends WriteTxnMarkers to the leaders of a transaction's
partitions, a partition leader asks a transaction's coordinator whether a batch belongs to an
ongoing transaction (AddPartitionsToTxn v4+, KIP-890), and a group coordinator forwards
TxnOffsetCommit to the transaction's coordinator. One connection per peer, requests pipelined
on it (answers matched by correlation id); a broken connection fails its pending calls and the
next call reconnects. The peer's address is the one it registered in the cluster.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from typing import Any

import protocol

log = logging.getLogger(__name__)

CLIENT_ID = "s3kafka-broker"
CONNECT_TIMEOUT_S = 5.0


class PeerError(Exception):
    """The peer could not be reached or did not answer in time (retriable)."""


class _Conn:
    def __init__(self, endpoint: tuple[str, int], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.endpoint = endpoint
        self.reader, self.writer = reader, writer
        self.pending: dict[int, tuple[asyncio.Future[bytes], Any]] = {}
        self.task = asyncio.get_running_loop().create_task(self._read(), name="s3kafka-peer")
        self.closed = False

    async def _read(self) -> None:
        error: Exception = PeerError("connection closed")
        try:
            while True:
                size = struct.unpack(">i", await self.reader.readexactly(4))[0]
                frame = await self.reader.readexactly(size)
                corr = struct.unpack_from(">i", frame)[0]
                entry = self.pending.pop(corr, None)
                if entry is not None and not entry[0].done():
                    entry[0].set_result(frame)
        except (OSError, asyncio.IncompleteReadError) as e:
            error = PeerError(f"connection to {self.endpoint} lost: {e!r}")
        except asyncio.CancelledError:
            pass
        finally:
            self.close(error)

    def close(self, error: Exception | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        for fut, _ in self.pending.values():
            if not fut.done():
                fut.set_exception(error or PeerError("connection closed"))
        self.pending.clear()
        self.writer.close()
        if self.task is not asyncio.current_task():
            self.task.cancel()


class PeerClients:
    """Connections to the other brokers, opened on first use."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self._conns: dict[int, _Conn] = {}
        self._connecting: dict[int, asyncio.Lock] = {}
        self._corr = itertools.count(1)

    def _endpoint(self, node: int) -> tuple[str, int] | None:
        cluster = getattr(self.broker, "cluster", None)
        return None if cluster is None else cluster.endpoint(node)

    async def _conn(self, node: int) -> _Conn:
        endpoint = self._endpoint(node)
        if endpoint is None:
            raise PeerError(f"broker {node} is not live")
        lock = self._connecting.setdefault(node, asyncio.Lock())
        async with lock:
            conn = self._conns.get(node)
            if conn is not None and (conn.closed or conn.endpoint != endpoint):
                conn.close()
                conn = None
            if conn is None:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(*endpoint), CONNECT_TIMEOUT_S)
                except (OSError, asyncio.TimeoutError) as e:
                    raise PeerError(f"cannot connect to broker {node} at {endpoint}: {e!r}") \
                        from None
                conn = self._conns[node] = _Conn(endpoint, reader, writer)
            return conn

    async def call(self, node: int, api_key: int, version: int, request: Any,
                   timeout_s: float = 15.0) -> Any:
        """Send ``request`` to broker ``node`` and return its decoded answer; PeerError when
        the peer cannot be reached or does not answer within ``timeout_s``."""
        conn = await self._conn(node)
        corr = next(self._corr) & 0x7FFFFFFF
        request.with_header(correlation_id=corr, client_id=CLIENT_ID)
        data = request.encode(version=version, header=True, framed=True)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        conn.pending[corr] = (fut, None)
        try:
            conn.writer.write(data)
            await conn.writer.drain()
            frame = await asyncio.wait_for(fut, timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            conn.pending.pop(corr, None)
            conn.close(PeerError(repr(e)))
            raise PeerError(f"broker {node}: {e!r}") from None
        resp_cls = protocol.response_class(api_key)
        return resp_cls.decode(frame, version=version, header=True)

    async def close(self) -> None:
        for conn in list(self._conns.values()):
            conn.close()
            try:
                await conn.task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._conns.clear()
