"""The engine over a real WAL file and a file:// (or mem://) object store."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time

import pytest

from storage.engine import open_engine
from storage.stream import OffsetOutOfRange, RetriableStorageError, StorageError

from storage_helpers import fill, payload, read_all, small_config
from wal_probes import flag_completions


@contextlib.asynccontextmanager
async def producing(stream, pacer):
    """Append small records to ``stream`` every 5 ms until the block ends; yields once the
    cold-read ``pacer`` sees the producer as hot traffic."""
    stop = asyncio.Event()

    async def produce() -> None:
        n = 0
        while not stop.is_set():
            await stream.append(payload(stream.stream_id, n, 100), n, 1)
            n += 1
            await asyncio.sleep(0.005)
    task = asyncio.create_task(produce())
    try:
        while not pacer.hot_active():
            await asyncio.sleep(0.01)
        yield
    finally:
        stop.set()
        await task


async def test_hot_then_cold_reads_identical(tmp_path) -> None:
    eng = open_engine(small_config(tmp_path))
    await eng.start()
    try:
        a, b = await eng.create_stream(), await eng.create_stream()
        await asyncio.gather(fill(a, 300), fill(b, 200, count=1, size=100))
        hot_a, hot_b = await read_all(a), await read_all(b)
        assert a.confirmed_offset == a.end_offset == 1500
        await eng.flush()
        eng.drop_caches()
        assert eng.cache.first_offset(a.stream_id) is None
        assert eng.store.list(), "objects were uploaded"
        cold_a = await read_all(a)
        assert [(x.base_offset, bytes(x.payload)) for x in cold_a] == \
               [(x.base_offset, bytes(x.payload)) for x in hot_a]
        assert len(await read_all(b)) == len(hot_b) == 200
        assert eng.reader.block_cache.misses > 0
        # a read in the middle of a batch starts at the batch holding it
        mid = await a.read(7, 1)
        assert len(mid) == 1 and mid[0].base_offset == 5
        with pytest.raises(OffsetOutOfRange):
            await a.read(1501, 100)
        assert await a.read(1500, 100) == []
    finally:
        await eng.close()


async def test_restart_recovers_every_acked_record(tmp_path) -> None:
    cfg = small_config(tmp_path, upload_threshold_bytes=1 << 30, upload_interval_s=3600)
    eng = open_engine(cfg)
    await eng.start()
    s = await eng.create_stream()
    await fill(s, 100)
    await eng.flush()                       # part in objects ...
    await fill(s, 100)                      # ... part only in the WAL
    # simulate a crash: no final upload, WAL not cleanly closed
    for t in eng._tasks:
        t.cancel()
    eng.closing = True
    eng.wal.close()
    eng.meta.close()
    eng2 = open_engine(cfg)
    await eng2.start()
    try:
        s2 = await eng2.open_stream(s.stream_id)
        assert s2.end_offset == s2.confirmed_offset == 1000
        assert len(await read_all(s2)) == 200
        await eng2.flush()
        eng2.drop_caches()
        assert len(await read_all(s2)) == 200
        await fill(s2, 10)
        assert s2.end_offset == 1050
    finally:
        await eng2.close()


async def test_clean_close_and_reopen(tmp_path) -> None:
    cfg = small_config(tmp_path)
    eng = open_engine(cfg)
    await eng.start()
    s = await eng.create_stream()
    await fill(s, 50)
    await eng.close()
    eng = open_engine(cfg)
    await eng.start()
    try:
        s = await eng.open_stream(s.stream_id)
        eng.drop_caches()
        assert len(await read_all(s)) == 50
    finally:
        await eng.close()


async def test_trim_then_cleanup_deletes_objects(tmp_path) -> None:
    eng = open_engine(small_config(tmp_path, stream_object_threshold_bytes=1))
    await eng.start()
    try:
        a, b = await eng.create_stream(), await eng.create_stream()
        for _ in range(4):
            await fill(a, 50)
            await fill(b, 50)
            await eng.flush()
        keys_a = {r.key for r in eng.reader.stream_ranges(a.stream_id)}
        assert len(keys_a) >= 4
        await a.trim(500)                  # everything of the first two uploads
        await eng.maintenance.purge()
        left = set(eng.store.list())
        gone = keys_a - left
        assert gone and all(r.start_offset >= 250 or r.end_offset > 500
                            for r in eng.reader.stream_ranges(a.stream_id))
        with pytest.raises(OffsetOutOfRange):
            await a.read(499, 100)
        assert (await a.read(500, 1))[0].base_offset == 500
        await eng.delete_stream(b.stream_id)
        await eng.maintenance.purge()
        assert not {r.key for r in eng.reader.stream_ranges(b.stream_id)} & set(eng.store.list())
        eng.drop_caches()
        assert len(await read_all(a, 500)) == 100
    finally:
        await eng.close()


async def test_compaction_reduces_objects_same_data(tmp_path) -> None:
    cfg = small_config(tmp_path, compaction_min_objects=2)
    eng = open_engine(cfg)
    await eng.start()
    try:
        streams = [await eng.create_stream() for _ in range(3)]
        for _ in range(5):
            for s in streams:
                await fill(s, 20)
            await eng.flush()
        before = {s.stream_id: [(b.base_offset, bytes(b.payload)) for b in await read_all(s)]
                  for s in streams}
        n_before = len(eng.store.list())
        assert await eng.maintenance.compact() >= 2
        assert await eng.maintenance.compact() == 0, "nothing new: no rewrite"
        await eng.maintenance.purge()
        eng.drop_caches()
        assert len(eng.store.list()) < n_before
        for s in streams:
            assert [(b.base_offset, bytes(b.payload)) for b in await read_all(s)] == \
                before[s.stream_id]
    finally:
        await eng.close()
    eng = open_engine(cfg)                 # the compacted layout survives a restart
    await eng.start()
    try:
        for s in streams:
            s2 = await eng.open_stream(s.stream_id)
            assert len(await read_all(s2)) == 100
    finally:
        await eng.close()


async def test_corrupt_object_fails_only_its_range(tmp_path) -> None:
    eng = open_engine(small_config(tmp_path, stream_object_threshold_bytes=1))
    await eng.start()
    try:
        a, b = await eng.create_stream(), await eng.create_stream()
        await fill(a, 50)
        await fill(b, 50)
        await eng.flush()
        eng.drop_caches()
        key = eng.reader.stream_ranges(a.stream_id)[0].key
        path = tmp_path / "objects" / key
        raw = bytearray(path.read_bytes())
        raw[40] ^= 0xFF                    # inside the first data block
        path.write_bytes(bytes(raw))
        with pytest.raises(StorageError):
            await a.read(0, 1 << 20)
        assert len(await read_all(b)) == 50
        await fill(a, 5)                   # new data of the same stream still works
        assert (await a.read(250, 1 << 20))[0].base_offset == 250
    finally:
        await eng.close()


async def test_full_cache_is_backpressure_not_loss(tmp_path) -> None:
    # the object store cannot be written (a file where its directory should be)
    (tmp_path / "blocked").write_bytes(b"")
    cfg = small_config(tmp_path, object_store=f"file://{tmp_path}/blocked/objs",
                       log_cache_bytes=256 << 10)
    eng = open_engine(cfg)
    with pytest.raises(Exception):
        await eng.start()                  # creating the store directory fails
    cfg = small_config(tmp_path, object_store=f"mem://bp-{tmp_path.name}",
                       log_cache_bytes=256 << 10)
    await backpressure_then_recovery(cfg, most=2000, then=200, read_while_down=True)


async def backpressure_then_recovery(cfg, most: int, then: int, read_while_down: bool) -> None:
    """With every object store put failing, appends to one stream are refused
    (RetriableStorageError, nothing lost) before `most`; once the store is back, producers
    that retry get `then` more appended, and every acked record reads back from objects."""
    eng = open_engine(cfg)
    await eng.start()
    real_put = eng.store.put
    down = True

    def put(key, data):
        if down:
            raise OSError("store down")
        real_put(key, data)

    eng.store.put = put
    try:
        s = await eng.create_stream()
        acked = 0
        with pytest.raises(RetriableStorageError):
            for _ in range(most):
                await s.append(payload(s.stream_id, s.end_offset), s.end_offset, 1)
                acked += 1
        assert 0 < acked < most and s.end_offset == acked
        if read_while_down:
            assert len(await read_all(s)) == acked      # reads keep working from the cache
        down = False
        done = 0
        while done < then:                              # producers recover on their own
            try:
                await s.append(payload(s.stream_id, s.end_offset), s.end_offset, 1)
                done += 1
            except RetriableStorageError:
                await asyncio.sleep(0.1)
        await eng.flush()
        eng.drop_caches()
        assert len(await read_all(s)) == acked + then
    finally:
        await eng.close()


async def test_full_wal_is_backpressure_not_loss(tmp_path) -> None:
    cfg = small_config(tmp_path, object_store=f"mem://walbp-{tmp_path.name}",
                       wal_capacity=256 << 10, log_cache_bytes=64 << 20)
    await backpressure_then_recovery(cfg, most=5000, then=1000,    # the WAL drains by uploads
                                     read_while_down=False)


async def test_catch_up_from_the_log_cache_is_paced_only_while_producers_append(tmp_path) -> None:
    """A reader of data older than catchup_age_s that still sits in the LogCache is paced like a
    cold reader (bytes go through the pacer, answers are cut to cold_read_max_bytes) while
    another stream is being appended to; a tail reader is not, and with no producers active
    nothing is paced. The bytes read are the same either way."""
    eng = open_engine(small_config(tmp_path, log_cache_bytes=16 << 20, catchup_age_s=0.5,
                                   cold_read_bytes_per_s=64 << 20, cold_read_min_bytes_per_s=64 << 20,
                                   cold_read_lag_target_ms=0, cold_read_hot_tolerance=0,
                                   cold_read_max_bytes=4 << 10, upload_threshold_bytes=64 << 20,
                                   upload_interval_s=3600))
    await eng.start()
    try:
        pacer = eng.cold_pacer
        pacer.HOT_ACTIVE_S = 0.2
        old, hot = await eng.create_stream(), await eng.create_stream()
        await fill(old, 40)                      # 200 records of 300 B, 5 per batch
        expected = [(b.base_offset, bytes(b.payload)) for b in await read_all(old)]
        await asyncio.sleep(0.6)                 # old data, and nobody appending any more
        assert not pacer.hot_active()
        before = pacer.bytes
        assert [(b.base_offset, bytes(b.payload)) for b in await read_all(old)] == expected
        assert pacer.bytes == before, "no producers: catch-up from memory runs unpaced"

        async with producing(hot, pacer):
            before = pacer.bytes
            first = await old.read(0, 1 << 20)
            assert sum(len(b.payload) for b in first) <= 4 << 10, "cut like a cold read"
            got = await read_all(old)
            assert [(b.base_offset, bytes(b.payload)) for b in got] == expected
            assert pacer.bytes - before >= sum(len(p) for _, p in expected)
            # the tail of the stream being appended to is fresh: not catch-up
            before = pacer.bytes
            tail = await hot.read(max(hot.confirmed_offset - 1, 0), 1 << 20)
            assert tail and pacer.bytes == before
    finally:
        await eng.close()


async def test_cold_reads_are_cut_to_short_slices_only_while_producers_append(tmp_path) -> None:
    """cold_read_max_bytes bounds what a hot request may wait behind: it applies while
    producers append; a reader alone gets whole answers (nothing to protect)."""
    eng = open_engine(small_config(tmp_path, cold_read_max_bytes=4 << 10,
                                   cold_read_lag_target_ms=0, cold_read_hot_tolerance=0))
    await eng.start()
    try:
        pacer = eng.cold_pacer
        pacer.HOT_ACTIVE_S = 0.2
        old, hot = await eng.create_stream(), await eng.create_stream()
        await fill(old, 40)                      # 200 records of 300 B, 5 per batch
        await eng.flush()
        eng.drop_caches()
        await asyncio.sleep(0.3)
        assert not pacer.hot_active()
        alone = await old.read(0, 1 << 20)
        assert sum(len(b.payload) for b in alone) > 8 << 10, "nothing hot: not cut"

        async with producing(hot, pacer):
            eng.drop_caches()
            cut = await old.read(0, 1 << 20)
            assert 0 < sum(len(b.payload) for b in cut) <= 4 << 10
            assert [bytes(b.payload) for b in cut] == [bytes(b.payload) for b in alone[:len(cut)]]
    finally:
        await eng.close()


async def test_cold_read_piece_bytes_reaches_the_file_store(tmp_path) -> None:
    """cold_read_piece_bytes is what the file store reads per device read while producers
    append (a WAL write on the same disk waits behind one such read)."""
    eng = open_engine(small_config(tmp_path, cold_read_piece_bytes=32 << 10))
    await eng.start()
    try:
        inner = eng.store.inner
        assert inner.hot_read_piece == 32 << 10 and inner.gentle() is False
    finally:
        await eng.close()


async def test_release_returns_while_other_streams_keep_appending(tmp_path) -> None:
    """A hand-over (cluster move) uploads until the released stream is committed, not until
    nothing is pending: under a steady load on other streams that never happens, and the move
    would wait for the load to stop (it took 32 s under a flat-out producer on moto S3)."""
    eng = open_engine(small_config(tmp_path, upload_interval_s=60,
                                   upload_threshold_bytes=64 << 20))
    await eng.start()
    try:
        moving, busy = await eng.create_stream(), await eng.create_stream()
        await fill(moving, 20)
        stop = asyncio.Event()

        async def produce() -> None:        # appends back to back until stopped
            while not stop.is_set():
                await busy.append(payload(busy.stream_id, busy.end_offset, 100),
                                  busy.end_offset, 1)
        load = asyncio.create_task(produce())
        await asyncio.sleep(0.2)
        try:
            t0 = asyncio.get_running_loop().time()
            end = await asyncio.wait_for(eng.release_stream(moving.stream_id), 20)
            took = asyncio.get_running_loop().time() - t0
            assert not load.done(), "the load stopped: no test"
        finally:
            stop.set()
            await load
        assert end == 100 and took < 5, (end, took)
    finally:
        await eng.close()


async def test_release_uploads_only_its_own_stream_and_keeps_the_wal_for_the_rest(
        tmp_path) -> None:
    """Issue 16: a move uploads only the released stream's pending entries (it waited for the
    whole upload backlog ahead of its last record: seconds on S3 under load). The others stay
    pending, the WAL is not trimmed past the first of them, and they survive a crash."""
    c = small_config(tmp_path, upload_interval_s=3600, upload_threshold_bytes=64 << 20)
    eng = open_engine(c)
    await eng.start()
    try:
        backlog, moving = await eng.create_stream(), await eng.create_stream()
        await fill(backlog, 30)                      # older in the WAL than the moving stream
        await fill(moving, 4)
        await fill(backlog, 10)
        first = min(e.wal_offset for e in eng.cache.pending)
        puts = []
        put = eng.store.put
        eng.store.put = lambda key, data: (puts.append(len(data)), put(key, data))[1]
        end = await asyncio.wait_for(eng.release_stream(moving.stream_id), 20)
        assert end == 20 and moving.committed == 20
        assert backlog.committed == 0, "the backlog was uploaded by the move"
        assert {e.stream_id for e in eng.cache.pending} == {backlog.stream_id}
        assert [e.base_offset for e in eng.cache.pending] == list(range(0, 200, 5))
        assert eng.wal.trim_offset <= first, (eng.wal.trim_offset, first)
        assert sum(puts) < 4 * 600, puts             # about 4 payloads of 300 B, not 44
        eng.store.put = put
    finally:
        for t in eng._tasks:                         # a crash: no final upload
            t.cancel()
        eng.closing = True
        eng.wal.close()
        eng.meta.close()
    eng = open_engine(c)                             # the backlog is recovered from the WAL
    await eng.start()
    try:
        b = await eng.open_stream(backlog.stream_id)
        assert b.end_offset == 200
        assert len(await read_all(b)) == 40
    finally:
        await eng.close()


@pytest.mark.parametrize("earlier_fails", [False, True])
async def test_release_writes_its_object_while_an_earlier_upload_of_the_stream_runs(
        tmp_path, earlier_fails) -> None:
    """Issue 16: a release does not wait for the upload loop's object holding the stream's
    earlier entries before writing its own (seconds on S3 under load): it waits only before
    its commit, so the stream's objects still commit in offset order. If that earlier upload
    fails, the release's object is not committed either; both are taken again."""
    import threading
    eng = open_engine(small_config(tmp_path, upload_interval_s=3600,
                                   upload_threshold_bytes=64 << 20))
    await eng.start()
    gate = threading.Event()
    try:
        s = await eng.create_stream()
        await fill(s, 4)                             # 0..20: taken by the "upload loop"
        early = eng.cache.take_pending(1 << 30)
        await fill(s, 4)                             # 20..40: the release's own
        put = eng.store.put
        puts: list[str] = []
        blocked = threading.Event()

        def slow_put(key, data):
            puts.append(key)
            if not blocked.is_set():                 # the earlier upload's put
                blocked.set()
                gate.wait(10)
                if earlier_fails:
                    raise OSError("object store hiccup")
            return put(key, data)
        eng.store.put = slow_put

        async def loop_upload() -> None:             # what the upload loop does
            try:
                await eng._upload(early)
            except Exception:
                eng.cache.return_pending(early)
        earlier = asyncio.create_task(loop_upload())
        while not blocked.is_set():
            await asyncio.sleep(0.01)
        release = asyncio.create_task(eng.release_stream(s.stream_id))
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while len(puts) < 2 and loop.time() < end:
            await asyncio.sleep(0.01)
        assert len(puts) == 2, "the release waited for the earlier upload to write its object"
        assert s.committed == 0 and not release.done()   # but does not commit before it
        gate.set()
        await earlier
        assert await asyncio.wait_for(release, 20) == 40
        assert s.committed == 40
        ranges = await eng.io(eng.meta.stream_ranges, s.stream_id)
        assert [(r.start_offset, r.end_offset) for r in ranges] in (
            [(0, 20), (20, 40)], [(0, 40)]), ranges
        eng.drop_caches()
        assert len(await read_all(s)) == 8
    finally:
        gate.set()
        await eng.close()


