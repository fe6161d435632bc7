"""The engine's metadata (streams, objects, ranges, stream epochs) on SQLite and PostgreSQL,
and the engine itself over a PostgreSQL metastore (upload, restart, cold read)."""
from __future__ import annotations

import asyncio

import pytest

from storage import sqldb
from storage.engine import open_engine
from storage.metastore import NewObject, StreamFenced, open_metastore
from storage.objects.format import StreamRange

from storage_helpers import fill, read_all, small_config


def test_object_lifecycle_round_trip(metadata_url: str) -> None:
    m = open_metastore(metadata_url)
    a, b = m.create_stream(), m.create_stream()
    assert b > a
    oid, key = m.prepare_object("sso", 3)
    assert key == f"sso/3/{oid:012d}"
    assert m.objects_in_state("prepared") == [(oid, key)]
    assert m.objects_in_state("prepared", node_id=3) == [(oid, key)]
    assert m.objects_in_state("prepared", node_id=4) == []          # another broker's upload
    m.commit_objects([NewObject(oid, 1234, [StreamRange(a, 0, 10), StreamRange(b, 0, 5)])], [])
    m.set_stream_start(a, 4)
    m.set_stream_start(a, 2)                      # never moves backwards
    m.close()

    m = open_metastore(metadata_url)              # reopen: everything was committed
    streams = {s.stream_id: s for s in m.streams()}
    assert (streams[a].start_offset, streams[a].end_offset) == (4, 10)
    assert streams[b].end_offset == 5 and not streams[b].deleted
    assert [(r.object_id, r.key, r.size, r.stream_id, r.start_offset, r.end_offset)
            for r in m.ranges()] == [(oid, key, 1234, a, 0, 10), (oid, key, 1234, b, 0, 5)]
    # compaction replaces the object in one transaction
    oid2, _ = m.prepare_object("so", 3)
    m.commit_objects([NewObject(oid2, 99, [StreamRange(a, 0, 10)])], [oid])
    assert [r.object_id for r in m.ranges()] == [oid2]
    assert m.objects_in_state("destroyed") == [(oid, key)]
    m.forget_objects([oid])
    assert m.objects_in_state("destroyed") == []
    m.delete_stream(b)
    assert {s.stream_id: s.deleted for s in m.streams()}[b] is True
    m.close()


def test_failed_commit_changes_nothing(metadata_url: str) -> None:
    m = open_metastore(metadata_url)
    s = m.create_stream()
    oid, _ = m.prepare_object("sso", 0)
    with pytest.raises(RuntimeError, match="not prepared"):
        m.commit_objects([NewObject(oid, 1, [StreamRange(s, 0, 7)]),
                          NewObject(oid + 100, 1, [StreamRange(s, 7, 9)])], [])
    assert m.ranges() == []
    assert m.streams()[0].end_offset == 0
    assert m.objects_in_state("prepared") == [(oid, f"sso/0/{oid:012d}")]
    m.close()


def test_stale_stream_owner_cannot_commit(metadata_url: str) -> None:
    """Node 1 claims the stream at epoch 1; node 2 takes it over at epoch 2: node 1 cannot
    re-claim it, and its commit (its own object, or one carrying epoch 1) is refused and leaves
    nothing behind."""
    m1, m2 = open_metastore(metadata_url), open_metastore(metadata_url)
    s = m1.create_stream()
    assert m1.stream_owner(s) is None
    assert m1.claim_stream(s, 1, 1) and m1.claim_stream(s, 1, 1)     # idempotent re-claim
    assert m2.claim_stream(s, 2, 2)
    assert not m1.claim_stream(s, 1, 1) and not m1.claim_stream(s, 1, 2)
    assert m1.stream_owner(s) == (2, 2)
    oid1, _ = m1.prepare_object("sso", 1)
    with pytest.raises(StreamFenced, match="owned by node 2"):
        m1.commit_objects([NewObject(oid1, 10, [StreamRange(s, 0, 3)])], [])
    oid2, _ = m2.prepare_object("sso", 2)
    with pytest.raises(sqldb.StaleEpoch):                            # StreamFenced is one
        m2.commit_objects([NewObject(oid2, 10, [StreamRange(s, 0, 3)])], [], epochs={s: 1})
    assert m2.ranges() == [] and m2.stream(s).end_offset == 0
    m2.commit_objects([NewObject(oid2, 10, [StreamRange(s, 0, 3)])], [], epochs={s: 2})
    assert m1.stream(s).end_offset == 3
    assert [(r.object_id, r.end_offset) for r in m1.stream_ranges(s)] == [(oid2, 3)]
    assert m1.stream(s + 100) is None
    m1.close()
    m2.close()


def test_existing_sqlite_database_is_adopted(tmp_path) -> None:
    """A meta.db written before schema_migrations existed opens with its rows intact."""
    import sqlite3  # noqa: PLC0415

    path = tmp_path / "meta.db"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE s3_streams (stream_id INTEGER PRIMARY KEY AUTOINCREMENT,
            start_offset INTEGER NOT NULL DEFAULT 0, end_offset INTEGER NOT NULL DEFAULT 0,
            deleted INTEGER NOT NULL DEFAULT 0, created_ms INTEGER NOT NULL);
        INSERT INTO s3_streams(end_offset, created_ms) VALUES (42, 1);""")
    db.commit()
    db.close()
    m = open_metastore(f"sqlite:///{path}")
    (s,) = m.streams()
    assert s.end_offset == 42 and m.stream_owner(s.stream_id) is None
    assert m.create_stream() == s.stream_id + 1
    m.close()


async def test_engine_on_postgres_survives_restart(tmp_path, postgres) -> None:
    url = postgres.new_database()
    cfg = small_config(tmp_path, metadata_url=url)
    eng = open_engine(cfg)
    await eng.start()
    s = await eng.create_stream()
    await fill(s, 200)
    await eng.flush()
    before = [(x.base_offset, bytes(x.payload)) for x in await read_all(s)]
    await eng.close()
    eng = open_engine(cfg)
    await eng.start()
    try:
        s2 = await eng.open_stream(s.stream_id)
        eng.drop_caches()
        after = [(x.base_offset, bytes(x.payload)) for x in await read_all(s2)]
        assert after == before and len(after) == 200
        assert any(r.stream_id == s.stream_id for r in await asyncio.to_thread(eng.meta.ranges))
    finally:
        await eng.close()


async def test_startup_cleanup_spares_other_nodes_uploads(tmp_path, metadata_url) -> None:
    """A broker starting on a shared database deletes what its own crash left prepared, not the
    upload another broker has in flight."""
    m = open_metastore(metadata_url)
    mine, _ = m.prepare_object("sso", 1)
    theirs, theirs_key = m.prepare_object("sso", 2)
    m.close()
    eng = open_engine(small_config(tmp_path, metadata_url=metadata_url, node_id=1))
    await eng.start()
    try:
        # leftovers are deleted in the background once started (issue 21: start-up never
        # waits on the object store)
        for _ in range(100):
            left = await asyncio.to_thread(eng.meta.objects_in_state, "prepared")
            if len(left) < 2:
                break
            await asyncio.sleep(0.05)
        assert left == [(theirs, theirs_key)]
        assert mine != theirs
    finally:
        await eng.close()
