"""Streamed object puts: a file:// put of a StreamEncoder encodes the object a window at a time
into a few-MiB ring and writes each window as it is ready. The file must be byte for byte what
the whole-object encoder makes of the same records, decode to those records, and a put that
fails must leave nothing behind (real files, the C encoder)."""
from __future__ import annotations

import os
import random

import pytest

from storage.objects import format as fmt
from storage.objects import store as store_mod
from storage.objects.format import Record, decode_object, encode_object
from storage.objects.store import FileObjectStore, ObjectStoreError

from storage_helpers import fill, read_all, small_config

pytestmark = pytest.mark.skipif(not fmt.STREAM_ENCODE,
                                reason="the C encoder (with fit) is not built")
MIB = 1 << 20
RING = store_mod.PUT_RING_BYTES


def _records(streams: int, per_stream: int, sizes: list[int], seed: int = 1) -> list[Record]:
    rnd = random.Random(seed)
    out = []
    for sid in range(1, streams + 1):
        off = 10 * sid
        for _ in range(per_stream):
            out.append(Record(sid, off, 3, rnd.randbytes(rnd.choice(sizes))))
            off += 3
    return out


CASES = {
    "small records": lambda: _records(1, 6000, [10, 100, 1000]),
    "many streams": lambda: _records(60, 150, [50, 5000]),
    "1 MiB records": lambda: _records(1, 30, [MIB]),
    "a record larger than the ring": lambda: _records(1, 3, [100, RING + MIB]),
    "blocks of records just under the ring": lambda: _records(2, 3, [RING - 200]),
    "empty": lambda: [],
    "one empty payload": lambda: [Record(5, 0, 1, b"")],
}


def _as_tuples(records) -> list[tuple]:
    return [(r.stream_id, r.base_offset, r.count, bytes(r.payload)) for r in records]


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("block_size", [512 << 10, 64 << 10])
@pytest.mark.parametrize("case", list(CASES))
def test_a_streamed_object_is_the_whole_encoders_bytes(tmp_path, case, block_size,
                                                      direct) -> None:
    recs = CASES[case]()
    ref, index, ranges = encode_object(recs, block_size)
    st = FileObjectStore(str(tmp_path), direct_writes=direct)
    enc = fmt.StreamEncoder(recs, block_size)
    assert len(enc) == len(ref)
    st.put("obj", enc)
    assert enc.done
    with open(tmp_path / "obj", "rb") as f:
        got = f.read()
    assert got == bytes(ref)
    assert enc.index == index
    assert [vars(r) for r in enc.ranges] == [vars(r) for r in ranges]
    assert _as_tuples(decode_object(got)) == _as_tuples(recs)
    assert st.list() == ["obj"]


def test_windows_hold_whole_blocks_and_write_whole_4k_units(tmp_path, monkeypatch) -> None:
    """Each window is written up to its last whole 4 KiB (O_DIRECT pieces), the rest carried
    over; the ring is PUT_RING_BYTES and is kept for the next put, so a put needs a few MiB,
    not the object's size."""
    recs = _records(1, 30, [MIB])                 # ~30 MiB object
    st = FileObjectStore(str(tmp_path), direct_writes=True)
    windows: list[int] = []
    real = st._write_window

    def window(fd, view, chunk):
        windows.append(len(view))
        return real(fd, view, chunk)
    monkeypatch.setattr(st, "_write_window", window)
    direct: list[int] = []
    real_direct = store_mod._write_direct

    def write_direct(fd, view, chunk):
        direct.append(real_direct(fd, view, chunk))
        return direct[-1]
    monkeypatch.setattr(store_mod, "_write_direct", write_direct)
    st.put("obj", fmt.StreamEncoder(recs))
    assert len(windows) >= 30 * MIB // RING
    if store_mod._O_DIRECT and direct[0]:         # (a file system that takes O_DIRECT)
        assert direct[:-1] == windows[:-1]        # every whole window went O_DIRECT
    assert all(n % store_mod.DIRECT_ALIGN == 0 for n in windows[:-1])
    assert max(windows) <= store_mod.PUT_RING_BYTES
    assert sum(windows) == os.path.getsize(tmp_path / "obj")
    assert [len(r) for r in st._rings] == [store_mod.PUT_RING_BYTES]
    st.put("obj2", fmt.StreamEncoder(_records(1, 2, [RING + MIB])))   # grows for itself only
    assert [len(r) for r in st._rings] == [store_mod.PUT_RING_BYTES]