async def test_a_stream_claimed_by_another_node_does_not_block_other_uploads(tmp_path) -> None:
    """Entries of a stream another node claimed meanwhile can never be committed here; they
    are dropped (logged) instead of failing every upload behind them for good (the WAL and
    the cache would fill and every produce on the broker wait)."""
    eng = open_engine(small_config(tmp_path, upload_interval_s=0.1))
    await eng.start()
    try:
        lost, fine = await eng.create_stream(), await eng.create_stream()
        await fill(lost, 2)
        await eng.flush()
        assert lost.committed == 10
        # another node takes the stream over (a move this node missed), then this node
        # still appends to it, and to another stream
        assert await eng.io(eng.meta.claim_stream, lost.stream_id, 7, 5)
        await fill(lost, 3)
        await fill(fine, 4)
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while fine.committed < fine.end_offset and loop.time() < end:
            await asyncio.sleep(0.05)
        assert fine.committed == fine.end_offset == 20
        assert eng.cache.pending_bytes == 0
        assert lost.committed == 10                  # nothing of node 7's stream from here
        assert not lost.owned
        assert await eng.io(eng.meta.stream_owner, lost.stream_id) == (7, 5)
    finally:
        await eng.close()


async def test_records_of_a_claimed_stream_stay_in_the_wal_until_someone_commits_them(
        tmp_path) -> None:
    """Issue 17: entries of a stream another node claimed are dropped from the cache, but the
    WAL is not trimmed past them: the claimer may be the taker of this very WAL, which commits
    them from it. Here node 7 claims the stream, this node keeps uploading another stream,
    then node 7 takes the WAL over: it must find every record of the claimed stream."""
    from storage.metastore import StreamFenced, open_metastore
    from storage.objects.store import open_object_store
    from storage.takeover import take_over_wal
    eng = open_engine(small_config(tmp_path, upload_interval_s=3600,
                                   upload_threshold_bytes=64 << 20))
    await eng.start()
    try:
        lost, fine = await eng.create_stream(), await eng.create_stream()
        await fill(lost, 2)
        await eng.flush()
        assert lost.committed == 10
        assert await eng.io(eng.meta.claim_stream, lost.stream_id, 7, 5)
        await fill(lost, 3)                          # 10..25: in this WAL only
        await fill(fine, 4)
        held = min(e.wal_offset for e in eng.cache.pending if e.stream_id == lost.stream_id)
        with pytest.raises(StreamFenced):
            await eng.flush()
        await eng.flush()                            # the claimed stream's entries dropped
        assert fine.committed == 20 and eng.cache.pending_bytes == 0
        assert eng.wal.trim_offset <= held, (eng.wal.trim_offset, held)
        await fill(fine, 2)                          # later uploads do not trim past them
        await eng.flush()
        assert fine.committed == 30 and eng.wal.trim_offset <= held
        c = eng.config
    finally:
        await eng.close()
    meta = open_metastore(c.metadata_url)
    try:
        res = take_over_wal(c.wal_path, node_id=c.node_id, node_epoch=c.node_epoch, taker=7,
                            taker_epoch=1, meta=meta, store=open_object_store(c.object_store))
        assert not res.lost, res.lost
        assert meta.stream(lost.stream_id).end_offset == 25
        # once the store covers them, the hold is released (a later upload trims past)
    finally:
        meta.close()


