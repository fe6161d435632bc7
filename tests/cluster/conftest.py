"""Several broker processes sharing one object store and one metadata database."""
from __future__ import annotations

import pathlib

import pytest

from .kit import ClusterFactory, wait_for  # noqa: F401 - wait_for: older imports


@pytest.fixture
def cluster_factory(broker_factory, tmp_path: pathlib.Path, metadata_url: str) -> ClusterFactory:
    """cluster_factory(n) -> [BrokerProcess] with node ids 0..n-1 on one file:// store and
    one metadata database (SQLite file, then PostgreSQL: the tests run on both); call it
    again (n=1, first_id=k) to add a broker. ``cluster_factory.shared`` are the shared flags."""
    return ClusterFactory(broker_factory, [
        "--object-store", f"file://{tmp_path}/objects", "--metadata", metadata_url,
        "--upload-interval-s", "2"])
