"""Gather puts (storage/objects/format.py GatherSource, storage._copycrc gather_write): an
object's large payloads whose CRC the WAL checked at their append are written straight from
their memory (arena frames: io_uring WRITE_FIXED) instead of being copied into an encode buffer,
each in a block of its own placed so that the payload keeps its offset within a 4 KiB page, its
block CRC carried from the check. The files must read back through every reader (the whole-object
decode, the cold path's ranged block reads, an engine's cold read), the carried CRC must be the
one readers verify, and a failed write must leave nothing behind (real files, O_DIRECT)."""
from __future__ import annotations

import errno
import mmap
import os
import random

import pytest

from storage import _copycrc as C
from storage.cache.log_cache import CacheEntry
from storage.copycrc import crc
from storage.engine import open_engine
from storage.objects import format as fmt
from storage.objects import store as store_mod
from storage.objects.format import (BLOCK_HEADER, FOOTER, RECORD_HEADER, CorruptObjectError,
                                    GatherSource, decode_block, decode_footer, decode_index,
                                    decode_object, gather_source)
from storage.objects.store import FileObjectStore, ObjectStoreError

from storage_helpers import small_config

pytestmark = pytest.mark.skipif(not fmt.GATHER, reason="storage._copycrc without gather_write")
MIB = 1 << 20
HEADERS = BLOCK_HEADER.size + RECORD_HEADER.size      # before a gathered payload in its block
CRC_START = 21                                        # a Kafka batch's CRC covers bytes 21..


def _arena():
    """Frames cut from a 4 KiB-page arena slab, registered with every io_uring (as the
    broker's request frames)."""
    if getattr(C, "frame_arena", None) is None:
        pytest.skip("storage._copycrc without frame_arena")
    arena = C.frame_arena(16 << 20, 16 << 20, False)
    assert arena.grow(True)
    return arena


def _entry(sid: int, base: int, payload, checked: bool = True, wrong: bool = False) -> CacheEntry:
    """A LogCache entry as an append leaves it: ``check`` the CRC of payload[21:]."""
    check = None
    if checked:
        check = (CRC_START, crc(memoryview(payload)[CRC_START:]) ^ (1 if wrong else 0))
    return CacheEntry(sid, base, 4, payload, check=check)


def _records(arena, rng: random.Random) -> list[CacheEntry]:
    """Two streams mixing gathered payloads (large, checked; in arena frames and in plain
    memory, at every offset in a page) with staged ones (small, or large without a check)."""
    plain = mmap.mmap(-1, 16 << 20)
    at = 0
    out = []
    for sid in (3, 7):
        base = 0
        for size, checked, where in ((MIB + 70, True, "arena"), (200, True, "plain"),
                                     (300_000, True, "plain"), (5000, False, "plain"),
                                     (MIB, False, "plain"), (70_000, True, "arena"),
                                     (2 * MIB + 5, True, "arena"), (90, True, "plain")):
            if where == "arena":
                frame = arena.take(size + 8192)
                off = rng.randrange(0, 4096)
                view = memoryview(frame)[off:off + size]
            else:
                at += rng.randrange(0, 4096)
                view = memoryview(plain)[at:at + size]
                at += size
            view[:] = rng.randbytes(size)
            out.append(_entry(sid, base, view, checked))
            base += 4
    return out


def _as_tuples(records) -> list[tuple]:
    return [(r.stream_id, r.base_offset, r.count, bytes(r.payload)) for r in records]


def _put(tmp_path, records, key: str = "o") -> tuple[FileObjectStore, bytes, GatherSource]:
    store = FileObjectStore(str(tmp_path / "objects"), direct_writes=True)
    assert store.gathers_puts
    source = gather_source(records, 128 << 10)
    assert source is not None
    store.put(key, source)
    with open(os.path.join(store.root, key), "rb") as f:
        data = f.read()
    return store, data, source


def test_a_gather_put_reads_back_through_every_reader(tmp_path) -> None:
    """The file is the layout's size; the whole-object decode and the cold path's ranged block
    reads (CRCs from the read itself) give back every record; each gathered payload sits at its
    memory's offset within a page, in a block of its own; the others are staged (copied)."""
    arena = _arena()
    recs = _records(arena, random.Random(40))
    store, data, source = _put(tmp_path, recs)
    assert len(data) == len(source) == store.size("o")
    # gathered: checked payloads of at least GATHER_FROM (64 KiB): 4 per stream
    assert source.gathered == 8
    assert _as_tuples(decode_object(data)) == _as_tuples(recs)
    pos, length, icrc = decode_footer(data[-FOOTER.size:], len(data))
    index = decode_index(data[pos:pos + length], icrc)
    assert [(e.stream_id, e.start_offset, e.end_offset, e.record_count) for e in index] == \
        [(e.stream_id, e.start_offset, e.end_offset, e.record_count) for e in source.index]
    parts, crcs = store.get_ranges_crc("o", [(e.position, e.size) for e in index],
                                       BLOCK_HEADER.size)
    assert any(c is not None for c in crcs)          # checked from the read itself
    got = []
    for part, body_crc in zip(parts, crcs):
        got.extend(decode_block(part, body_crc))
    assert _as_tuples(got) == _as_tuples(recs)
    by_key = {(e.stream_id, e.start_offset): e for e in index}
    for r in recs:
        e = by_key.get((r.stream_id, r.base_offset))
        if r.check is not None and len(r.payload) >= fmt.GATHER_FROM:
            assert e is not None and e.record_count == 1
            assert (e.position + HEADERS) % 4096 == C.buffer_address(r.payload) % 4096
    # a gap before some gathered block: blocks are not all back to back
    spans = sorted((e.position, e.position + e.size) for e in index)
    assert any(b[0] > a[1] for a, b in zip(spans, spans[1:]))