async def test_wal_not_trimmed_past_an_upload_still_in_flight(tmp_path) -> None:
    """Issue 17: two uploads at once (a release's drain beside the upload loop): the one that
    commits first must not trim the WAL past the other's entries, whose commit may still fail
    (the process may die before it retries: the records would be in neither place)."""
    import threading
    eng = open_engine(small_config(tmp_path, upload_interval_s=3600,
                                   upload_threshold_bytes=64 << 20))
    await eng.start()
    gate = threading.Event()
    try:
        a, b = await eng.create_stream(), await eng.create_stream()
        await fill(a, 2)
        first = eng.cache.take_pending(1 << 30)
        await fill(b, 2)
        put = eng.store.put
        blocked = threading.Event()

        def slow_put(key, data):
            if not blocked.is_set():     # only the first put (a's upload) waits for the gate
                blocked.set()
                gate.wait(10)
            return put(key, data)
        eng.store.put = slow_put
        slow = asyncio.create_task(eng._upload(first))
        while not blocked.is_set():
            await asyncio.sleep(0.01)
        await eng.flush()                # b's entries uploaded, committed, trim attempted
        assert b.committed == 10
        assert not slow.done() and a.committed == 0
        assert eng.wal.trim_offset <= first[0].wal_offset, (eng.wal.trim_offset,
                                                            first[0].wal_offset)
        gate.set()
        eng.store.put = put
        await slow
        assert a.committed == 10
        await fill(b, 1)
        await eng.flush()
        assert eng.wal.trim_offset > first[-1].wal_offset     # free to trim now
    finally:
        gate.set()
        await eng.close()


