"""A takeover whose commit reached the database but whose answer was lost (the connection
broke at COMMIT) reads its objects' state back: marking its own committed objects destroyed
lost the dead node's records (the stream's committed end stayed past them, so the next taker
skipped them as already committed). Real WAL file, SQLite metadata, file:// store."""
from __future__ import annotations

import contextlib

from lost_commit import fail_after_commit
from storage.metastore import open_metastore
from storage.objects.store import open_object_store
from storage.takeover import take_over_wal
from takeover_helpers import build_dead_wal, check_exactly_once


def test_takeover_whose_commit_answer_was_lost_keeps_its_committed_objects(tmp_path) -> None:
    meta = open_metastore(f"sqlite:///{tmp_path}/meta.db")
    store = open_object_store(f"file://{tmp_path}/objects")
    try:
        path = str(tmp_path / "wal-1")
        acked = build_dead_wal(path, meta, store, node_id=1, records=200, uploaded=50)
        fired = fail_after_commit(meta, "commit_takeover", once=True)
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
