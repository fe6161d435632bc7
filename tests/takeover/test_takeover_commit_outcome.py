"""A takeover whose commit reached the database but whose answer was lost (the connection
broke at COMMIT) reads its objects' state back: marking its own committed objects destroyed
lost the dead node's records (the stream's committed end stayed past them, so the next taker
skipped them as already committed). Real WAL file, SQLite metadata, file:// store."""
from __future__ import annotations

import contextlib
import sqlite3

from storage.metastore import open_metastore
from storage.objects.store import open_object_store
from storage.takeover import take_over_wal
from takeover_helpers import build_dead_wal, check_exactly_once


def _fail_after_commit(meta, method: str) -> list[int]:
    """The next ``method`` transaction commits, then raises as a lost answer would."""
    fired: list[int] = []
    backend = meta.db._b
    real_commit, real_method = backend.commit, getattr(meta, method)
    armed = [False]

    def commit() -> None:
        real_commit()
        if armed[0]:
            armed[0] = False
            fired.append(1)
            raise sqlite3.OperationalError("disk I/O error (injected after COMMIT)")

    def wrapped(*a, **kw):
        armed[0] = not fired
        try:
            return real_method(*a, **kw)
        finally:
            armed[0] = False
    backend.commit = commit
    setattr(meta, method, wrapped)
    return fired


def test_takeover_whose_commit_answer_was_lost_keeps_its_committed_objects(tmp_path) -> None:
    meta = open_metastore(f"sqlite:///{tmp_path}/meta.db")
    store = open_object_store(f"file://{tmp_path}/objects")
    try:
        path = str(tmp_path / "wal-1")
        acked = build_dead_wal(path, meta, store, node_id=1, records=200, uploaded=50)
        fired = _fail_after_commit(meta, "commit_takeover")
        with contextlib.suppress(Exception):     # the old code raised the lost answer
            take_over_wal(path, meta=meta, store=store, object_block_bytes=16 << 10,
                          node_id=1, node_epoch=0, taker=2, taker_epoch=1)
        assert fired, "the injected lost answer did not fire"
        # a second taker finishes whatever the first left
        take_over_wal(path, meta=meta, store=store, object_block_bytes=16 << 10,
                      node_id=1, node_epoch=0, taker=3, taker_epoch=2)
        assert check_exactly_once(meta, store, acked) == 200
    finally:
        meta.close()
