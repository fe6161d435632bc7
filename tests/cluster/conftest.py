"""Several broker processes sharing one object store and one metadata database."""
from __future__ import annotations

import pathlib
import time
from typing import Callable

import pytest


@pytest.fixture
def cluster_factory(broker_factory, tmp_path: pathlib.Path, metadata_url: str) -> Callable:
    """cluster_factory(n) -> [BrokerProcess] with node ids 0..n-1 on one file:// store and
    one metadata database (SQLite file, then PostgreSQL: the tests run on both); call it
    again (n=1, first_id=k) to add a broker. ``cluster_factory.shared`` are the shared flags."""
    shared = ["--object-store", f"file://{tmp_path}/objects", "--metadata", metadata_url,
              "--upload-interval-s", "2"]

    def make(n: int, first_id: int = 0, extra: tuple[str, ...] = ()) -> list:
        return [broker_factory(["--node-id", str(first_id + i), "--rack", f"r{first_id + i}",
                                *shared, *extra]) for i in range(n)]
    make.shared = shared  # type: ignore[attr-defined]
    return make


def wait_for(cond: Callable[[], object], timeout: float = 30.0, what: str = "") -> object:
    """Poll ``cond`` until truthy; an exception counts as not yet (a client may still try
    a broker that just stopped), the last one is reported on timeout."""
    end = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            v = cond()
        except Exception as exc:  # noqa: BLE001
            last, v = exc, None
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or cond} (last error: {last!r})")
