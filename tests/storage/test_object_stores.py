"""The three object stores behave the same: put, ranged get, list, delete, multipart."""
from __future__ import annotations

import errno
import os
import time

import boto3
import pytest

from storage.objects.s3 import MULTIPART_THRESHOLD
from storage.copycrc import read_pieces
from storage.objects.store import ObjectNotFound, open_object_store


def _bucket(s3_endpoint, name: str) -> str:
    boto3.client("s3", endpoint_url=s3_endpoint.url, region_name="us-east-1",
                 aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=name)
    return (f"s3://{name}/pre/fix?endpoint_url={s3_endpoint.url}&region=us-east-1"
            "&access_key_id=testing&secret_access_key=testing")


@pytest.fixture(params=["file", "mem", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        url = f"file://{tmp_path}/objs"
    elif request.param == "mem":
        url = f"mem://{tmp_path.name}"
    else:
        url = _bucket(request.getfixturevalue("s3_endpoint"), f"b-{os.getpid()}-{time.time_ns()}")
    s = open_object_store(url)
    yield s
    s.close()


def test_put_get_list_delete(store) -> None:
    store.put("a/1", b"hello world")
    store.put("a/2", memoryview(b"xyz"))
    store.put("b/1", b"")
    assert store.get("a/1") == b"hello world"
    assert store.get("a/1", 6, 11) == b"world"
    assert store.get("a/1", 6) == b"world"
    assert store.size("a/1") == 11
    assert store.list("a/") == ["a/1", "a/2"]
    assert store.list() == ["a/1", "a/2", "b/1"]
    store.delete(["a/1", "nope"])
    assert store.list("a/") == ["a/2"]
    with pytest.raises(ObjectNotFound):
        store.get("a/1")


def test_large_object_multipart(store) -> None:
    data = os.urandom(1 << 20) * (MULTIPART_THRESHOLD // (1 << 20) + 2)
    store.put("big", data)
    assert store.size("big") == len(data)
    assert store.get("big", len(data) - 100, len(data)) == data[-100:]
    assert store.get("big", 17 << 20, (17 << 20) + 10) == data[17 << 20:(17 << 20) + 10]


def test_file_store_publishes_atomically(tmp_path) -> None:
    s = open_object_store(f"file://{tmp_path}/o")
    s.put("k", b"1" * 1000)
    s.put("k", b"2" * 10)
    assert s.get("k") == b"2" * 10
    assert not [p for p in os.listdir(tmp_path / "o") if ".tmp-" in p]


def test_file_store_writes_in_durable_pieces_and_syncs_the_rename(tmp_path, monkeypatch) -> None:
    """A large object is written FILE_WRITE_CHUNK at a time, each piece made durable before
    the next (so the device never holds a whole object's write-back in front of the WAL's
    writes), and the directory is synced after the rename (a durable publish)."""
    from storage.objects import store as store_mod
    calls: list[tuple[str, int]] = []
    real_write, real_fdatasync, real_fsync = os.write, os.fdatasync, os.fsync

    def write(fd, data):
        n = real_write(fd, data)
        calls.append(("write", n))
        return n

    def fdatasync(fd):
        calls.append(("fdatasync", 0))
        real_fdatasync(fd)

    def fsync(fd):
        calls.append(("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync", 0))
        real_fsync(fd)

    monkeypatch.setattr(store_mod.os, "write", write)
    monkeypatch.setattr(store_mod.os, "fdatasync", fdatasync)
    monkeypatch.setattr(store_mod.os, "fsync", fsync)
    s = open_object_store(f"file://{tmp_path}/o")
    chunk = store_mod.FILE_WRITE_CHUNK
    data = os.urandom(2 * chunk + 12345)
    s.put("d/big", data)
    assert s.get("d/big") == data
    kinds = [k for k, _ in calls]
    assert kinds == ["write", "fdatasync"] * 3 + ["fsync-dir"]
    assert [n for k, n in calls if k == "write"] == [chunk, chunk, 12345]


@pytest.mark.parametrize("native", [False, True])
def test_file_store_writes_page_aligned_objects_direct(tmp_path, monkeypatch, native) -> None:
    """A page-aligned buffer (the engine encodes into an mmap) bypasses the page cache: its
    whole 4 KiB units go out with O_DIRECT a piece at a time (natively: in one
    ``_copycrc.write_pieces`` call, the interpreter lock released once), the short tail through
    the page cache, one fdatasync covers both; the object reads back intact."""
    import fcntl
    import mmap

    from storage.objects import store as store_mod
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        pytest.skip("no O_DIRECT on this file system")
    calls: list[tuple[str, int, bool]] = []
    real_write, real_fdatasync = os.write, os.fdatasync
    real_pieces = store_mod._write_pieces
    if native and real_pieces is None:
        pytest.skip("storage._copycrc not built")
    if not native:
        monkeypatch.setattr(store_mod, "_write_pieces", None)
    else:
        def pieces(fd, data, chunk, align):
            direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
            n = real_pieces(fd, data, chunk, align)
            calls.append((f"pieces of {chunk}", n, direct))
            return n
        monkeypatch.setattr(store_mod, "_write_pieces", pieces)

    def write(fd, data):
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        n = real_write(fd, data)
        calls.append(("write", n, direct))
        return n

    def fdatasync(fd):
        calls.append(("fdatasync", 0, False))
        real_fdatasync(fd)

    monkeypatch.setattr(store_mod.os, "write", write)
    monkeypatch.setattr(store_mod.os, "fdatasync", fdatasync)
    s = open_object_store(f"file://{tmp_path}/o")
    s.direct_writes = True                    # EngineConfig.object_direct_writes
    chunk = store_mod.FILE_WRITE_CHUNK
    size = 2 * chunk + 12345
    buf = mmap.mmap(-1, 4 * chunk, flags=mmap.MAP_PRIVATE)
    data = os.urandom(size)
    buf[:size] = data
    s.put("d/aligned", memoryview(buf)[:size])
    direct_writes = [(f"pieces of {chunk}", 2 * chunk + 12288, True)] if native else \
        [("write", chunk, True), ("write", chunk, True), ("write", 12288, True)]
    assert calls == direct_writes + [("write", 57, False), ("fdatasync", 0, False)]
    assert s.get("d/aligned") == data
    calls.clear()
    s.put("d/exact", memoryview(buf)[:chunk])       # no tail: one fdatasync after the writes
    one = (f"pieces of {chunk}", chunk, True) if native else ("write", chunk, True)
    assert calls == [one, ("fdatasync", 0, False)]
    assert s.get("d/exact") == bytes(buf[:chunk])
    calls.clear()
    s.put("d/offset", memoryview(buf)[1:size + 1])  # not aligned: the page cache as before
    assert all(not direct for _, _, direct in calls)
    assert s.get("d/offset") == bytes(buf[1:size + 1])
    calls.clear()
    plain = open_object_store(f"file://{tmp_path}/p")   # the default: through the page cache
    plain.put("d/aligned", memoryview(buf)[:size])
    assert [direct for kind, _, direct in calls if kind == "write"] == [False] * 3
    assert plain.get("d/aligned") == data


def test_file_store_reads_large_ranges_in_pieces_without_readahead(tmp_path, monkeypatch) -> None:
    """A large ranged get asks the kernel for at most FILE_READ_CHUNK per call, with kernel
    readahead off for the range, so a WAL write on the same disk never queues behind more
    than one piece of a cold read; the bytes are the same for every range."""
    from storage.objects import store as store_mod
    chunk = store_mod.FILE_READ_CHUNK
    s = open_object_store(f"file://{tmp_path}/o")
    data = os.urandom(3 * chunk + 4321)
    s.put("big", data)
    asked: list[int] = []
    advice: list[int] = []
    real_preadv, real_pread, real_fadvise = os.preadv, os.pread, os.posix_fadvise

    def preadv(fd, buffers, offset):
        asked.append(sum(len(b) for b in buffers))
        return real_preadv(fd, buffers, offset)

    def pread(fd, n, offset):
        asked.append(n)
        return real_pread(fd, n, offset)

    def fadvise(fd, offset, length, how):
        advice.append(how)
        real_fadvise(fd, offset, length, how)

    monkeypatch.setattr(store_mod.os, "preadv", preadv)
    monkeypatch.setattr(store_mod.os, "pread", pread)
    monkeypatch.setattr(store_mod.os, "posix_fadvise", fadvise)
    for start, end in [(0, None), (1, len(data) - 1), (chunk - 7, 2 * chunk + 9), (5, 50),
                       (len(data) - 10, len(data))]:
        asked.clear()
        got = s.get("big", start, end)
        assert bytes(got) == data[start:end]
        assert asked and max(asked) <= chunk
    assert advice and set(advice) == {os.POSIX_FADV_RANDOM}
    # past the end: the bytes that exist (the reader compares the length with the index)
    assert bytes(s.get("big", len(data) - 100, len(data) + 5 * chunk)) == data[-100:]
    with pytest.raises(ObjectNotFound):
        s.get("missing", 0, 2 * chunk)


def test_get_ranges_returns_one_buffer_per_range(store) -> None:
    """get_ranges (the BlockCache's read of a stream's blocks) answers each range with its own
    bytes, gaps skipped, the same on every store; a range past the end comes back short."""
    data = os.urandom(300_000)
    store.put("o", data)
    ranges = [(0, 1000), (1000, 4096), (70_000, 100_000), (250_000, 50_000)]
    got = store.get_ranges("o", ranges)
    assert [bytes(g) for g in got] == [data[p:p + n] for p, n in ranges]
    assert store.get_ranges("o", []) == []
    short = store.get_ranges("o", [(290_000, 10_000), (300_000, 10)])
    assert bytes(short[0]) == data[290_000:]
    assert all(not bytes(g) for g in short[1:])
    with pytest.raises(ObjectNotFound):
        store.get_ranges("missing", [(0, 10)])


@pytest.mark.parametrize("direct", [False, True])
def test_file_store_reads_blocks_into_reused_page_aligned_buffers(tmp_path, direct) -> None:
    """From files, each block-sized range is read into its own page-aligned buffer from the
    store's pool (O_DIRECT when objects are written so), answered as a view of the exact
    range; a buffer goes back to the pool only once no view of it is left (fresh memory costs
    a page fault per 4 KiB: bench/HISTORY.md session 12)."""
    s = open_object_store(f"file://{tmp_path}/o")
    s.direct_writes = direct
    data = os.urandom((8 << 20) + 1234)
    s.put("big", data)
    ranges = [(i * (600 << 10) + 7 * i, 512 << 10) for i in range(12)]
    got = s.get_ranges("big", ranges)
    assert [bytes(g) for g in got] == [data[p:p + n] for p, n in ranges]
    owners = [g.obj for g in got]
    from storage.objects.buffers import _POOL_TYPES
    assert all(type(o) in _POOL_TYPES for o in owners) and len({id(o) for o in owners}) == 12
    tail = s.get_ranges("big", [(len(data) - 1000, 5000)])     # past the end: short
    assert bytes(tail[0]) == data[-1000:]
    assert s.buffers.fresh == 13 and s.buffers.reused == 0
    keep = got[0]
    for g in got:
        s.buffers.give_back(g.obj)
    del got, g, owners
    again = s.get_ranges("big", ranges)
    assert [bytes(g) for g in again] == [data[p:p + n] for p, n in ranges]
    assert s.buffers.reused == 11, "a buffer still seen by a view is not reused"
    assert bytes(keep) == data[:512 << 10], "the view kept its bytes"


def test_file_store_reads_neighbouring_blocks_together(tmp_path) -> None:
    """Adjacent blocks share one read and one buffer of at most FILE_READ_SPAN; views are
    exact; a read that runs past the end stops the answer there."""
    from storage.objects.store import FILE_READ_SPAN
    s = open_object_store(f"file://{tmp_path}/o")
    s.direct_writes = True
    data = os.urandom(12 << 20)
    s.put("big", data)
    size = (1 << 20) + 333
    ranges = [(100 + i * size, size) for i in range(10)]
    got = s.get_ranges("big", ranges)
    assert [bytes(g) for g in got] == [data[p:p + n] for p, n in ranges]
    owners = {id(g.obj): len(g.obj) for g in got}
    assert 1 < len(owners) < len(ranges)
    assert max(owners.values()) <= FILE_READ_SPAN + 2 * 4096
    short = s.get_ranges("big", [(len(data) - size, size), (len(data), size), (len(data) + size, 5)])
    assert bytes(short[0]) == data[-size:] and all(not bytes(x) for x in short[1:])


@pytest.mark.parametrize("direct", [False, True])
def test_file_store_checksums_each_block_in_the_spans_read(tmp_path, monkeypatch, direct) -> None:
    """get_ranges_crc: each range's CRC-32C from its byte ``skip`` on (an object block's body)
    comes from the same C call as the span's read (storage._copycrc's read_span_crcs: the
    cold thread takes the interpreter lock back once per span, not once per block); a range
    the file does not hold whole has None (and comes back short, as from get_ranges)."""
    import crc32c
    from storage.objects import store as store_mod
    if store_mod.read_span_crcs is None:
        pytest.skip("storage._copycrc not built")
    calls = []
    real = store_mod.read_span_crcs
    monkeypatch.setattr(store_mod, "read_span_crcs",
                        lambda *a: calls.append(len(a[3])) or real(*a))
    s = open_object_store(f"file://{tmp_path}/o")
    s.direct_writes = direct
    data = os.urandom((12 << 20) + 5555)
    s.put("big", data)
    size = (1 << 20) + 333
    ranges = [(100 + i * size, size) for i in range(11)] + [(len(data) - 10, 20)]
    got, crcs = s.get_ranges_crc("big", ranges, 14)
    assert [bytes(g) for g in got] == [data[p:p + n] for p, n in ranges]
    assert crcs[:11] == [crc32c.crc32c(data[p + 14:p + n]) for p, n in ranges[:11]]
    assert crcs[11:] == [None]
    assert len(calls) >= 2 and sum(calls) == len(ranges), "one call per span, every block in one"
    # what the default (and stores that do not compute them) answer: no CRCs, the same bytes
    assert s.get_ranges("big", ranges[:3]) == got[:3]


def test_file_store_leaves_block_checks_to_the_caller_while_hot(tmp_path) -> None:
    """While producers append, spans are read in small pieces (read_pieces): no CRC comes back
    (the caller checks), the bytes are the same, and fresh buffers are Python's mmaps as the
    paced catch-up path was measured with (item 5); unpaced reads map theirs without the
    interpreter lock (storage._copycrc.map_buffer, when built)."""
    import mmap
    from storage.objects import buffers
    s = open_object_store(f"file://{tmp_path}/o")
    s.direct_writes = True
    s.gentle = lambda: True
    data = os.urandom(3 << 20)
    s.put("big", data)
    ranges = [(0, 1 << 20), (1 << 20, 1 << 20)]
    got, crcs = s.get_ranges_crc("big", ranges, 14)
    assert [bytes(g) for g in got] == [data[p:p + n] for p, n in ranges]
    assert crcs == [None, None]
    assert type(got[0].obj) is mmap.mmap
    s.gentle = lambda: False
    s.buffers = buffers.BufferPool()
    got = s.get_ranges("big", ranges)
    assert type(got[0].obj) is (buffers._MappedBuffer or mmap.mmap)


def test_file_store_reads_small_pieces_one_at_a_time_while_hot(tmp_path, monkeypatch) -> None:
    """While producers append (``gentle``), a span of blocks is read HOT_READ_PIECE per call
    and one call at a time across threads, so a WAL write on the same disk queues behind at
    most one small piece (two 4 MiB reads in flight doubled the catch-up bench's produce p99);
    with nothing hot, one read per span. The bytes are the same either way."""
    import threading
    from storage.objects import store as store_mod
    piece, span = store_mod.HOT_READ_PIECE, store_mod.FILE_READ_SPAN
    s = open_object_store(f"file://{tmp_path}/o")
    s.direct_writes = True
    data = os.urandom(3 * span + 4321)
    s.put("big", data)
    ranges = [(i * (512 << 10), 512 << 10) for i in range(len(data) // (512 << 10))]
    asked: list[int] = []
    inflight = [0, 0]                       # now, most
    lock = threading.Lock()
    real_preadv = os.preadv

    def preadv(fd, buffers, offset):
        with lock:
            asked.append(sum(len(b) for b in buffers))
            inflight[0] += 1
            inflight[1] = max(inflight[1], inflight[0])
        try:
            time.sleep(0.001)               # long enough for another thread to overlap
            return real_preadv(fd, buffers, offset)
        finally:
            with lock:
                inflight[0] -= 1

    monkeypatch.setattr(store_mod.os, "preadv", preadv)
    # the piece loop in Python (without the C extension): each piece seen here
    monkeypatch.setattr(store_mod, "read_pieces", None)
    hot = [False]
    s.gentle = lambda: hot[0]
    got = s.get_ranges("big", ranges)
    assert [bytes(g) for g in got] == [data[p:p + n] for p, n in ranges]
    assert max(asked) > piece                           # nothing hot: whole spans
    hot[0] = True
    asked.clear()
    results: list[list[bytes]] = []

    def read() -> None:
        results.append([bytes(g) for g in s.get_ranges("big", ranges)])
    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[data[p:p + n] for p, n in ranges]] * 2
    assert max(asked) <= piece and len(asked) >= 2 * len(ranges) * (512 << 10) // piece
    assert inflight[1] == 1, "two device reads were in flight at once while hot"
    # the piece is the store's (the engine sets it from cold_read_piece_bytes)
    assert s.hot_read_piece == piece
    s.hot_read_piece = 4 * piece + 100              # rounded down to whole pages
    asked.clear()
    assert [bytes(g) for g in s.get_ranges("big", ranges)] == [data[p:p + n] for p, n in ranges]
    assert max(asked) == 4 * piece and min(asked) > 0


@pytest.mark.skipif(read_pieces is None, reason="storage._copycrc not built")
@pytest.mark.parametrize("tail", [0, 4321])
def test_file_store_reads_pieces_in_c_while_hot(tmp_path, monkeypatch, tail) -> None:
    """With the C extension the piece loop of a hot span read runs in C (the interpreter lock
    released once per span): the same bytes as the Python loop, a short last read at the end
    of the file, the piece size honoured down to one page."""
    from storage.objects import store as store_mod
    span = store_mod.FILE_READ_SPAN
    s = open_object_store(f"file://{tmp_path}/o")
    s.direct_writes = True
    data = os.urandom(2 * span + tail)
    s.put("big", data)
    ranges = [(i * (512 << 10), 512 << 10) for i in range(len(data) // (512 << 10))]
    ranges.append((len(data) - 100, 100))
    want = [data[p:p + n] for p, n in ranges]
    python_calls: list[int] = []
    real_preadv = os.preadv

    def preadv(fd, buffers, offset):
        python_calls.append(offset)
        return real_preadv(fd, buffers, offset)
    monkeypatch.setattr(store_mod.os, "preadv", preadv)
    s.gentle = lambda: True
    for piece in (4096, 64 << 10, 3 * (64 << 10)):
        s.hot_read_piece = piece
        assert [bytes(g) for g in s.get_ranges("big", ranges)] == want
    assert not python_calls, "the pieces were read by the Python loop"
    # past the end: short, as without the extension
    short = s.get_ranges("big", [(len(data) - 10, 20)])
    assert bytes(short[0]) == data[-10:]


@pytest.mark.skipif(read_pieces is None, reason="storage._copycrc not built")
def test_read_pieces_reports_errors_and_the_end_of_the_file(tmp_path) -> None:
    path = tmp_path / "f"
    data = os.urandom(3 * 4096 + 10)
    path.write_bytes(data)
    buf = bytearray(5 * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_pieces(fd, buf, 0, 4096) == len(data)
        assert bytes(buf[:len(data)]) == data
        assert read_pieces(fd, memoryview(buf)[:4096], 4096, 1000) == 4096   # 5 preads
        assert bytes(buf[:4096]) == data[4096:8192]
        assert read_pieces(fd, buf, len(data) + 4096, 4096) == 0
        with pytest.raises(ValueError):
            read_pieces(fd, buf, 0, 0)
        with pytest.raises(BufferError):
            read_pieces(fd, b"read-only", 0, 4096)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        read_pieces(fd, buf, 0, 4096)                  # closed
    assert e.value.errno == errno.EBADF


def _require_huge_pages() -> None:
    """Skip where the kernel gives no transparent huge pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                pytest.skip("transparent huge pages are off")
    except OSError:
        pytest.skip("no transparent huge pages")


def _anon_huge_kib(buf) -> int:
    """AnonHugePages (KiB) of the mapping holding ``buf`` (an mmap), from /proc/self/smaps."""
    import ctypes
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_file_store_reads_spans_into_huge_pages(tmp_path) -> None:
    """A span of neighbouring blocks (up to 4 MiB) is read into a buffer of transparent huge
    pages where the kernel has them: an O_DIRECT read is one device request per physically
    contiguous run (at most max_segments runs, 254 on the test VM), so into 4 KiB pages a
    4 MiB read went to the device as 5 requests (bench/HISTORY.md, session 15)."""
    _require_huge_pages()
    s = open_object_store(f"file://{tmp_path}/o")
    s.direct_writes = True
    data = os.urandom(12 << 20)
    s.put("big", data)
    size = (1 << 20) - 4096
    ranges = [(i * size, size) for i in range(4)]                # one 4 MiB span
    got = s.get_ranges("big", ranges)
    assert [bytes(g) for g in got] == [data[p:p + n] for p, n in ranges]
    assert len({id(g.obj) for g in got}) == 1
    assert _anon_huge_kib(got[0].obj) >= 2048


@pytest.mark.parametrize("direct", [False, True])
def test_cold_thread_decodes_blocks_with_the_crcs_of_their_read(tmp_path, monkeypatch,
                                                                direct) -> None:
    """ObjectReader's cold-thread fetch decodes each whole block with the CRC the file store
    computed in the span's read (no CRC call per block, each a hand-off of the interpreter
    lock); a block whose bytes do not match its header's CRC stays raw bytes, so its reader
    gets the CorruptObjectError (BlockCache decodes it then)."""
    from storage.objects import format as fmt
    from storage.objects import store as store_mod
    from storage.objects.format import CorruptObjectError, Record, decode_block, encode_object
    from storage.reader import ObjectReader
    if store_mod.read_span_crcs is None:
        pytest.skip("storage._copycrc not built")
    s = open_object_store(f"file://{tmp_path}/o")
    s.direct_writes = direct
    recs = [Record(1, i, 1, os.urandom(300_000 + i)) for i in range(6)]
    data, index, _ = encode_object(recs, block_size=600_000)
    data = bytearray(data)
    blocks = sorted({(e.position, e.size) for e in index})
    assert len(blocks) >= 3
    bad_pos, bad_size = blocks[1]
    data[bad_pos + bad_size - 7] ^= 0x40                 # one flipped byte in block 1's body
    s.put("obj", bytes(data))

    async def io(fn, *a):
        return fn(*a)
    reader = ObjectReader(s, io, 64 << 20, 32 << 20)

    def no_crc(*_a, **_k):
        raise AssertionError("a block CRC computed apart from its read")
    monkeypatch.setattr(fmt, "_crc", no_crc)
    got = reader._get_decoded("obj", blocks)
    assert [type(g) for g in got] == [list, memoryview] + [list] * (len(blocks) - 2)
    assert [bytes(r.payload) for g in got if isinstance(g, list) for r in g] == \
        [r.payload for r in recs if not bad_pos <= _start(index, r) < bad_pos + bad_size]
    monkeypatch.undo()
    with pytest.raises(CorruptObjectError):
        decode_block(got[1])


def _start(index, rec) -> int:
    """Position of the block holding ``rec`` (by its offset)."""
    return next(e.position for e in index if e.start_offset <= rec.base_offset < e.end_offset)