async def test_no_upload_commit_or_trim_while_the_lease_is_lapsed(tmp_path) -> None:
    """Issue 17: a node whose lease lapsed (paused past it, maybe fenced already) writes
    nothing to storage: the uploader leaves its entries pending and the WAL untrimmed until
    the lease is renewed (the cluster room sets ``writes_allowed`` to its lease check)."""
    eng = open_engine(small_config(tmp_path, upload_interval_s=0.05))
    await eng.start()
    lease = {"valid": False}
    eng.writes_allowed = lambda: lease["valid"]
    try:
        s = await eng.create_stream()
        await fill(s, 4)
        trimmed = eng.wal.trim_offset
        await asyncio.sleep(0.6)                     # many upload rounds due
        assert s.committed == 0 and eng.cache.pending_bytes > 0
        assert eng.wal.trim_offset == trimmed
        assert await eng.io(eng.meta.stream, s.stream_id) is not None
        assert (await eng.io(eng.meta.stream, s.stream_id)).end_offset == 0
        with pytest.raises(StorageError, match="lease lapsed"):
            await eng.flush()                        # a drain (release, shutdown) too
        assert (await eng.io(eng.meta.stream, s.stream_id)).end_offset == 0
        lease["valid"] = True
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        # the trim follows the commit (a thread hop later): wait for both
        while (s.committed < 20 or eng.wal.trim_offset <= trimmed) and loop.time() < end:
            await asyncio.sleep(0.05)
        assert s.committed == 20 and eng.wal.trim_offset > trimmed
    finally:
        lease["valid"] = True
        await eng.close()


