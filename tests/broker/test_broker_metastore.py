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
