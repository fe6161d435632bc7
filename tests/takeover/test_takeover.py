"""WAL takeover (storage/takeover.py): the failure classes known from AutoMQ's WAL - a taker
trimming the wrong WAL, a trim offset written after an OOM kill, recovery across wrap-around,
a taker dying mid-takeover, a zombie resuming after its WAL was taken over - on real files,
a real loop device where available, SQLite (and PostgreSQL) and a file:// object store."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from bench.common import free_port, tied_popen
from storage.engine import open_engine
from storage.metastore import (WAL_ACTIVE, WAL_TAKEN_OVER, WAL_TAKING_OVER, TakeoverConflict,
                               open_metastore)
from storage.objects.store import open_object_store
from storage.takeover import TakeoverError, read_header, take_over_wal, wal_identity
from storage.wal import FencedError
from storage.wal.device import Device
from storage.wal.format import (HEADER_AREA, TAKEOVER_DONE, TAKEOVER_FENCED, TAKEOVER_NONE)

import loopdev
from takeover_helpers import (HERE, REPO, build_dead_wal, check_exactly_once, commit_records,
                              framed, node_config, open_wal, payload, run_py)

CRASH_POINTS = ["takeover_after_fence", "takeover_before_commit", "takeover_after_commit",
                "takeover_before_done"]


@pytest.fixture
def stores(tmp_path):
    meta = open_metastore(f"sqlite:///{tmp_path}/meta.db")
    store = open_object_store(f"file://{tmp_path}/objects")
    yield meta, store, f"sqlite:///{tmp_path}/meta.db", f"file://{tmp_path}/objects"
    meta.close()


def header_of(path: str):
    dev = Device(path, os.path.getsize(path) if os.path.isfile(path) else 4096 * 4)
    try:
        return read_header(dev)
    finally:
        dev.close()


def take(path, meta, store, **kw):
    kw.setdefault("node_id", 1)
    kw.setdefault("node_epoch", 0)
    kw.setdefault("taker", 2)
    kw.setdefault("taker_epoch", 1)
    return take_over_wal(path, meta=meta, store=store, object_block_bytes=16 << 10, **kw)


def test_takeover_commits_every_record_once_and_fences(tmp_path, stores):
    meta, store, *_ = stores
    path = str(tmp_path / "wal-1")
    acked = build_dead_wal(path, meta, store, node_id=1, records=300, uploaded=120)
    res = take(path, meta, store)
    assert (res.records, res.skipped_records, res.committed_records) == (180, 0, 180)
    assert check_exactly_once(meta, store, acked) == 300
    hdr = header_of(path)
    assert (hdr.takeover_state, hdr.taken_over_by, hdr.taken_over_epoch) == (TAKEOVER_DONE, 2, 1)
    assert hdr.node_id == 1 and hdr.trim_offset == res.wal_end
    again = take(path, meta, store, taker=3, taker_epoch=2)
    assert again.already_done and again.committed_records == 0
    assert check_exactly_once(meta, store, acked) == 300


def test_header_without_takeover_stays_version_1(tmp_path):
    """Backward compatible: a WAL never taken over is written as version 1 (older code reads
    it); a fenced one as version 2, which version-1 code cannot parse, so it refuses it."""
    from storage.wal.format import WALHeader
    plain = WALHeader(capacity=1 << 20, trim_offset=7, node_id=4, node_epoch=9).encode()
    assert int.from_bytes(plain[4:6], "big") == 1
    assert WALHeader.decode(plain) == WALHeader(1 << 20, 7, 0, 0, 4, 9, 0)
    fenced = WALHeader(capacity=1 << 20, node_id=4, takeover_state=TAKEOVER_FENCED,
                       taken_over_by=5, taken_over_epoch=6).encode()
    assert int.from_bytes(fenced[4:6], "big") == 2
    back = WALHeader.decode(fenced)
    assert (back.takeover_state, back.taken_over_by, back.taken_over_epoch) == (1, 5, 6)
    bad = bytearray(fenced)
    bad[60] ^= 1
    assert WALHeader.decode(bytes(bad)) is None


def test_zombie_reopening_is_refused_until_reformatted(tmp_path, stores):
    meta, store, *_ = stores
    path = str(tmp_path / "wal-1")
    acked = build_dead_wal(path, meta, store, node_id=1, records=60, uploaded=0, epoch=4)
    take(path, meta, store, node_epoch=4)
    for kw in ({}, {"node_epoch": 5}, {"reformat_taken_over": True}):
        w = open_wal(path, 4 << 20, 1, **{"epoch": kw.get("node_epoch", 4), **{
            k: v for k, v in kw.items() if k != "node_epoch"}})
        with pytest.raises(FencedError, match="taken over by node 2 at epoch 1"):
            w.open()
    # the owner re-registered at a newer epoch and asks explicitly: a fresh, empty WAL
    w = open_wal(path, 4 << 20, 1, epoch=5, reformat_taken_over=True)
    assert list(w.open()) == []
    w.append(framed(99, 0, 1), 99).future.result(timeout=10)
    w.close()
    w = open_wal(path, 4 << 20, 1, epoch=5)
    recs = list(w.open())
    w.close()
    assert len(recs) == 1 and recs[0][1] == framed(99, 0, 1)
    assert header_of(path).takeover_state == TAKEOVER_NONE
    assert check_exactly_once(meta, store, acked) == 60


def test_takeover_in_progress_is_never_reformatted(tmp_path, stores):
    meta, store, meta_url, store_url = stores
    path = str(tmp_path / "wal-1")
    build_dead_wal(path, meta, store, node_id=1, records=30, uploaded=0)
    r = run_py("run_takeover.py", path, meta_url, store_url, "1", "0", "2", "1",
               env={"S3KAFKA_CRASH_POINT": "takeover_after_fence"})
    assert r.returncode == 137, r.stderr
    assert header_of(path).takeover_state == TAKEOVER_FENCED
    w = open_wal(path, 4 << 20, 1, epoch=9, reformat_taken_over=True)
    with pytest.raises(FencedError, match="still in progress"):
        w.open()


def test_running_zombie_cannot_append_after_takeover(tmp_path, stores):
    """The owner still runs (paused, partitioned): after the takeover its next header write
    (trim, window growth, close) sees the fence, the WAL stops, appends fail; nothing it wrote
    after the fence is committed, and the fence survives its close()."""
    meta, store, *_ = stores
    path = str(tmp_path / "wal-1")
    sid = meta.create_stream()
    w = open_wal(path, 4 << 20, 1)
    list(w.open())
    for base in range(20):
        w.append(framed(sid, base, 1), sid).future.result(timeout=10)
    res = take(path, meta, store)
    assert res.committed_records == 20
    late = w.append(framed(sid, 20, 1), sid)          # lands in the ring, acked by the WAL...
    late.future.result(timeout=10)
    with pytest.raises(FencedError, match="taken over by node 2"):
        w.trim(late.next_offset)                        # ...but the zombie's trim stops it
    with pytest.raises(FencedError):
        w.append(framed(sid, 21, 1), sid)
    w.close()
    hdr = header_of(path)
    assert hdr.takeover_state == TAKEOVER_DONE and hdr.trim_offset == res.wal_end
    assert meta.stream(sid).end_offset == 20          # nothing of the zombie's became visible
    # a second look at the same WAL commits nothing more either
    assert take(path, meta, store, taker=3, taker_epoch=2).already_done
    assert meta.stream(sid).end_offset == 20


def test_zombie_check_fenced_stops_appends(tmp_path, stores):
    meta, store, *_ = stores
    path = str(tmp_path / "wal-1")
    build_dead_wal(path, meta, store, node_id=1, records=5, uploaded=0)
    w = open_wal(path, 4 << 20, 1)
    list(w.open())
    w.check_fenced()                                    # not fenced: nothing happens
    take(path, meta, store, force_lock=True)
    with pytest.raises(FencedError):
        w.check_fenced()
    with pytest.raises(FencedError):
        w.append(b"x" * 30, 1)
    w.close()
    assert header_of(path).takeover_state == TAKEOVER_DONE


def test_taker_refuses_wrong_wal_and_its_own(tmp_path, stores):
    """AutoMQ #447 (the wrong WAL trimmed after failover): a path holding another node's WAL,
    a newer epoch of the owner, or the taker's own WAL (by another name) is refused with
    nothing written."""
    meta, store, *_ = stores
    path = str(tmp_path / "wal-1")
    build_dead_wal(path, meta, store, node_id=1, records=20, uploaded=0, epoch=5)
    before = open(path, "rb").read(HEADER_AREA)
    with pytest.raises(TakeoverError, match="belongs to node 1, not node 7"):
        take(path, meta, store, node_id=7, node_epoch=5)
    with pytest.raises(FencedError, match="epoch 5 > the fenced epoch 4"):
        take(path, meta, store, node_epoch=4)
    os.link(path, tmp_path / "same-wal")
    with pytest.raises(TakeoverError, match="own WAL"):
        take(path, meta, store, node_epoch=5, own_wal_path=str(tmp_path / "same-wal"))
    with pytest.raises(TakeoverError, match="no s3kafka WAL"):
        (tmp_path / "zero").write_bytes(bytes(1 << 16))
        take(str(tmp_path / "zero"), meta, store)
    assert open(path, "rb").read(HEADER_AREA) == before


async def test_engine_takeover_never_touches_its_own_wal(tmp_path, stores):
    """A live engine (node 2) takes over node 1's WAL through Engine.take_over_wal, then keeps
    appending and uploading: its trims move only its own WAL, node 1's stays fenced at the
    takeover's trim offset, and node 2's header stays its own (not fenced)."""
    meta, store, meta_url, store_url = stores
    dead = str(tmp_path / "wal-1")
    acked = build_dead_wal(dead, meta, store, node_id=1, records=150, uploaded=40)
    eng = open_engine(node_config(tmp_path, meta_url, store_url, 2, node_epoch=1,
                                  upload_threshold_bytes=16 << 10, upload_interval_s=0.05))
    await eng.start()
    try:
        mine = await eng.create_stream()
        with pytest.raises(TakeoverError, match="own WAL"):
            await eng.take_over_wal(eng.config.wal_path, 2, 1, 5)
        res = await eng.take_over_wal(dead, node_id=1, node_epoch=0, taker_epoch=5)
        assert res.committed_records == 110
        dead_hdr = header_of(dead)
        for base in range(0, 400, 2):
            await mine.append(payload(mine.stream_id, base), base, 2)
        await eng.flush()
        assert eng.wal.trim_offset > 0
        assert header_of(dead) == dead_hdr           # untouched by the taker's own trims
        own = header_of(eng.config.wal_path)
        assert own.node_id == 2 and own.node_epoch == 1 and not own.fenced
        assert own.trim_offset == eng.wal.trim_offset
        reg = {w.node_id: w for w in meta.wals()}
        assert reg[2].path == os.path.abspath(eng.config.wal_path)
        assert reg[2].state == WAL_ACTIVE and reg[2].capacity == 4 << 20
        assert reg[2].inode == os.stat(eng.config.wal_path).st_ino
    finally:
        await eng.close()
    check_exactly_once(meta, store, acked + [(mine.stream_id, b, 2) for b in range(0, 400, 2)])


def test_recovery_across_wrap_around_during_takeover(tmp_path, stores):
    """The live records of the dead WAL straddle the ring's end (several laps written)."""
    meta, store, *_ = stores
    path = str(tmp_path / "wal-1")
    cap = 256 << 10
    ring = cap - HEADER_AREA
    sids = [meta.create_stream() for _ in range(2)]
    ends = dict.fromkeys(sids, 0)
    w = open_wal(path, cap, 1)
    list(w.open())
    rng = random.Random(5)
    acked, live = [], []
    while True:
        sid = rng.choice(sids)
        res = w.append(framed(sid, ends[sid], 1), sid)
        res.future.result(timeout=10)
        rec = (sid, ends[sid], 1)
        acked.append(rec)
        live.append((rec, res.offset, res.next_offset))
        ends[sid] += 1
        if res.next_offset - w.trim_offset > ring // 2:     # upload the older half, trim
            half = live[:len(live) // 2]
            commit_records(meta, store, [r for r, _, _ in half], 1)
            w.trim(half[-1][2])
            live = live[len(live) // 2:]
        if (res.next_offset > 3 * ring and w.trim_offset // ring != res.next_offset // ring
                and len(live) > 20):
            break
    trim = w.trim_offset
    res = take(path, meta, store)
    assert res.committed_records == len(live)
    assert trim // ring < (res.wal_end - 1) // ring, "the live records cross the ring's end"
    assert header_of(path).trim_offset == res.wal_end
    check_exactly_once(meta, store, acked)
    w.close()


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_taker_dies_at_crash_point_second_taker_completes(point, tmp_path, stores):
    meta, store, meta_url, store_url = stores
    path = str(tmp_path / "wal-1")
    acked = build_dead_wal(path, meta, store, node_id=1, records=120, uploaded=30)
    r = run_py("run_takeover.py", path, meta_url, store_url, "1", "0", "2", "1",
               env={"S3KAFKA_CRASH_POINT": point})
    assert r.returncode == 137, r.stderr
    # the same epoch for another taker is refused while the first one's takeover is recorded
    if point != "takeover_before_done":
        with pytest.raises(TakeoverError):
            take(path, meta, store, taker=3, taker_epoch=1)
    res = take(path, meta, store, taker=3, taker_epoch=2)
    committed_first = point in ("takeover_after_commit", "takeover_before_done")
    assert res.committed_records == (0 if committed_first else 90)
    assert res.skipped_records == (90 if committed_first else 0)
    assert check_exactly_once(meta, store, acked) == 120
    # the first taker, coming back, finds the takeover done and commits nothing
    again = take(path, meta, store, taker=2, taker_epoch=1)
    assert again.already_done and again.committed_records == 0
    assert check_exactly_once(meta, store, acked) == 120


def test_taker_sigkilled_at_random_points(tmp_path, stores):
    """The taker is SIGKILLed after a random delay (anywhere: before the fence, mid-upload,
    around the commit, after it); a second taker always completes with every record once."""
    meta, store, meta_url, store_url = stores
    rng = random.Random(17)
    outcomes = set()
    for i, delay in enumerate([0.0, 0.05, 0.15, rng.uniform(0, 0.4)]):
        path = str(tmp_path / f"wal-{i}")
        node = 10 + i
        acked = build_dead_wal(path, meta, store, node_id=node, records=400, uploaded=50,
                               seed=i, capacity=8 << 20)
        e = dict(os.environ, PYTHONPATH=REPO, TAKEOVER_SLOW="1")
        p = tied_popen([sys.executable, os.path.join(HERE, "run_takeover.py"), path,
                        meta_url, store_url, str(node), "0", "2", "1"], env=e,
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert p.stdout.readline() == b"READY\n"
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        out = p.communicate()[0]
        outcomes.add("done" if b"DONE" in out else "killed")
        take(path, meta, store, node_id=node, taker=3, taker_epoch=2)
        mine = {s for s, _, _ in acked}
        check_exactly_once(meta, store, acked)
        assert all(meta.stream(s).end_offset > 0 for s in mine)
    assert "killed" in outcomes


def test_writer_sigkilled_then_taken_over(tmp_path, stores):
    """AutoMQ #205 (a wrong trim offset after an OOM kill): an engine appending to several
    streams with frequent uploads and a 1 MiB WAL (many laps) is SIGKILLed at a random moment;
    the trim offset in its header never passed a record that was not committed, so the
    takeover finds every acknowledged record, across the wrap, exactly once."""
    meta, store, meta_url, store_url = stores
    rng = random.Random(23)
    e = dict(os.environ, PYTHONPATH=REPO)
    p = tied_popen([sys.executable, os.path.join(HERE, "engine_writer.py"),
                    str(tmp_path / "n1"), meta_url, store_url, str(1 << 20), "3", "1"],
                   env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    acked: list[tuple[int, int, int]] = []
    want = rng.randrange(1500, 4000)
    deadline = time.monotonic() + 60
    try:
        for line in p.stdout:
            parts = line.split()
            if parts[0] == b"A":
                acked.append(tuple(int(x) for x in parts[1:4]))
                if len(acked) >= want:
                    break
            assert time.monotonic() < deadline, "writer too slow"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert len(acked) >= want, p.stderr.read().decode()[-2000:]
    wal = str(tmp_path / "n1" / "wal")
    hdr = header_of(wal)
    assert hdr.trim_offset > hdr.capacity, "the WAL wrapped at least once"
    info = meta.wal(1)
    assert (info.path, info.node_epoch, info.capacity) == (wal, 3, 1 << 20)
    assert (info.device_id, info.inode) == (wal_identity(wal, 1, 3, 0).device_id,
                                            os.stat(wal).st_ino)
    res = take(wal, meta, store, node_epoch=3)
    assert meta.wal(1).state == WAL_TAKEN_OVER
    assert res.committed_records + res.skipped_records > 0
    check_exactly_once(meta, store, acked)


def test_registry_compare_and_set(metadata_url, tmp_path):
    """s3_wals on SQLite and PostgreSQL: an older epoch cannot overwrite a newer
    registration; one takeover at a time, a newer taker epoch wins, a replaced taker cannot
    commit; a new epoch of the owner makes the WAL active again."""
    meta = open_metastore(metadata_url)
    try:
        (tmp_path / "w").write_bytes(b"")
        info = wal_identity(str(tmp_path / "w"), 1, 4, 1 << 20)
        assert meta.register_wal(info)
        info.node_epoch = 3
        assert not meta.register_wal(info)
        assert meta.wal(1).node_epoch == 4 and meta.wal(2) is None
        assert not meta.begin_wal_takeover(1, 3, taker=2, taker_epoch=1)   # a newer owner
        assert meta.begin_wal_takeover(1, 4, taker=2, taker_epoch=1)
        assert not meta.begin_wal_takeover(1, 4, taker=3, taker_epoch=1)
        assert meta.begin_wal_takeover(1, 4, taker=3, taker_epoch=2)
        assert meta.wal(1).state == WAL_TAKING_OVER and meta.wal(1).taken_over_by == 3
        with pytest.raises(TakeoverConflict):
            meta.commit_takeover([], {}, 1, 2, 1)                        # replaced taker
        assert not meta.finish_wal_takeover(1, 2, 1)
        assert meta.finish_wal_takeover(1, 3, 2)
        assert meta.wal(1).state == WAL_TAKEN_OVER
        assert not meta.begin_wal_takeover(1, 4, taker=4, taker_epoch=9)
        info.node_epoch = 5
        assert meta.register_wal(info)
        assert (meta.wal(1).state, meta.wal(1).taken_over_by) == (WAL_ACTIVE, None)
        # ranges conditioned on the stream's committed end and owner
        sid = meta.create_stream()
        oid, _key = meta.prepare_object("sso", 2)
        from storage.metastore import NewObject
        from storage.objects.format import StreamRange
        with pytest.raises(TakeoverConflict, match="no longer ends at 5"):
            meta.commit_takeover([NewObject(oid, 10, [StreamRange(sid, 5, 9)])], {sid: None},
                                 99, 2, 1)
        assert meta.claim_stream(sid, 7, 3)
        with pytest.raises(TakeoverConflict, match="owned by"):
            meta.commit_takeover([NewObject(oid, 10, [StreamRange(sid, 0, 9)])], {sid: None},
                                 99, 2, 1)
        meta.commit_takeover([NewObject(oid, 10, [StreamRange(sid, 0, 9)])], {sid: (7, 3)},
                             99, 2, 1)
        assert meta.stream(sid).end_offset == 9
    finally:
        meta.close()


@pytest.fixture
def loop_device(tmp_path):
    with loopdev.loop_device(tmp_path / "loop.img", 8 << 20) as dev:
        yield dev


def test_takeover_of_a_loop_device_wal(loop_device, tmp_path, stores):
    """The dead node's WAL on a real block device: registered by its device number, taken
    over, fenced, and the zombie's reopen refused."""
    meta, store, *_ = stores
    acked = build_dead_wal(loop_device, meta, store, node_id=1, records=150, uploaded=60,
                           capacity=4 << 20)
    info = meta.wal(1)
    assert info.device_id == os.stat(loop_device).st_rdev
    res = take(loop_device, meta, store)
    assert res.committed_records == 90
    check_exactly_once(meta, store, acked)
    assert header_of(loop_device).takeover_state == TAKEOVER_DONE
    with pytest.raises(FencedError):
        open_wal(loop_device, 4 << 20, 1).open()


async def test_live_zombie_engine_stops_and_commits_nothing(tmp_path, stores):
    """A whole engine as the zombie: its WAL is taken over while it runs. Its uploads are
    refused by the metadata store from the moment the takeover began (so it never commits
    what the taker commits), within about a second its appends fail, and its close() leaves
    the fence in place."""
    import asyncio
    from storage.metastore import StreamFenced
    from storage.stream import StorageError
    meta, store, meta_url, store_url = stores
    eng = open_engine(node_config(tmp_path, meta_url, store_url, 1,
                                  upload_threshold_bytes=64 << 20, upload_interval_s=3600))
    await eng.start()
    try:
        s = await eng.create_stream()
        for base in range(50):
            await s.append(payload(s.stream_id, base), base, 1)
        res = await asyncio.to_thread(take, eng.config.wal_path, meta, store)
        assert res.committed_records == 50
        with pytest.raises(StreamFenced, match="taking_over|taken_over"):
            await s.append(payload(s.stream_id, 50), 50, 1)    # acked by the WAL, but...
            await eng.flush()                                   # ...its upload is refused
        for _ in range(60):
            if eng.wal_fenced:
                break
            await asyncio.sleep(0.05)
        assert eng.wal_fenced
        with pytest.raises(StorageError, match="taken over by node 2"):
            await s.append(payload(s.stream_id, 51), 51, 1)
    finally:
        await eng.close()
    assert header_of(eng.config.wal_path).takeover_state == TAKEOVER_DONE
    assert meta.stream(s.stream_id).end_offset == 50
    check_exactly_once(meta, store, [(s.stream_id, b, 1) for b in range(50)])
    # the zombie restarts: refused on its old epoch, then re-registers at a newer one and
    # formats afresh explicitly; it continues from what the taker committed
    again = open_engine(node_config(tmp_path, meta_url, store_url, 1,
                                    wal_reformat_taken_over=True))
    with pytest.raises(FencedError, match="re-register with an epoch above 0"):
        await again.start()
    await again.close()
    again = open_engine(node_config(tmp_path, meta_url, store_url, 1, node_epoch=1,
                                    wal_reformat_taken_over=True))
    await again.start()
    try:
        assert (meta.wal(1).state, meta.wal(1).node_epoch) == (WAL_ACTIVE, 1)
        s2 = await again.open_stream(s.stream_id)
        assert s2.end_offset == 50
        await s2.append(payload(s.stream_id, 50), 50, 1)
        await again.flush()
    finally:
        await again.close()
    check_exactly_once(meta, store, [(s.stream_id, b, 1) for b in range(51)])


def test_broker_on_a_taken_over_wal_refuses_to_start(tmp_path):
    """A broker restarted on its WAL after another node took it over: one line, exit 1."""
    data = tmp_path / "data"
    data.mkdir()
    meta = open_metastore(f"sqlite:///{data}/meta.db")
    store = open_object_store(f"file://{data}/objects")
    try:
        build_dead_wal(str(data / "wal"), meta, store, node_id=0, records=10, uploaded=0,
                       capacity=8 << 20)
        take(str(data / "wal"), meta, store, node_id=0)
    finally:
        meta.close()
    r = subprocess.run([sys.executable, "-m", "broker", "serve", "--listen",
                        f"127.0.0.1:{free_port()}", "--data-dir", str(data),
                        "--wal-capacity", str(8 << 20)], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO),
                       stdin=subprocess.DEVNULL)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert any("taken over by node 2 at epoch 1" in ln and "re-register" in ln for ln in lines), \
        r.stderr


def test_a_racing_owner_header_write_cannot_erase_the_fence(tmp_path, stores):
    """The owner wrote its header (trim) in the same instant the fence went in, unchecked:
    the fence is in both slots with a counter far above the owner's, so one owner write
    replaces at most one copy and the fence still wins."""
    meta, store, *_ = stores
    path = str(tmp_path / "wal-1")
    sid = meta.create_stream()
    w = open_wal(path, 4 << 20, 1)
    list(w.open())
    w.append(framed(sid, 0, 1), sid).future.result(timeout=10)
    take(path, meta, store)
    with w._header_lock:
        w._header.trim_offset = 1
        w._write_header(check=False)        # as if it had read the header just before
    hdr = header_of(path)
    assert hdr.takeover_state == TAKEOVER_DONE and hdr.taken_over_by == 2
    with pytest.raises(FencedError):       # and its next checked write stops it
        w.trim(w.end_offset)
    w.close()
    assert header_of(path).takeover_state == TAKEOVER_DONE


def test_locked_wal_is_refused_unless_forced(tmp_path, stores):
    """The owner process still holds the WAL's flock (alive on this host: paused): refused
    naming the holder; force_lock (its lease surely gone) proceeds on the fence alone."""
    import fcntl
    from storage.wal import WALLockedError
    meta, store, *_ = stores
    path = str(tmp_path / "wal-1")
    acked = build_dead_wal(path, meta, store, node_id=1, records=40, uploaded=10)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(WALLockedError, match=f"pid {os.getpid()}"):
            take(path, meta, store)
        assert header_of(path).takeover_state == TAKEOVER_NONE
        assert take(path, meta, store, force_lock=True).committed_records == 30
    finally:
        os.close(fd)
    check_exactly_once(meta, store, acked)


@pytest.fixture
def any_stores(metadata_url, tmp_path):
    meta = open_metastore(metadata_url)
    yield meta, open_object_store(f"file://{tmp_path}/objects"), metadata_url
    meta.close()


def test_takeover_and_second_taker_on_each_metadata_store(tmp_path, any_stores):
    """The whole takeover on SQLite and PostgreSQL: a taker dies after its commit, a second
    one completes without committing anything twice."""
    meta, store, meta_url = any_stores
    path = str(tmp_path / "wal-1")
    acked = build_dead_wal(path, meta, store, node_id=1, records=120, uploaded=20)
    r = run_py("run_takeover.py", path, meta_url, f"file://{tmp_path}/objects", "1", "0", "2",
               "1", env={"S3KAFKA_CRASH_POINT": "takeover_after_commit"})
    assert r.returncode == 137, r.stderr
    assert meta.wal(1).state == WAL_TAKING_OVER
    res = take(path, meta, store, taker=3, taker_epoch=2)
    assert (res.committed_records, res.skipped_records) == (0, 100)
    assert meta.wal(1).state == WAL_TAKEN_OVER and meta.wal(1).taken_over_by == 3
    assert check_exactly_once(meta, store, acked) == 120


async def test_a_gap_in_the_dead_wal_is_counted_and_logged(tmp_path, stores, caplog):
    """Issue 17: a takeover that finds a stream's WAL records starting past its committed
    end (records lost before the takeover) cannot recover them: it reports the stream in
    ``lost`` (ERROR logged) and the taker's engine counts it for alerting
    (s3kafka_takeover_lost_streams_total); the records after the gap are not committed."""
    meta, store, meta_url, store_url = stores
    dead = str(tmp_path / "wal-1")
    sid = meta.create_stream()
    w = open_wal(dead, 4 << 20, 1, 0)
    list(w.open())
    meta.register_wal(wal_identity(dead, 1, 0, 4 << 20))
    nexts = []
    for base in range(0, 20, 2):
        res = w.append(framed(sid, base, 2), sid)
        res.future.result(timeout=30)
        nexts.append(res.next_offset)
    w.trim(nexts[2])                     # offsets 0..6 trimmed but never committed
    w.stats["abandoned"] = 1
    eng = open_engine(node_config(tmp_path, meta_url, store_url, 2, node_epoch=1))
    await eng.start()
    try:
        res = await eng.take_over_wal(dead, node_id=1, node_epoch=0, taker_epoch=1)
        assert res.lost == {sid: "gap: committed end 0, WAL continues at 6"}
        assert eng.stats.takeover_lost_streams == 1
        assert meta.stream(sid).end_offset == 0
        assert any(r.levelname == "ERROR" and "WAL records continue at 6" in r.getMessage()
                   for r in caplog.records)
    finally:
        await eng.close()


async def test_a_fenced_node_commits_nothing_from_the_fence_on(tmp_path, stores):
    """Issue 17: the controller's fence marks the node's WAL registry row taken over in the
    same transaction, so the fenced node's uploads are refused from the fence on - not only
    once its taker begins the takeover (a zombie resumed in between committed and trimmed);
    the taker's begin still succeeds at the fence's takeover epoch."""
    from broker.cluster.store import ClusterStore
    from storage.metastore import StreamFenced
    meta, store, meta_url, store_url = stores
    eng = open_engine(node_config(tmp_path, meta_url, store_url, 1, node_epoch=0,
                                  upload_interval_s=3600, upload_threshold_bytes=64 << 20))
    await eng.start()
    cluster = ClusterStore(meta_url)
    try:
        for n in (0, 1):
            cluster.register(n, "127.0.0.1", 9000 + n, None, f"i{n}", 2000, f"h:{n}", 0)
        controller = cluster.elect(0, -1, 2000)
        assert controller[0] == 0
        s = await eng.create_stream()
        await s.append(payload(s.stream_id, 0), 0, 2)
        await eng.flush()
        assert s.committed == 2
        await s.append(payload(s.stream_id, 2), 2, 2)
        row = cluster.broker(1)
        fenced = cluster.fence(1, "i1", row.lease_until_ms, 0, controller)
        assert fenced is not None and fenced.state == "fenced"
        with pytest.raises(StreamFenced, match="may not commit"):
            await eng.flush()
        assert meta.stream(s.stream_id).end_offset == 2
        assert meta.wal(1).state == WAL_TAKING_OVER
        assert meta.begin_wal_takeover(1, 0, 0, fenced.takeover_epoch)
    finally:
        cluster.db.close()
        await eng.close()


async def test_committed_records_of_a_stream_now_owned_elsewhere_are_not_lost(tmp_path, stores,
                                                                             caplog):
    """Issue 17 (chaos, 30-minute run): a node released a partition (its records committed,
    the stream claimed by the new leader) and died before its WAL was trimmed past them. The
    takeover found those records, saw another owner and reported the stream LOST (ERROR,
    s3kafka_takeover_lost_streams_total) although every one of them was committed. Records at
    or below the committed end are skipped whoever owns the stream; only records past it
    under another owner are lost."""
    meta, store, meta_url, store_url = stores
    dead = str(tmp_path / "wal-1")
    moved, gone = meta.create_stream(), meta.create_stream()
    w = open_wal(dead, 4 << 20, 1, 0)
    list(w.open())
    meta.register_wal(wal_identity(dead, 1, 0, 4 << 20))
    for base in range(0, 20, 2):
        for sid in (moved, gone):
            w.append(framed(sid, base, 2), sid).future.result(timeout=30)
    w.stats["abandoned"] = 1
    commit_records(meta, store, [(moved, b, 2) for b in range(0, 20, 2)], node_id=1)
    commit_records(meta, store, [(gone, b, 2) for b in range(0, 10, 2)], node_id=1)
    assert meta.claim_stream(moved, 3, 5) and meta.claim_stream(gone, 3, 5)
    eng = open_engine(node_config(tmp_path, meta_url, store_url, 2, node_epoch=1))
    await eng.start()
    try:
        res = await eng.take_over_wal(dead, node_id=1, node_epoch=0, taker_epoch=1)
        assert res.lost == {gone: "stream owned by node 3 at epoch 5"}, res.lost
        assert res.skipped_records == 10 + 5 and res.committed_records == 0
        assert eng.stats.takeover_lost_streams == 1
        assert meta.stream(moved).end_offset == 20 and meta.stream(gone).end_offset == 10
        assert not any(f"stream {moved} is owned" in r.getMessage() for r in caplog.records)
    finally:
        await eng.close()
