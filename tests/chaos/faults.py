"""Faults for chaos tests: an object store that can be cut or black-holed, and a broker
configured to feel it (small WAL and LogCache, short back-pressure).

A ``TcpProxy`` (tests/tcp_proxy.py) sits between the broker and the moto S3 server on
127.0.0.1. ``cut()`` resets connections (the store answers "down" at once); ``blackhole()``
accepts connections and never answers (the store hangs, as on a dropped route: every call
waits for its timeout); ``restore()`` forwards again.
"""
from __future__ import annotations

import time

import boto3

from tcp_proxy import TcpProxy


def s3_bucket_url(endpoint: str, via: str, bucket: str) -> str:
    """Create ``bucket`` on ``endpoint`` and return the engine's s3:// URL reaching it through
    ``via`` (the proxy), with short timeouts so an outage is felt in seconds."""
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    return (f"s3://{bucket}/kafka?endpoint_url={via}&region=us-east-1"
            "&access_key_id=testing&secret_access_key=testing"
            "&connect_timeout=1&read_timeout=2&max_attempts=1")


def proxy_for(s3_endpoint) -> TcpProxy:
    host, port = s3_endpoint.url.rsplit(":", 1)
    return TcpProxy(host.split("//")[1], int(port))


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
