"""The broker's topic metadata store: durable and transactional, on SQLite and PostgreSQL."""
from __future__ import annotations

import uuid

import pytest

from broker.metastore import TopicRecord, open_metadata_store
from storage import sqldb


def test_round_trip_and_reopen(metadata_url):
    m = open_metadata_store(metadata_url)
    cid = m.cluster_id()
    tid = uuid.uuid4()
    m.create_topic(TopicRecord("a", tid, {"retention.ms": "5"}, [10, 11]))
    m.create_topic(TopicRecord("b", uuid.uuid4(), {}, [12]))
    m.add_partitions("a", 2, [13])
    m.set_topic_configs("a", {"retention.bytes": "7"})
    m.delete_topic("b")
    m.close()
    m = open_metadata_store(metadata_url)
    assert m.cluster_id() == cid
    (a,) = m.load_topics()
    assert (a.name, a.topic_id, a.configs, a.stream_ids) == ("a", tid, {"retention.bytes": "7"},
                                                             [10, 11, 13])
    m.close()


def test_failed_transaction_leaves_nothing(metadata_url):
    m = open_metadata_store(metadata_url)
    m.create_topic(TopicRecord("a", uuid.uuid4(), {}, [1]))
    with pytest.raises(sqldb.IntegrityError):  # same name: the whole create rolls back
        m.create_topic(TopicRecord("a", uuid.uuid4(), {}, [2, 3]))
    with pytest.raises(sqldb.IntegrityError):  # partition 0 exists already
        m.add_partitions("a", 0, [4, 5])
    (a,) = m.load_topics()
    assert a.stream_ids == [1]
    m.close()


def test_one_cluster_id_per_database(metadata_url):
    """Brokers sharing a metadata database report one cluster id (the first one wins)."""
    stores = [open_metadata_store(metadata_url) for _ in range(3)]
    ids = {m.cluster_id() for m in stores}
    assert len(ids) == 1 and len(ids.pop()) == 22
    for m in stores:
        m.close()


def test_unsupported_url():
    with pytest.raises(ValueError, match="postgresql://"):
        open_metadata_store("mysql://x/y")


def test_one_object_store_per_shared_database(metadata_url, tmp_path):
    from broker.metastore import ClusterMisconfigured  # noqa: PLC0415

    a, b = open_metadata_store(metadata_url), open_metadata_store(metadata_url)
    a.bind_object_store("s3://bucket/cluster1?endpoint_url=http://minio:9000")
    # the same bucket and prefix seen through another endpoint is the same store
    b.bind_object_store("s3://bucket/cluster1/?endpoint_url=http://localhost:9000")
    if metadata_url.startswith("sqlite"):
        b.bind_object_store(f"file://{tmp_path}/moved")     # one broker's file: no check
    else:
        with pytest.raises(ClusterMisconfigured, match="s3://bucket/cluster2 is not this"
                                                       " cluster's object store s3://bucket/"
                                                       "cluster1"):
            b.bind_object_store("s3://bucket/cluster2?endpoint_url=http://minio:9000")
    a.close()
    b.close()
