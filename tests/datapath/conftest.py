"""Datapath test brokers use a small WAL: the default 2 GiB preallocation per broker fills
the disk when many suites run at once."""
from __future__ import annotations

import pytest

SMALL_WAL = ["--wal-capacity", str(256 << 20)]


@pytest.fixture(scope="module")
def module_broker(module_broker_factory):
    """One broker shared by the tests of a module (own topic names per test)."""
    return module_broker_factory(SMALL_WAL)
