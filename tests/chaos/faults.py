"""Faults for chaos tests: an object store that can be cut or black-holed, and a broker
configured to feel it (small WAL and LogCache, short back-pressure).

``StoreProxy`` sits between the broker and the moto S3 server on 127.0.0.1. ``cut()`` refuses
connections (the store answers "down" at once); ``blackhole()`` accepts connections and never
answers (the store hangs, as on a dropped route: every call waits for its timeout);
``restore()`` forwards again. Reused by the cluster chaos tests.
"""
from __future__ import annotations

import socket
import threading
import time

import boto3


class StoreProxy:
    """TCP forwarder to ``target`` with three states: up, cut, black-holed."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._ls = socket.socket()
        self._ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._ls.bind(("127.0.0.1", 0))
        self._ls.listen(256)
        self.port = self._ls.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = "up"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="store-proxy").start()

    # -- control ---------------------------------------------------------------------------
    def cut(self) -> None:
        """Refuse (reset) every connection, new and open."""
        self.state = "cut"
        self._drop_all()

    def blackhole(self) -> None:
        """Accept connections and never answer; open ones go silent too."""
        self.state = "blackhole"
        self._drop_all()

    def restore(self) -> None:
        self.state = "up"

    def close(self) -> None:
        self._closed = True
        self._drop_all()
        try:
            self._ls.close()
        except OSError:
            pass

    def _drop_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    # -- forwarding ------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._ls.accept()
            except OSError:
                return
            if self.state == "cut":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                client.close()                       # RST: connection refused-like
                continue
            with self._lock:
                self._conns.add(client)
            if self.state == "blackhole":
                continue                             # held open, never answered
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.add(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data or self.state != "up":
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def s3_bucket_url(endpoint: str, via: str, bucket: str) -> str:
    """Create ``bucket`` on ``endpoint`` and return the engine's s3:// URL reaching it through
    ``via`` (the proxy), with short timeouts so an outage is felt in seconds."""
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    return (f"s3://{bucket}/kafka?endpoint_url={via}&region=us-east-1"
            "&access_key_id=testing&secret_access_key=testing"
            "&connect_timeout=1&read_timeout=2&max_attempts=1")


def proxy_for(s3_endpoint) -> StoreProxy:
    host, port = s3_endpoint.url.rsplit(":", 1)
    return StoreProxy(host.split("//")[1], int(port))


def broker_args(store_url: str, wal_capacity: int = 64 << 20, log_cache: int = 16 << 20,
                backpressure_s: float = 2.0) -> list[str]:
    """A broker that back-pressures soon when the store is away."""
    return ["--object-store", store_url, "--wal-capacity", str(wal_capacity),
            "--log-cache-bytes", str(log_cache), "--upload-interval-s", "0.5",
            "--upload-threshold-bytes", str(256 << 10), "--backpressure-timeout-s",
            str(backpressure_s), "--cleanup-interval-s", "2"]


def wait_until(pred, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()