async def test_an_upload_taking_its_entries_in_slices_holds_the_wal_trim_point(
        tmp_path, monkeypatch) -> None:
    """The uploader takes its entries a chunk at a time with loop turns in between (tens of
    thousands of small entries were one event-loop stall): from before the first chunk its
    in-flight mark holds the WAL trim point at the first pending entry, so a drain's trim
    meanwhile (a partition move) never passes entries already taken; all durable entries are
    taken in WAL order."""
    import storage.engine as engine_mod
    monkeypatch.setattr(engine_mod, "TAKE_SLICE", 2)
    eng = open_engine(small_config(tmp_path, upload_threshold_bytes=1 << 30,
                                   upload_interval_s=3600))
    await eng.start()
    try:
        s = await eng.create_stream()
        await fill(s, 9)
        first = eng.cache.pending[0].wal_offset
        take = asyncio.ensure_future(eng._take_for_upload(1 << 30))
        await asyncio.sleep(0)                 # the first chunk is taken, the take yields
        assert not take.done() and len(eng.cache.pending) == 7
        assert await eng._trim_point([], -12345) <= first
        entries, key = await take
        assert [e.base_offset for e in entries] == list(range(0, 45, 5))
        assert eng._inflight[key] <= first and not eng.cache.pending
        eng.cache.return_pending(entries)
        eng._inflight.pop(key)
    finally:
        await eng.close()


@pytest.mark.parametrize("fail_at", [None, 2])
async def test_large_upload_rounds_are_split_into_objects_written_one_behind_the_next(
        tmp_path, monkeypatch, fail_at) -> None:
    """An upload round larger than OBJECT_SPLIT_BYTES goes to several objects (each fits a
    reused encode buffer), the next one encoded while the previous one is written; all read
    back in order. A put that fails fails the round: nothing is committed, the entries are
    taken again and every record still reads back."""
    import storage.engine as engine_mod
    from storage.engine import open_engine
    monkeypatch.setattr(engine_mod, "OBJECT_SPLIT_BYTES", 96 << 10)
    cfg = small_config(tmp_path, object_store=f"mem://split-{tmp_path.name}-{fail_at}",
                       upload_threshold_bytes=1 << 20, upload_interval_s=3600)
    eng = open_engine(cfg)
    await eng.start()
    real_put = eng.store.put
    puts: list[tuple[str, float, float]] = []
    calls = itertools.count()       # numbered on entry: two puts run at once (threads)

    def put(key, data):
        t0 = time.monotonic()
        if next(calls) == fail_at:
            puts.append((key, t0, t0))
            raise OSError("store down")
        time.sleep(0.02)
        real_put(key, data)
        puts.append((key, t0, time.monotonic()))

    eng.store.put = put
    encodes: list[float] = []
    real_encode = engine_mod.encode_object_in_slices
    real_thread_encode = engine_mod.encode_object_into

    async def encode(*a, **kw):
        encodes.append(time.monotonic())
        return await real_encode(*a, **kw)

    def thread_encode(*a, **kw):         # (small records too, with the C encoder)
        encodes.append(time.monotonic())
        return real_thread_encode(*a, **kw)

    monkeypatch.setattr(engine_mod, "encode_object_in_slices", encode)
    monkeypatch.setattr(engine_mod, "encode_object_into", thread_encode)
    try:
        s = await eng.create_stream()
        await fill(s, 80, size=6000)             # ~480 KB: 5-6 objects of <= 96 KiB payload
        try:
            await eng.flush()
        except Exception:  # noqa: BLE001 - the failing put's round (retried below)
            pass
        if fail_at is not None:
            assert [p[2] == p[1] for p in puts].count(True) == 1     # the failed put
            await eng.flush()                    # taken again, now without failures
        assert s.committed == s.end_offset
        ok = [p for p in puts if p[2] > p[1]]
        assert len(ok) >= 5
        # an object was encoded while the one before it was being written
        assert any(t0 < e < t1 for _, t0, t1 in ok for e in encodes)
        eng.drop_caches()
        assert len(await read_all(s)) == 80
    finally:
        await eng.close()


