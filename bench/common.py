"""Shared bench helpers: a broker subprocess, the librdkafka mock peer, percentiles, tables.

Every benchmark starts its own broker(s) so runs are independent and reproducible.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the broker binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..1); NaN for no samples."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


class BrokerProc:
    """An s3kafka broker subprocess on a free port with its own temporary data dir."""

    def __init__(self, extra: list[str] | None = None, data_dir: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="s3kbench-")
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.args = [PY, "-m", "broker", "serve", "--listen", self.bootstrap, "--data-dir",
                     os.path.join(self.data_dir, "data"), "--node-id", "0",
                     "--log-level", "WARNING", *(extra or [])]
        self.env = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
        self.log_path = os.path.join(self.data_dir, "broker.log")
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "BrokerProc":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited: {self.log_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("broker did not start")

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        """Stop and delete the data dir (if we made it)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "BrokerProc":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MockCluster:
    """librdkafka's in-memory mock cluster (the side-by-side peer).

    The cluster lives inside a client handle created with ``test.mock.num.brokers``; its
    bootstrap address is read back from that handle's Metadata, so other clients (and other
    processes) can connect to it while the handle is alive.
    """

    def __init__(self) -> None:
        from confluent_kafka import Producer
        self._handle = Producer({"test.mock.num.brokers": 1, "log_level": 2})
        md = self._handle.list_topics(timeout=10)
        b = next(iter(md.brokers.values()))
        self.bootstrap = f"{b.host}:{b.port}"

    def close(self) -> None:
        self._handle.flush(1)
        self._handle = None

    def __enter__(self) -> "MockCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """Create a topic via the admin API (works against both the broker and the mock)."""
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 2})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(30)


@dataclass
class Result:
    """One benchmark's output: table rows plus optional time series / percentiles for plots."""
    name: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # label -> (t, MB/s)
    percentiles: dict[str, dict[str, float]] = field(default_factory=dict)       # label -> {p50..}
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)                          # raw figures

    def table(self) -> str:
        """Markdown table (also readable on a terminal)."""
        def fmt(v: Any) -> str:
            if isinstance(v, float):
                return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
            return str(v)
        out = ["| " + " | ".join(self.columns) + " |",
               "|" + "---|" * len(self.columns)]
        out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in self.rows]
        return "\n".join(out)

    def print(self) -> None:
        print(f"\n## {self.name}\n{self.table()}")
        for n in self.notes:
            print(f"- {n}")
        sys.stdout.flush()