def test_the_pages_of_arena_frames_go_as_fixed_writes_and_pwrite_gives_the_same_bytes(tmp_path):
    """Through an io_uring, the gathered payloads' whole pages in registered arena slabs are
    WRITE_FIXED (no page pinned per write), the rest plain writes; without a ring (pwrite) the
    file is byte for byte the same."""
    arena = _arena()
    recs = _records(arena, random.Random(41))
    source = gather_source(recs, 128 << 10)
    staging = mmap.mmap(-1, store_mod.PUT_RING_BYTES)
    files = []
    for i, ring in enumerate((C.uring_setup(8, -1), None)):
        path = str(tmp_path / f"f{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            whole = (len(source) + 4095) & -4096
            written, fixed = source.write(ring, fd, staging, MIB, whole)
            os.ftruncate(fd, len(source))
        finally:
            os.close(fd)
        assert written == whole
        # the three arena records per stream have whole pages; 1 MiB + 70 and 70,000 B are one
        # piece each, 2 MiB + 5 two (1 MiB pieces): at least 8 fixed pieces through the ring
        assert (fixed >= 8) if ring is not None else (fixed == 0)
        with open(path, "rb") as f:
            files.append(f.read())
    assert files[0] == files[1]
    assert _as_tuples(decode_object(files[0])) == _as_tuples(recs)


def test_the_block_crc_is_the_carried_one(tmp_path) -> None:
    """The block CRC of a gathered payload is built from its check, not from its bytes: a check
    that does not match them makes that block (and only it) fail its CRC in every reader, as
    the payload's own corruption would."""
    rng = random.Random(42)
    plain = mmap.mmap(-1, 4 * MIB)
    good = memoryview(plain)[100:100 + MIB]
    bad = memoryview(plain)[2 * MIB + 300:2 * MIB + 300 + MIB]
    good[:] = rng.randbytes(MIB)
    bad[:] = rng.randbytes(MIB)
    recs = [_entry(1, 0, good), _entry(1, 4, bad, wrong=True)]
    store, data, source = _put(tmp_path, recs)
    assert source.gathered == 2
    with pytest.raises(CorruptObjectError, match="block checksum"):
        list(decode_object(data))
    pos, length, icrc = decode_footer(data[-FOOTER.size:], len(data))
    first, second = sorted(decode_index(data[pos:pos + length], icrc), key=lambda e: e.position)
    assert _as_tuples(decode_block(data[first.position:first.position + first.size])) == \
        _as_tuples(recs[:1])
    with pytest.raises(CorruptObjectError, match="block checksum"):
        decode_block(data[second.position:second.position + second.size])


def test_nothing_gathered_or_too_much_staged_is_left_to_the_encoder() -> None:
    """No record large enough with a check: None (the engine encodes it as before); so too when
    the staged blocks between two gathered payloads outgrow the staging buffer."""
    rng = random.Random(43)
    big = [_entry(1, 4 * i, rng.randbytes(MIB), checked=False) for i in range(3)]
    small = [_entry(1, 4 * i, rng.randbytes(1000)) for i in range(50)]
    assert gather_source(big) is None and gather_source(small) is None
    mixed = small + [_entry(1, 200, rng.randbytes(MIB))]
    assert gather_source(mixed) is not None
    assert gather_source(mixed, max_staging=16 << 10) is None


def test_a_failed_write_raises_and_the_put_leaves_nothing(tmp_path) -> None:
    """A write the device refuses raises OSError from gather_write (through a ring and through
    pwrite), and a put that fails leaves no object and no temp file; the store goes on."""
    rng = random.Random(44)
    recs = [_entry(1, 0, rng.randbytes(MIB + 1)), _entry(1, 4, rng.randbytes(3000))]
    source = gather_source(recs, 128 << 10)
    staging = mmap.mmap(-1, store_mod.PUT_RING_BYTES)
    path = str(tmp_path / "ro")
    open(path, "wb").close()
    fd = os.open(path, os.O_RDONLY)
    try:
        for ring in (C.uring_setup(8, -1), None):
            with pytest.raises(OSError) as exc:
                source.write(ring, fd, staging, MIB, 0)
            assert exc.value.errno == errno.EBADF
    finally:
        os.close(fd)
    store = FileObjectStore(str(tmp_path / "objects"), direct_writes=True)

    def refuse(*_a):
        raise OSError(errno.ENOSPC, "No space left on device")

    broken = gather_source(recs, 128 << 10)
    broken.write = refuse
    with pytest.raises(ObjectStoreError, match="No space"):
        store.put("x", broken)
    assert os.listdir(store.root) == []
    store.put("x", gather_source(recs, 128 << 10))
    assert _as_tuples(decode_object(store.get("x"))) == _as_tuples(recs)


async def test_an_engine_uploads_checked_large_appends_by_gather_and_reads_them_cold(
        tmp_path) -> None:
    """Through the engine: appends with a check (as the broker's large lone batches) are
    uploaded as gather puts, unchecked ones as encoded objects; with the caches dropped, cold
    reads return every payload."""
    eng = open_engine(small_config(tmp_path, object_direct_writes=True))
    await eng.start()
    kinds = []
    inner = eng.store.inner
    put = inner.put

    def spy(key, data):
        kinds.append(type(data).__name__)
        return put(key, data)

    inner.put = spy
    try:
        rng = random.Random(45)
        s1, s2 = await eng.create_stream(), await eng.create_stream()
        want = {s1.stream_id: [], s2.stream_id: []}
        for i in range(6):
            for s, checked in ((s1, True), (s2, False)):
                p = bytearray(rng.randbytes(300_000 + i))
                check = (CRC_START, crc(memoryview(p)[CRC_START:])) if checked else None
                await s.append(p, s.end_offset, 2, check)
                want[s.stream_id].append(bytes(p))
        await eng.flush()
        assert "GatherSource" in kinds and "StreamEncoder" in kinds
        eng.drop_caches()
        assert eng.cache.first_offset(s1.stream_id) is None
        for s in (s1, s2):
            got, off = [], 0
            while off < s.end_offset:
                batches = await s.read(off, 4 * MIB)
                assert batches
                got.extend(bytes(b.payload) for b in batches)
                off = batches[-1].next_offset
            assert got == want[s.stream_id]
    finally:
        await eng.close()


def test_a_gather_put_over_a_recycled_file_cuts_its_longer_tail(tmp_path, monkeypatch) -> None:
    """A gather put that takes a deleted object's larger file from the recycle pool (its blocks
    written: nothing fallocated) overwrites it and ends at its own size; it reads back whole."""
    monkeypatch.setattr(store_mod, "RECYCLE_QUARANTINE_S", 0.0)
    rng = random.Random(46)
    store = FileObjectStore(str(tmp_path / "objects"), direct_writes=True)
    store.put("old", rng.randbytes(6 * MIB))
    store.delete(["old"])
    assert store._pool and store._pool[0].size == 6 * MIB
    recs = [_entry(1, 4 * i, rng.randbytes(MIB + 333)) for i in range(4)]
    source = gather_source(recs, 128 << 10)
    store.put("new", source)
    assert not store._pool                       # the pooled file was taken
    assert store.size("new") == len(source) < 6 * MIB
    assert _as_tuples(decode_object(store.get("new"))) == _as_tuples(recs)


def test_a_window_of_gathered_blocks_is_one_read(tmp_path, monkeypatch) -> None:
    """The cold path reads a window of neighbouring blocks (up to FILE_READ_SPAN of blocks, as
    the BlockCache sizes its windows) in one read, the gaps of a gather put included: counted
    in file bytes, eight 1 MiB blocks and their gaps went over 8 MiB and took two reads."""
    rng = random.Random(47)
    plain = mmap.mmap(-1, 16 * MIB)
    recs, at = [], 0
    for i in range(8):
        at += 3000                                   # a gap of ~3 KiB before each block
        view = memoryview(plain)[at:at + MIB - 200]
        view[:] = rng.randbytes(len(view))
        at += len(view)
        recs.append(_entry(1, 4 * i, view))
    store, data, source = _put(tmp_path, recs)
    blocks = sorted((e.position, e.size) for e in source.index)
    assert sum(n for _, n in blocks) <= store_mod.FILE_READ_SPAN
    assert blocks[-1][0] + blocks[-1][1] - blocks[0][0] > store_mod.FILE_READ_SPAN
    reads = []
    read_block = store._read_block

    def counted(fd, pos, n, ranges, skip):
        reads.append((pos, n))
        return read_block(fd, pos, n, ranges, skip)

    monkeypatch.setattr(store, "_read_block", counted)
    parts, crcs = store.get_ranges_crc("o", blocks, BLOCK_HEADER.size)
    assert len(reads) == 1
    got = [r for part, c in zip(parts, crcs) for r in decode_block(part, c)]
    assert _as_tuples(got) == _as_tuples(recs)