async def test_an_upload_of_small_records_is_encoded_off_the_loop_with_the_c_encoder(
        tmp_path, monkeypatch) -> None:
    """With the C encoder built, a background upload of small records (~1 KB: the latency
    benchmark's linger-0 requests) is encoded on an IO thread, which holds the interpreter
    lock only to gather each block's records: encoded in slices on the loop, a 64 MiB upload
    took 150-250 ms of the loop's time in steps of up to 9 ms. The objects read back."""
    from storage import copycrc
    from storage.engine import open_engine
    from storage.objects import format as fmt
    if copycrc.encode_blocks is None:
        pytest.skip("the C encoder is not built: the loop encodes in slices")
    threads: list[int] = []

    def on_thread(real):
        def encode(self, *a, **kw):
            threads.append(threading.get_ident())
            return real(self, *a, **kw)
        return encode

    # whole objects (ObjectEncoder), or a window at a time by a file:// put (StreamEncoder:
    # fill, or fill_writing where it writes its windows itself; both run _fill)
    monkeypatch.setattr(fmt.ObjectEncoder, "encode", on_thread(fmt.ObjectEncoder.encode))
    monkeypatch.setattr(fmt.StreamEncoder, "_fill", on_thread(fmt.StreamEncoder._fill))
    cfg = small_config(tmp_path, upload_threshold_bytes=256 << 10, upload_interval_s=3600)
    eng = open_engine(cfg)
    await eng.start()
    try:
        s = await eng.create_stream()
        await fill(s, 400, size=1000)            # ~400 KB of 1 KB records: past the threshold
        for _ in range(500):
            if eng.stats.uploads and threads:
                break
            await asyncio.sleep(0.01)
        assert threads and threading.get_ident() not in threads
        await eng.flush()
        eng.drop_caches()
        assert len(await read_all(s)) == 400
    finally:
        await eng.close()


async def test_a_background_upload_paces_its_loop_passes(tmp_path, monkeypatch) -> None:
    """A background upload's passes over its entries on the loop (the take - which groups and
    sums as it goes -, else the grouping by stream and the payload sums; the sizing) wait
    ``_upload_pause()`` after each slice, as the
    sliced encode did: at a tenth of the maximum produce rate the loop is busy most of the
    time, and ~45,000 entries taken and grouped back to back queued requests behind them.
    The objects read back."""
    import sys

    import storage.engine as engine_mod
    monkeypatch.setattr(engine_mod, "TAKE_SLICE", 2)
    monkeypatch.setattr(engine_mod, "GROUP_CHUNK", 2)
    monkeypatch.setattr(engine_mod, "SLICE_S", 0.0)
    import storage.loop_slices as slices_mod
    cfg = small_config(tmp_path, upload_threshold_bytes=1 << 30, upload_interval_s=3600)
    eng = open_engine(cfg)
    await eng.start()
    try:
        s = await eng.create_stream()
        await fill(s, 12, size=200)
        asked: list[str] = []

        def pause() -> float:
            asked.append(sys._getframe(1).f_code.co_name)
            return 0.0005
        eng._upload_pause = pause
        real_size = slices_mod.object_size_in_slices

        async def sized(recs, block, slice_s=slices_mod.SLICE_S, pause=None):
            return await real_size(recs, block, 0.0, pause)   # a slice per CHECK_EVERY records
        monkeypatch.setattr(engine_mod, "object_size_in_slices", sized)
        monkeypatch.setattr(slices_mod, "CHECK_EVERY", 1)
        entries, key = await eng._take_for_upload(1 << 30)
        assert len(entries) == 12
        await eng._upload(entries, key_=key, background=True)
        # (the take groups and sums them: LogCache.take_grouped)
        for where in ("_take_for_upload", "object_size_in_slices"):
            assert asked.count(where) >= 2, (where, asked)
        assert s.committed == s.end_offset
        # entries taken without grouping (a drain's take): grouped and summed in slices
        await fill(s, 12, size=200)
        asked.clear()
        entries = eng.cache.take_pending(1 << 30)
        assert len(entries) == 12
        await eng._upload(entries, background=True)
        for where in ("_upload_entries", "_payload_cumsum", "object_size_in_slices"):
            assert asked.count(where) >= 2, (where, asked)
        assert s.committed == s.end_offset
        eng.drop_caches()
        assert len(await read_all(s)) == 24
    finally:
        await eng.close()


