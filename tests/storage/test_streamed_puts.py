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


def _window_lengths(st: FileObjectStore, monkeypatch) -> list[int]:
    """The lengths of the windows the store writes itself (``_write_window``), as they come."""
    windows: list[int] = []
    real = st._write_window

    def window(fd, view, chunk):
        windows.append(len(view))
        return real(fd, view, chunk)
    monkeypatch.setattr(st, "_write_window", window)
    return windows


def test_windows_hold_whole_blocks_and_write_whole_4k_units(tmp_path, monkeypatch) -> None:
    """Each window is written up to its last whole 4 KiB (O_DIRECT pieces), the rest carried
    over; the ring is PUT_RING_BYTES and is kept for the next put, so a put needs a few MiB,
    not the object's size. (The store writing the windows: a source that does not.)"""
    monkeypatch.setattr(fmt.StreamEncoder, "writes_windows", False)
    recs = _records(1, 30, [MIB])                 # ~30 MiB object
    st = FileObjectStore(str(tmp_path), direct_writes=True)
    windows = _window_lengths(st, monkeypatch)
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
    monkeypatch.setattr(fmt.StreamEncoder, "writes_windows", False)   # the store writes
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


needs_write = pytest.mark.skipif(not fmt.STREAM_WRITE or not store_mod._O_DIRECT,
                                 reason="encode_write not built, or no O_DIRECT")


@needs_write
def test_the_encoder_writes_every_window_but_the_last_itself(tmp_path, monkeypatch) -> None:
    """With direct writes the StreamEncoder writes each full window in the C call that
    encodes it (encode_write: one take of the interpreter lock per window): the store's own
    window writes are the last window only, the file is still encode_object's bytes."""
    recs = _records(3, 12, [MIB, 700 << 10, 5000])
    st = FileObjectStore(str(tmp_path), direct_writes=True)
    windows = _window_lengths(st, monkeypatch)
    enc = fmt.StreamEncoder(recs)
    fills: list[tuple[int, int]] = []
    real_fill = enc.fill_writing

    def fill_writing(out, at, fd, chunk, align):
        fills.append(real_fill(out, at, fd, chunk, align))
        return fills[-1]
    enc.fill_writing = fill_writing
    st.put("obj", enc)
    ref, index, _ = encode_object(recs)
    assert (tmp_path / "obj").read_bytes() == bytes(ref)
    assert enc.index == index
    wrote = sum(w for _, w in fills)
    assert len(windows) == 1 and wrote + windows[0] == len(ref)
    assert wrote >= len(ref) - RING and wrote % store_mod.DIRECT_ALIGN == 0
    assert len(fills) == 1                        # no Python between the windows


@needs_write
def test_a_window_the_source_leaves_unwritten_is_written_by_the_store(tmp_path) -> None:
    """A source whose window write came back short (O_DIRECT refused) returns the window
    unwritten: the store writes it and produces the rest through fill(); the file is still
    encode_object's bytes."""
    recs = _records(1, 30, [MIB])
    st = FileObjectStore(str(tmp_path), direct_writes=True)
    enc = fmt.StreamEncoder(recs)
    calls: list[int] = []

    def refused(out, at, fd, chunk, align):
        calls.append(at)
        return enc.fill(out, at), 0               # as if its first write were refused
    enc.fill_writing = refused
    st.put("obj", enc)
    assert (tmp_path / "obj").read_bytes() == bytes(encode_object(recs)[0])
    assert calls == [0]


def _aligned_buffer(n: int) -> memoryview:
    import mmap
    return memoryview(mmap.mmap(-1, n))


@pytest.mark.parametrize("direct", [True, False])
def test_encode_write_writes_whole_units_of_full_windows_and_carries_the_rest(
        tmp_path, direct) -> None:
    """encode_write with a small window and many streams (blocks that do not fit are gathered
    again after the window is written): the file plus the unwritten rest plus the index and
    footer are encode_object's bytes; the index's positions are the object's; a block larger
    than the window stops it once the window before it is written, nothing of it begun."""
    from storage import copycrc
    block = 16 << 10
    recs = _records(7, 40, [10, 900, 3000, 9000])
    ref, index, _ = encode_object(recs, block)
    out = _aligned_buffer(64 << 10)
    flags = os.O_WRONLY | os.O_CREAT | (store_mod._O_DIRECT if direct else 0)
    fd = os.open(tmp_path / "f", flags, 0o644)
    try:
        nxt, at, entries, written = copycrc.encode_write(out, 0, recs, 0, block, 0, fd,
                                                         8 << 10, 4096)
    finally:
        os.close(fd)
    assert nxt == len(recs) and written % 4096 == 0 and written > 3 * len(out) // 2
    data = (tmp_path / "f").read_bytes() + bytes(out[:at])
    tail = fmt._index_tail([fmt.IndexEntry(*e) for e in entries], len(data))
    assert data + tail == bytes(ref)
    assert [fmt.IndexEntry(*e) for e in entries] == index
    big = [Record(1, 0, 1, b"x" * block), Record(1, 1, 1, b"y" * (80 << 10))]
    fd = os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        nxt, at, entries, written = copycrc.encode_write(out, 0, big, 0, block, 0, fd,
                                                         8 << 10, 4096)
    finally:
        os.close(fd)
    first = 14 + 33 + block           # its window written, the larger block's not begun
    assert (nxt, at, written, len(entries)) == (1, first % 4096, first - first % 4096, 1)


@needs_write
def test_a_put_whose_window_write_fails_in_c_leaves_nothing(tmp_path) -> None:
    """A write error inside encode_write (the file size limit: EFBIG) fails the put as an
    ObjectStoreError with no temp file left, and the ring goes back."""
    import resource
    import signal
    st = FileObjectStore(str(tmp_path), direct_writes=True)
    old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 * MIB, old[1]))
    try:
        with pytest.raises(ObjectStoreError):
            st.put("obj", fmt.StreamEncoder(_records(1, 30, [MIB])))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_sig)
    assert os.listdir(tmp_path) == []
    assert len(st._rings) == 1


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


@pytest.mark.skipif(not fmt.STREAM_WRITE, reason="encode_write not built")
def test_encode_write_refuses_a_position_past_the_end_of_its_buffer(tmp_path) -> None:
    """``at`` beyond ``out`` is a ValueError (the window write would read past the buffer), and
    so are pieces that are not whole ``align`` units (each O_DIRECT write would be refused)."""
    from storage import copycrc
    out = bytearray(8192)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(ValueError):
            copycrc.encode_write(out, 20000, [Record(1, 0, 1, b"x" * 100)], 0, 4096, 0, fd,
                                 1 << 20, 4096)
        with pytest.raises(ValueError):     # pieces that are not whole units: refused
            copycrc.encode_write(out, 0, [Record(1, 0, 1, b"x" * 100)], 0, 4096, 0, fd,
                                 (1 << 20) + 512, 4096)
    finally:
        os.close(fd)
    assert os.path.getsize(tmp_path / "f") == 0
