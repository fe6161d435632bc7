"""A commit whose answer is lost after its COMMIT reached the database (the connection broke:
a PostgreSQL cut or restart at that moment) may have committed. The engine and a takeover
read the objects' state back instead of deleting them as if the upload had failed: deleting
them left the stream's committed ranges pointing at objects gone from the store (the
30-minute chaos run of session 19: a partition whose replay waited forever for a missing
object, its records unreadable). Real SQLite metadata, a real file:// store, a real WAL."""
from __future__ import annotations

import contextlib

from storage.engine import open_engine

from lost_commit import fail_after_commit
from storage_helpers import fill, read_all, small_config


async def test_upload_whose_commit_answer_was_lost_keeps_its_committed_objects(tmp_path) -> None:
    """The upload's COMMIT lands, its answer is lost, and the lease lapses at that moment (no
    retry commits the records again): a cleanup pass must not delete the committed object -
    every committed range still points at an object in the store, and the records read back
    cold."""
    eng = open_engine(small_config(tmp_path))
    await eng.start()
    try:
        s = await eng.create_stream()
        await fill(s, 40)
        end = s.end_offset
        fired = fail_after_commit(eng.meta, "commit_objects", then=lambda: setattr(eng, "writes_allowed",
                                                             lambda: False))
        with contextlib.suppress(Exception):   # the old code raised the lost answer
            await eng.flush()
        assert fired, "the injected lost answer did not fire"
        await eng.maintenance.cleanup()
        await eng.maintenance.cleanup()
        ranges = eng.meta.stream_ranges(s.stream_id)
        covered = 0
        for r in sorted(ranges, key=lambda r: r.start_offset):
            assert r.start_offset <= covered, f"committed ranges leave a gap at {covered}"
            covered = max(covered, r.end_offset)
            assert eng.store.get(r.key, 0, 16), f"{r.key} is gone from the store"
        assert covered >= end, f"committed ranges end at {covered}, the stream at {end}"
        assert eng.meta.stream(s.stream_id).end_offset == end
        eng.writes_allowed = lambda: True
        eng.drop_caches()
        assert sum(b.next_offset - b.base_offset for b in await read_all(s)) == end
    finally:
        eng.writes_allowed = lambda: True
        await eng.close()
