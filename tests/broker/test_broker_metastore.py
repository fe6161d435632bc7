"""SqliteMetadataStore: durable, transactional topic metadata."""
from __future__ import annotations

import sqlite3
import uuid

import pytest

from broker.metastore import TopicRecord, open_metadata_store


def test_round_trip_and_reopen(tmp_path):
    url = f"sqlite:///{tmp_path}/meta.db"
    m = open_metadata_store(url)
    cid = m.cluster_id()
    tid = uuid.uuid4()
    m.create_topic(TopicRecord("a", tid, {"retention.ms": "5"}, [10, 11]))
    m.create_topic(TopicRecord("b", uuid.uuid4(), {}, [12]))
    m.add_partitions("a", 2, [13])
    m.set_topic_configs("a", {"retention.bytes": "7"})
    m.delete_topic("b")
    m.close()
    m = open_metadata_store(url)
    assert m.cluster_id() == cid
    (a,) = m.load_topics()
    assert (a.name, a.topic_id, a.configs, a.stream_ids) == ("a", tid, {"retention.bytes": "7"},
                                                             [10, 11, 13])
    m.close()


def test_failed_transaction_leaves_nothing(tmp_path):
    m = open_metadata_store(f"sqlite:///{tmp_path}/meta.db")
    m.create_topic(TopicRecord("a", uuid.uuid4(), {}, [1]))
    with pytest.raises(sqlite3.IntegrityError):  # same name: the whole create rolls back
        m.create_topic(TopicRecord("a", uuid.uuid4(), {}, [2, 3]))
    with pytest.raises(sqlite3.IntegrityError):  # partition 0 exists already
        m.add_partitions("a", 0, [4, 5])
    (a,) = m.load_topics()
    assert a.stream_ids == [1]
    m.close()


def test_unsupported_url():
    with pytest.raises(ValueError):
        open_metadata_store("postgresql://x/y")