def test_a_put_whose_source_fails_leaves_nothing(tmp_path) -> None:
    """Unsorted records: the encoder raises mid-object (after windows were written); no
    object and no temp file remain, and the ring goes back for the next put."""
    recs = _records(1, RING // MIB + 4, [MIB]) + [Record(0, 0, 1, b"x")]
    st = FileObjectStore(str(tmp_path), direct_writes=True)
    with pytest.raises(ValueError):
        st.put("obj", fmt.StreamEncoder(recs, size=fmt.object_size(recs, 512 << 10)))
    assert os.listdir(tmp_path) == []
    assert len(st._rings) == 1


def test_a_put_that_fails_writing_leaves_nothing(tmp_path, monkeypatch) -> None:
    st = FileObjectStore(str(tmp_path), direct_writes=True)
    calls = []

    def failing(fd, view, chunk):
        calls.append(len(view))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return store_mod.FileObjectStore._write_window(st, fd, view, chunk)
    monkeypatch.setattr(st, "_write_window", failing)
    with pytest.raises(ObjectStoreError):
        st.put("obj", fmt.StreamEncoder(_records(1, RING // MIB + 4, [MIB])))
    assert os.listdir(tmp_path) == []


def test_encode_blocks_fit_stops_before_a_block_that_does_not_fit() -> None:
    """The C encoder's ``fit``: the blocks that fit are written, the one that does not is
    left (no ValueError); ``base`` shifts the index's block positions."""
    from storage import copycrc
    recs = _records(1, 4, [1000])
    out = bytearray(2 * (14 + 33 + 1000) + 10)
    nxt, at, entries = copycrc.encode_blocks(out, 0, recs, 0, 1000, 0, False, True, 5000)
    assert (nxt, at) == (2, 2 * (14 + 33 + 1000))
    assert [e[4] for e in entries] == [5000, 5000 + 14 + 33 + 1000]
    assert copycrc.encode_blocks(out, at, recs, nxt, 1000, 0, False, True, 0)[:2] == (2, at)
    with pytest.raises(ValueError):
        copycrc.encode_blocks(out, at, recs, nxt, 1000, 0, False)


async def test_the_engine_streams_its_puts_to_a_file_store(tmp_path, monkeypatch) -> None:
    """Through a real engine and file:// store: the puts get StreamEncoders, no whole-object
    encode buffer is made, each object file is what encode_object makes of its records, and
    every record reads back from the objects."""
    import storage.engine as engine_mod
    from storage.engine import open_engine
    monkeypatch.setattr(engine_mod, "OBJECT_SPLIT_BYTES", 2 * MIB)      # several objects
    eng = open_engine(small_config(tmp_path, wal_capacity=64 << 20, log_cache_bytes=32 << 20,
                                   upload_threshold_bytes=64 << 20, upload_interval_s=3600,
                                   object_block_bytes=64 << 10))
    await eng.start()
    puts: list[tuple[str, object, bytes]] = []
    real_put = eng.store.put

    def put(key, data):      # (the whole encoder's bytes while the cache entries are live)
        puts.append((key, data, bytes(encode_object(data._records, 64 << 10)[0])))
        real_put(key, data)
    eng.store.put = put
    try:
        big = await eng.create_stream()
        small = await eng.create_stream()
        await fill(big, 12, count=1, size=MIB - 100)
        await fill(small, 3000, count=2, size=700)
        await eng.flush()
        assert len(puts) >= 6 and all(isinstance(d, fmt.StreamEncoder) for _, d, _ in puts)
        assert eng._encode_bufs == []
        root = eng.store.inner.root
        for key, _, whole in puts:
            with open(os.path.join(root, key), "rb") as f:
                assert f.read() == whole
        eng.drop_caches()
        assert len(await read_all(big, max_bytes=2 * MIB)) == 12
        assert len(await read_all(small)) == 3000
    finally:
        await eng.close()