async def test_an_upload_groups_and_sums_its_entries_as_it_takes_them(tmp_path,
                                                                       monkeypatch) -> None:
    """The upload loop's take hands its entries over grouped by stream with their running
    payload sums (LogCache.take_grouped, one C pass when built): the upload then makes no pass
    of its own over the entries to group them or sum their payloads (those passes were
    ~20-30 ms of loop time per 64 MiB of small produce requests). Streams with their own
    objects and streams sharing one, both read back."""
    import operator

    import storage.engine as engine_mod
    passes: list[str] = []
    real_cumsum = engine_mod._payload_cumsum
    real_sid = operator.attrgetter("stream_id")

    async def cumsum(recs, pause=engine_mod.no_pause):
        passes.append("cumsum")
        return await real_cumsum(recs, pause)

    def sid(e):
        passes.append("stream_id")
        return real_sid(e)
    monkeypatch.setattr(engine_mod, "_payload_cumsum", cumsum)
    monkeypatch.setattr(engine_mod, "_STREAM_ID", sid)
    cfg = small_config(tmp_path, upload_threshold_bytes=1 << 30, upload_interval_s=3600,
                       stream_object_threshold_bytes=40 << 10)
    eng = open_engine(cfg)
    await eng.start()
    try:
        big = await eng.create_stream()          # ~60 KB: objects of its own
        smalls = [await eng.create_stream() for _ in range(3)]   # ~6 KB each: shared
        for i in range(60):
            await fill(big, 1, size=1000)
            if i % 3 == 0:
                await fill(smalls[i % 9 // 3], 1, size=300)
        entries, key = await eng._take_for_upload(1 << 30)
        assert len(entries) == 80
        await eng._upload(entries, key_=key, background=True)
        assert passes == []
        assert eng.stats.objects_written["so"] >= 1 and eng.stats.objects_written["sso"] >= 1
        for s in [big] + smalls:
            assert s.committed == s.end_offset
        eng.drop_caches()
        assert len(await read_all(big)) == 60
        assert [len(await read_all(s)) for s in smalls] == [7, 7, 6]
    finally:
        await eng.close()


def test_split_records_cuts_like_the_one_record_at_a_time_rule() -> None:
    """An upload's records are cut into objects of at most ``limit`` payload bytes (a larger
    record alone), by C-level passes: the same parts as adding one record at a time."""
    import random

    from storage.engine import _split_records
    from storage.objects.format import Record

    def reference(recs, limit):
        parts, cur, size = [], [], 0
        for r in recs:
            if cur and size + len(r.payload) > limit:
                parts.append((cur, size))
                cur, size = [], 0
            cur.append(r)
            size += len(r.payload)
        if cur:
            parts.append((cur, size))
        return parts

    rnd = random.Random(3)
    for _ in range(300):
        recs = [Record(1, i, 1, b"x" * rnd.choice([0, 1, 50, 1000, 5000]))
                for i in range(rnd.choice([0, 1, 2, 10, 400]))]
        limit = rnd.choice([1, 100, 1000, 5000, 1 << 20])
        assert _split_records(recs, limit) == reference(recs, limit)


async def test_payload_sums_in_slices_cut_like_the_one_pass() -> None:
    """The upload sums payload sizes chunk by chunk with yields in between (one pass over an
    upload's ~46,000 entries was a 3-5 ms loop stall): the same running sums, the same parts."""
    import itertools
    import random

    from storage import engine as E
    from storage.objects.format import Record

    rnd = random.Random(5)
    for n in (0, 1, E.GROUP_CHUNK - 1, E.GROUP_CHUNK, 3 * E.GROUP_CHUNK + 7):
        recs = [Record(1, i, 1, b"x" * rnd.choice([0, 3, 1400, 9000])) for i in range(n)]
        cum = await E._payload_cumsum(recs)
        assert cum == list(itertools.accumulate(len(r.payload) for r in recs))
        assert E._split_records(recs, 20_000, cum=cum) == E._split_records(recs, 20_000)


async def test_a_stream_written_elsewhere_after_start_is_known_stale(tmp_path) -> None:
    """A partition handed to a broker while it starts: the broker's engine loaded the stream
    before the other node's last commits, so its view ends early. Opening that view appended
    over offsets the other node had acknowledged (test_cluster.py, 1 run in ~100: a fatal
    OUT_OF_ORDER_SEQUENCE, the producer state replayed 0..990 of a log ending at 2501).
    ``written_elsewhere`` says so, and ``acquire_stream`` gives the true end."""
    shared = dict(object_store=f"file://{tmp_path}/objects",
                  metadata_url=f"sqlite:///{tmp_path}/meta.db", upload_interval_s=3600)
    a = open_engine(small_config(tmp_path / "a", node_id=0, **shared))
    await a.start()
    b = None
    try:
        s = await a.acquire_stream((await a.create_stream()).stream_id, 0)
        await fill(s, 10)
        await a.release_stream(s.stream_id)            # everything committed: end 50
        b = open_engine(small_config(tmp_path / "b", node_id=1, **shared))
        await b.start()                                # b's view of the stream: end 50
        assert (await b.open_stream(s.stream_id)).end_offset == 50
        assert await b.written_elsewhere(s.stream_id)  # node 0 claimed it last
        s = await a.acquire_stream(s.stream_id, 1)      # node 0 writes on (epoch 1)
        await fill(s, 10)
        assert await a.release_stream(s.stream_id) == 100
        assert (await b.open_stream(s.stream_id)).end_offset == 50      # stale
        assert await b.written_elsewhere(s.stream_id)
        mine = await b.acquire_stream(s.stream_id, 2)  # handed to node 1 at epoch 2
        assert mine.end_offset == 100
        assert not await b.written_elsewhere(s.stream_id)   # node 1 wrote (claimed) last
        await fill(mine, 2)
        assert not await b.written_elsewhere(s.stream_id)   # its own tail, not uploaded yet
        assert len(await read_all(mine)) == 22
    finally:
        await a.close()
        if b is not None:
            await b.close()


async def test_the_upload_backlog_counts_what_an_upload_in_flight_took(tmp_path) -> None:
    """The backlog (the upload_backlog_bytes metric) is what was appended and not uploaded
    yet, including the entries an upload took and has not committed: while an upload waits on
    the store, pending alone read 0 (an outage scrape showed no backlog at all)."""
    import threading
    cfg = small_config(tmp_path, object_store=f"mem://backlog-{tmp_path.name}",
                       upload_threshold_bytes=1 << 30, upload_interval_s=3600)
    eng = open_engine(cfg)
    await eng.start()
    real_put = eng.store.put
    release = threading.Event()

    def put(key, data):
        release.wait(30)
        real_put(key, data)

    eng.store.put = put
    try:
        s = await eng.create_stream()
        assert eng.upload_backlog() == (0, [])
        await fill(s, 20)
        appended, firsts = eng.upload_backlog()
        assert appended > 0 and firsts == [eng.cache.pending[0]]
        flush = asyncio.ensure_future(eng.flush())
        for _ in range(500):                         # the upload takes the pending entries
            if not eng.cache.pending:
                break
            await asyncio.sleep(0.01)
        assert not eng.cache.pending and eng.cache.pending_bytes == 0
        backlog, firsts = eng.upload_backlog()
        assert backlog == appended and len(firsts) == 1 and firsts[0].base_offset == 0
        release.set()
        await flush
        assert eng.upload_backlog() == (0, [])
    finally:
        release.set()
        await eng.close()


async def test_appends_wait_while_the_wal_holds_max_buffered_bytes(tmp_path, monkeypatch) -> None:
    """Appends on the loop wait for the WAL's writes while it holds max_buffered_bytes not yet
    durable (as a blocking append does), and the task-less append_now refuses then: otherwise
    appends outpacing the device grew the WAL's un-durable blocks past its buffer pool, each
    further block a fresh mapping faulted in on the loop (FINDINGS, session 18 confluent)."""
    eng = open_engine(small_config(tmp_path))
    await eng.start()
    try:
        s = await eng.create_stream()
        room = asyncio.Event()
        asked: list[int] = []

        async def wait_for_room(size: int) -> None:
            asked.append(size)
            await room.wait()

        monkeypatch.setattr(eng.wal, "has_room", lambda size: room.is_set())
        monkeypatch.setattr(eng.wal, "wait_for_room", wait_for_room)
        data = payload(s.stream_id, 0)
        assert s.append_now(data, 0, 5, lambda fut: None) is False
        assert s.end_offset == 0
        task = asyncio.create_task(s.append(data, 0, 5))
        for _ in range(200):
            if asked:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert asked and not task.done() and s.end_offset == 0
        room.set()
        await asyncio.wait_for(task, 10)
        assert (s.end_offset, s.confirmed_offset) == (5, 5)
        assert [bytes(b.payload) for b in await read_all(s)] == [data]
        assert s.append_now(payload(s.stream_id, 5), 5, 5, lambda fut: None) is True
    finally:
        await eng.close()


async def test_append_now_continues_in_the_wal_completion_of_its_write(tmp_path) -> None:
    """EngineStream.append_now: the caller's ``then(None)`` runs in the call that completes
    the WAL write (the loop's AIO completion: no future, done callback or loop iteration per
    append between durable and the caller's answer), after the stream's bookkeeping (the
    confirmed offset includes it); appends are continued in order."""
    eng = open_engine(small_config(tmp_path))
    await eng.start()
    try:
        driver = eng.wal._driver
        if driver is None:
            pytest.skip("the WAL is not written by the loop's AIO here")
        completing = flag_completions(driver)
        s = await eng.create_stream()
        seen: list[tuple[int, object, bool, int]] = []
        for i in range(20):
            assert s.append_now(payload(s.stream_id, 5 * i), 5 * i, 5,
                                lambda err, i=i: seen.append((i, err, completing[0],
                                                              s.confirmed_offset)))
        for _ in range(10_000):
            if len(seen) == 20:
                break
            await asyncio.sleep(0.001)
        assert [(i, err, inside) for i, err, inside, _c in seen] == \
            [(i, None, True) for i in range(20)]
        assert all(conf >= 5 * (i + 1) for i, _e, _in, conf in seen)
        assert [bytes(b.payload) for b in await read_all(s)] == \
            [payload(s.stream_id, 5 * i) for i in range(20)]
    finally:
        await eng.close()


def test_an_encode_buffer_made_for_a_small_object_serves_a_full_size_one_later(tmp_path) -> None:
    """The upload's encode buffers are made big enough for an object of OBJECT_SPLIT_BYTES
    whatever the first object needs (pages are faulted in only as they are written): the
    first upload's ~16 MiB objects made buffers that the 28 MiB objects after them replaced
    with new ones, whose fresh pages cost ~0.1 s of CPU per broker start on the test VM."""
    import storage.engine as engine_mod
    eng = open_engine(small_config(tmp_path))
    try:
        first = [eng._take_encode_buffer(n) for n in (100_000, 5 << 20, 16 << 20)]
        for buf in first:
            eng._give_encode_buffer(buf)
        later = [eng._take_encode_buffer(engine_mod.OBJECT_SPLIT_BYTES + 50_000)
                 for _ in first]
        assert sorted(map(id, later)) == sorted(map(id, first))
        assert all(len(b) >= engine_mod.OBJECT_SPLIT_BYTES + 50_000 for b in later)
    finally:
        for buf in first:
            buf.close()


@pytest.mark.parametrize("threshold, cache, bound", [
    (1 << 30, 1 << 20, (512 << 10) + 1),     # cache pressure: over half the LogCache
    (64 << 10, 1 << 20, 64 << 10),           # the upload threshold
], ids=["cache-pressure", "threshold"])
async def test_an_append_wakes_the_upload_at_the_first_of_its_two_bounds(
        tmp_path, threshold, cache, bound) -> None:
    """The append (task-less, as a Produce request's) that brings the bytes waiting for upload
    to the upload threshold or over half the LogCache wakes the upload loop in its own call,
    before its write is durable; none before it does (the two bounds are one comparison)."""
    eng = open_engine(small_config(tmp_path, upload_threshold_bytes=threshold,
                                   log_cache_bytes=cache, upload_interval_s=3600))
    await eng.start()
    try:
        s = await eng.create_stream()
        durable: list[object] = []
        eng._upload_wakeup.clear()
        woken_at = None
        for i in range(10_000):          # entries of 1 KiB (payload + 64): the bounds are hit
            assert s.append_now(payload(s.stream_id, i, 960), i, 1, durable.append)
            if eng._upload_wakeup.is_set():
                woken_at = eng.cache.pending_bytes
                break
        assert woken_at == -(-bound // 1024) * 1024
        assert durable == []                 # no completion ran yet: woken by the append
    finally:
        await eng.close()
