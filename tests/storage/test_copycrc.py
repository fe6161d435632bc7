"""storage.copycrc: the fused copy + CRC-32C (C extension) equals memmove + crc32c, in the WAL
and in objects; without the extension the broker's storage still works (pure-Python path)."""
from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import threading
import time

import crc32c
import pytest
from hypothesis import given, settings, strategies as st

from storage import copycrc
from storage.objects.format import Record, decode_object, encode_object

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = [0, 1, 7, 8, 9, 255, 768, 769, 4095, 4096, 12287, 12288, 12289, 65535, 65536,
         100_003, (1 << 20) + 13]


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The compiled module: built by setup.py into a temporary directory with this machine's
    compiler (what `pip install -e .` does in a fresh clone), whether or not this checkout
    was built in place."""
    out = tmp_path_factory.mktemp("build")
    res = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
                          str(out / "lib"), "--build-temp", str(out / "tmp")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    built = list((out / "lib" / "storage").glob("_copycrc*.so"))
    assert built, f"storage._copycrc was not built: {res.stderr}"
    spec = importlib.util.spec_from_file_location("storage._copycrc", built[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.HARDWARE, "no SSE4.2 here? the broker would run the pure-Python path"
    return mod


@pytest.mark.parametrize("impl", ["native", "python"])
def test_copy_crc_equals_copy_then_crc32c(impl, native):
    fn = native.copy_crc if impl == "native" else copycrc._copy_crc_py
    rnd = random.Random(7)
    for n in SIZES:
        src = rnd.randbytes(n)
        for off in (0, 3, 4096):
            value = rnd.getrandbits(32)
            dst = bytearray(b"\xaa" * (n + off + 5))
            assert fn(dst, off, src, value) == crc32c.crc32c(src, value), (n, off)
            assert dst[off:off + n] == src
            assert dst[:off] == b"\xaa" * off and dst[off + n:] == b"\xaa" * 5   # nothing else
    # chaining over parts equals one CRC of the whole, from memoryviews and bytearrays too
    a, b = bytearray(rnd.randbytes(70_001)), memoryview(rnd.randbytes(30_000))
    dst = bytearray(100_001)
    crc = fn(dst, 0, a)
    assert fn(dst, len(a), b, crc) == crc32c.crc32c(bytes(a) + bytes(b))


@pytest.mark.parametrize("impl", ["native", "python"])
def test_copy_crc_split_also_gives_the_crc_of_the_tail(impl, native):
    """copy_crc_split: the copy and the CRC of copy_crc, plus the CRC of src[split:] alone (a
    produce batch's own CRC covers it from byte 21), combined from one pass."""
    fn = native.copy_crc_split if impl == "native" else copycrc._copy_crc_split_py
    rnd = random.Random(11)
    for n in SIZES:
        src = rnd.randbytes(n)
        for split in sorted({0, min(21, n), n // 3, n}):
            value = rnd.getrandbits(32)
            dst = bytearray(b"\xaa" * (n + 9))
            crc, tail = fn(dst, 4, memoryview(src), value, split)
            assert (crc, tail) == (crc32c.crc32c(src, value), crc32c.crc32c(src[split:])), \
                (n, split)
            assert dst[4:4 + n] == src and dst[:4] == b"\xaa" * 4 and dst[4 + n:] == b"\xaa" * 5
    if impl == "native":
        with pytest.raises(ValueError):
            fn(bytearray(100), 0, b"abc", 0, 4)


def test_the_wal_copy_uses_ordinary_stores_and_the_object_encoder_stream_stores(native):
    """With AVX2 the object encoder (IO threads, encode_blocks) writes with non-temporal
    stores, the WAL's copies on the event loop (copy_crc, copy_crc_split) with ordinary ones:
    in the broker the stream stores into WAL blocks took ~2x the CPU (bench/HISTORY.md,
    session 19 loopcpu). Both give the same bytes and CRCs (the tests above)."""
    if not native.STREAM_STORES:
        pytest.skip("no AVX2 here: both are the scalar copy")
    assert native.LOOP_STREAM_STORES == 0


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _widest_fold(flags: set[str]) -> int:
    if {"avx512f", "vpclmulqdq"} <= flags:
        return 512
    return 256 if {"avx2", "vpclmulqdq"} <= flags else 0


def test_the_widest_fold_this_cpu_has_is_chosen_at_import(native):
    """AVX-512 + VPCLMULQDQ: 512-bit registers; AVX2 + VPCLMULQDQ without AVX-512 (AMD Zen 3,
    where the crc32 instruction had been 8.8 % of the broker's samples under 1 MiB produce,
    bench/HISTORY.md session 41): 256-bit ones; else the crc32 instruction."""
    if not native.STREAM_STORES:
        pytest.skip("no AVX2 here: the scalar copy")
    bits = _widest_fold(_cpu_flags())
    assert (native.FOLD_BITS, native.FOLD) == (bits, int(bits > 0))
    with pytest.raises(ValueError):
        native._set_fold(1024)


@pytest.mark.parametrize("bits", [512, 256, 0])
def test_the_copies_fold_the_crc_with_carry_less_multiplication_where_the_cpu_can(native, bits):
    """On a CPU with VPCLMULQDQ both copies compute the CRC by folding 256 bytes a step with
    carry-less multiplications (one stream; on AVX-512 ~2x the crc32 instruction's 8 bytes a
    cycle: 1 MiB hot 0.048 -> 0.023 ms, cold 0.10 -> 0.056, bench/HISTORY.md session 22
    produce), with the same bytes and CRC as crc32c at every length and alignment around the
    fold's 256-byte steps, its 1 KiB minimum and its 64-byte destination alignment. Each width
    the CPU has is tested (0: the crc32 instruction's copies, for comparison)."""
    if not native.STREAM_STORES or bits > _widest_fold(_cpu_flags()):
        pytest.skip(f"no {bits}-bit fold on this CPU")
    was = native._set_fold(bits)
    try:
        _check_copies_and_crc(native)
    finally:
        native._set_fold(was)


def _check_copies_and_crc(native) -> None:
    rnd = random.Random(22)
    lengths = [1023, 1024, 1025, 1087, 1088, 1279, 1280, 1281, 1343, 1344, 2047, 2048, 4096 + 17,
               65536 + 255, (1 << 20) + 1]
    for n in lengths:
        src = rnd.randbytes(n)
        for off in (0, 1, 31, 63, 64, 100):
            for value in (0, 0xFFFFFFFF, rnd.getrandbits(32)):
                dst = bytearray(b"\xaa" * (n + off + 70))
                assert native.copy_crc(dst, off, src, value) == crc32c.crc32c(src, value), (n, off)
                assert dst[off:off + n] == src and dst[off + n:] == b"\xaa" * 70
                assert dst[:off] == b"\xaa" * off
        # copy_crc_split (the WAL copy with the batch check): both CRCs
        split = n // 3
        crc, tail = native.copy_crc_split(bytearray(n), 0, src, 0, split)
        assert (crc, tail) == (crc32c.crc32c(src), crc32c.crc32c(src[split:]))
        # the CRC alone (storage.copycrc.crc), from any alignment
        for off in (0, 1, 63):
            view = memoryview(b"\x00" * off + src)[off:]
            assert native.crc(view, 77) == crc32c.crc32c(src, 77), (n, off)
    # the object encoder's copy (encode_blocks on the IO threads: the stream stores): the
    # same blocks as the in-tree encoder's
    records = [Record(1, 10 * i, 10, rnd.randbytes(n))
               for i, n in enumerate((100, 5000, 70_000 + 3, (1 << 20) + 17, 1024))]
    want, _, _ = encode_object(records, block_size=64 << 10)
    out = bytearray(len(want))
    nxt, end, _ = native.encode_blocks(out, 0, records, 0, 64 << 10, 0, False)
    assert nxt == len(records) and out[:end] == bytes(want[:end])


def test_copy_crc_refuses_what_does_not_fit(native):
    with pytest.raises(ValueError):
        native.copy_crc(bytearray(10), 5, b"123456")
    with pytest.raises(BufferError):
        native.copy_crc(b"read-only", 0, b"x")


@pytest.mark.parametrize("impl", ["native", "python"])
def test_copy_record_writes_the_record_the_two_copies_and_pack_record_header_wrote(impl, native):
    """copy_record (DeltaWAL._reserve's one call per engine record): the same bytes as
    copy_crc of each part and pack_record_header (the path it replaced), nothing else
    touched; a record that does not fit is refused before anything is written."""
    from storage.wal.format import RECORD_HEADER_SIZE, pack_record_header, unpack_record_header
    fn = native.copy_record if impl == "native" else copycrc._copy_record_py
    rnd = random.Random(11)
    for n in SIZES:
        for head in (b"", rnd.randbytes(20), rnd.randbytes(3)):
            body = memoryview(bytearray(rnd.randbytes(n)))
            pos = rnd.getrandbits(63)
            for at in (0, 5, 4096):
                size = at + RECORD_HEADER_SIZE + len(head) + n
                got = bytearray(b"\xaa" * (size + 7))
                want = bytearray(got)
                assert fn(got, at, pos, head, body) is None
                o = at + RECORD_HEADER_SIZE
                crc = copycrc._copy_crc_py(want, o, head)
                crc = copycrc._copy_crc_py(want, o + len(head), body, crc)
                pack_record_header(want, at, len(head) + n, pos, crc)
                assert got == want, (n, len(head), at)
                assert unpack_record_header(got, at) == (len(head) + n, pos, crc)
    for bad in ((bytearray(30), 0, 0, b"", b"1234567"), (bytearray(30), 7, 0, b"", b""),
                (bytearray(30), -1, 0, b"", b""), (bytearray(30), 31, 0, b"", b"")):
        before = bytes(bad[0])
        with pytest.raises(ValueError, match="does not fit"):
            fn(*bad)
        assert bytes(bad[0]) == before
    fn(bytearray(30), 6, 0, b"", b"")      # exactly fits
    if impl == "native":
        with pytest.raises(BufferError):
            fn(b"read-only" * 9, 0, 0, b"", b"x")


def test_a_large_copy_lets_other_threads_run(native):
    """The interpreter lock is released during large copies (the loop's WAL copy, an IO
    thread's object encode): a counting thread advances while copies run."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)     # the lock would only be handed over by a release
    stop = threading.Event()
    count = [0]

    def counter():
        while not stop.is_set():
            count[0] += 1

    src, dst = os.urandom(8 << 20), bytearray(8 << 20)
    t = threading.Thread(target=counter, daemon=True)
    try:
        t.start()
        time.sleep(0.01)
        start = count[0]
        deadline = time.monotonic() + 5
        while count[0] == start and time.monotonic() < deadline:
            native.copy_crc(dst, 0, src)
        assert count[0] > start
    finally:
        stop.set()
        sys.setswitchinterval(old)
        t.join()


def test_objects_are_the_same_bytes_with_and_without_the_fused_copy(monkeypatch, native):
    """Block CRCs accumulated while large records are added equal one CRC per closed block."""
    from storage.objects import format as fmt
    monkeypatch.setattr(fmt, "copy_crc", native.copy_crc)
    monkeypatch.setattr(fmt, "FUSED_COPY_FROM", 4096)
    rnd = random.Random(3)
    records, off = [], 0
    for n in [100, 5000, 70_000, 3, 1 << 20, 4096, 200, 300_000, 10]:
        records.append(Record(1 + (off > 200_000), off, 2, rnd.randbytes(n)))
        off += 2
    records.sort(key=lambda r: (r.stream_id, r.base_offset))
    fused, _, _ = encode_object(records, block_size=64 << 10)
    monkeypatch.setattr(fmt, "FUSED_COPY_FROM", 1 << 62)
    plain, _, _ = encode_object(records, block_size=64 << 10)
    assert bytes(fused) == bytes(plain)
    got = list(decode_object(fused))
    assert [bytes(r.payload) for r in got] == [bytes(r.payload) for r in records]


def test_without_the_extension_the_wal_and_objects_still_work(tmp_path):
    """The pure-Python path (the extension not built): one warning line, then WAL records and
    objects written and read back as with it."""
    code = r"""
import logging, sys
sys.modules["storage._copycrc"] = None          # as if the build had failed
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from storage import copycrc
assert not copycrc.NATIVE
copycrc.warn_if_missing(); copycrc.warn_if_missing()
from storage.wal.wal import DeltaWAL
from storage.wal.config import WALConfig
from storage.objects.format import Record, decode_object, encode_object
path = sys.argv[1]
payloads = [bytes([i]) * (i * 50_000 + 7) for i in range(1, 5)]
wal = DeltaWAL(WALConfig(path=path, capacity=8 << 20))
assert list(wal.open()) == []
for p in payloads:
    wal.append((b"hdr", p)).future.result(30)
wal.close()
wal = DeltaWAL(WALConfig(path=path, capacity=8 << 20))
got = [bytes(body) for _off, body in wal.open()]
wal.close()
assert got == [b"hdr" + p for p in payloads], [len(g) for g in got]
obj, _, _ = encode_object([Record(1, i, 1, p) for i, p in enumerate(payloads)])
assert [bytes(r.payload) for r in decode_object(obj)] == payloads
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "wal")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"
    warnings = [ln for ln in out.stderr.splitlines() if ln.startswith("WARNING")]
    assert len(warnings) == 1 and "storage._copycrc not built" in warnings[0], out.stderr


def _encode(monkeypatch, native, records, block_size, c: bool, sliced: bool = False,
            release_gil: bool = False):
    """(bytes, index, ranges) of one object, by the C encoder (``c``) or the Python one."""
    from storage.objects import format as fmt
    monkeypatch.setattr(copycrc, "encode_blocks", native.encode_blocks if c else None)
    monkeypatch.setattr(copycrc, "object_size_steps", native.object_size_steps if c else None)
    enc = fmt.ObjectEncoder(records, block_size, release_gil=release_gil)
    if sliced:       # a clock always past the deadline: one call (one block or more) per step
        while not enc.encode(until=0.0, clock=lambda: 1.0):
            pass
    else:
        enc.encode()
    data, index, ranges = enc.finish()
    return bytes(data), index, [(r.stream_id, r.start_offset, r.end_offset) for r in ranges]


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5),
                          st.sampled_from([0, 1, 7, 33, 100, 1400, 4097, 70_000])), max_size=60),
       st.sampled_from([1, 64, 1024, 4096, 65536, 512 << 10]), st.booleans(), st.booleans(),
       st.integers(0, 2 ** 32 - 1))
def test_c_encoder_writes_the_python_encoders_bytes(monkeypatch_session, native, shape,
                                                     block_size, sliced, release_gil, seed):
    """The C encoder (storage._copycrc.encode_blocks, whole blocks per call) writes the same
    object, index and ranges as the Python one for any mix of streams, counts, payload sizes
    (bytes, and views into larger frames as the LogCache holds them) and block sizes, whole
    or in slices, with the interpreter lock held or released; and the C size pass agrees."""
    from storage.cache.log_cache import CacheEntry
    from storage.objects import format as fmt
    rnd = random.Random(seed)
    recs, offs = [], {}
    for i, (sid, count, n) in enumerate(sorted(shape, key=lambda t: t[0])):
        off = offs.get(sid, 0) + rnd.randrange(3)          # gaps between records too
        payload = rnd.randbytes(n)
        if i % 3 == 1:
            payload = memoryview(bytearray(b"x" * 5) + payload + b"y")[5:5 + n]
        recs.append(CacheEntry(sid, off, count, payload) if i % 2 else
                    Record(sid, off, count, payload))
        offs[sid] = off + count
    want = _encode(monkeypatch_session, native, recs, block_size, c=False)
    got = _encode(monkeypatch_session, native, recs, block_size, c=True, sliced=sliced,
                  release_gil=release_gil)
    assert got[0] == want[0]
    assert got[1] == want[1] and got[2] == want[2]
    assert [tuple(r) for r in decode_object(got[0])] == \
        [(r.stream_id, r.base_offset, r.count, r.payload) for r in recs]
    monkeypatch_session.setattr(copycrc, "object_size_steps", native.object_size_steps)
    assert fmt.object_size(recs, block_size) == len(want[0])


@pytest.fixture(scope="module")
def monkeypatch_session():
    """A monkeypatch that hypothesis' repeated examples may share (undone at module end)."""
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_c_encoder_refuses_bad_input_with_clear_errors(native):
    """Unsorted records, a buffer too small, a payload that is no buffer, a count that does
    not fit the header: a ValueError/TypeError, never a crash or a write past the buffer."""
    recs = [Record(1, 10, 1, b"a" * 100), Record(1, 5, 1, b"b")]
    with pytest.raises(ValueError, match="sorted"):
        native.encode_blocks(bytearray(1000), 0, recs, 0, 1024, 0, False)
    # the sort check also looks back at the record before ``start``
    with pytest.raises(ValueError, match="sorted"):
        native.encode_blocks(bytearray(1000), 0, recs, 1, 1024, 0, False)
    guard = bytearray(b"\xee" * 200)
    out = memoryview(guard)[:150]
    with pytest.raises(ValueError, match="too small"):
        native.encode_blocks(out, 0, [Record(1, 0, 1, b"z" * 120)], 0, 1024, 0, False)
    out.release()
    assert guard[150:] == b"\xee" * 50
    with pytest.raises(TypeError):
        native.encode_blocks(bytearray(1000), 0, [Record(1, 0, 1, "text")], 0, 1024, 0, False)
    with pytest.raises(ValueError, match="count"):
        native.encode_blocks(bytearray(1000), 0, [Record(1, 0, 1 << 40, b"x")], 0, 1024, 0,
                             False)
    with pytest.raises(BufferError):
        native.encode_blocks(b"read-only" * 100, 0, [Record(1, 0, 1, b"x")], 0, 1024, 0, False)


def test_write_pieces_writes_in_pieces_and_stops_where_python_would(tmp_path) -> None:
    """storage._copycrc.write_pieces (the O_DIRECT object writes, storage/objects/store.py):
    every byte goes out in writes of at most ``chunk`` bytes, in order (a SEQPACKET socket
    keeps each write apart); O_DIRECT refusing a misaligned buffer (EINVAL) returns what was
    written so far (0) for the caller's page-cache fallback; other errors raise OSError."""
    import errno
    import mmap
    import socket

    native = pytest.importorskip("storage._copycrc")
    if not hasattr(native, "write_pieces"):
        pytest.skip("storage._copycrc built before write_pieces")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        data = os.urandom(10_000)
        assert native.write_pieces(a.fileno(), memoryview(data), 4096, 1) == len(data)
        got = [b.recv(65536) for _ in range(3)]
        assert [len(g) for g in got] == [4096, 4096, 1808]
        assert b"".join(got) == data
        assert native.write_pieces(a.fileno(), b"", 4096, 1) == 0
    finally:
        a.close()
        b.close()
    path = tmp_path / "direct"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        pytest.skip("no O_DIRECT on this file system")
    buf = mmap.mmap(-1, 3 << 20)
    try:
        assert native.write_pieces(fd, memoryview(buf)[1:(1 << 20) + 1], 1 << 20, 4096) == 0
        assert native.write_pieces(fd, memoryview(buf)[:3 << 20], 1 << 20, 4096) == 3 << 20
        assert os.fstat(fd).st_size == 3 << 20
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        native.write_pieces(fd, b"x" * 10, 4, 1)          # closed: EBADF, not swallowed
    assert e.value.errno == errno.EBADF
    with pytest.raises(ValueError):
        native.write_pieces(1, b"x", 0, 1)


def test_c_encoder_gathers_several_blocks_before_it_releases_the_lock(native):
    """With ``nogil`` the C encoder gathers the records of several blocks (the interpreter lock
    held) before one release copies them all: an object of 1 MiB records (one record per 512
    KiB block) took the lock back after every block, a hand-off with the event loop each time.
    Seen here by reading the output buffer from the records' ``payload`` attribute: when the
    later records are gathered, no block has been written yet; without ``nogil`` each block is
    written before the next one is gathered (the sliced encode on the loop). The bytes are the
    Python encoder's either way."""
    out = bytearray(8 << 20)
    seen = []

    class Rec:
        def __init__(self, i, payload):
            self.stream_id, self.base_offset, self.count, self._p = 1, i, 1, payload

        @property
        def payload(self):
            seen.append(bytes(out[:14]) != bytes(14))     # the first block's header written?
            return self._p

    payloads = [bytes([i + 1]) * (600 << 10) for i in range(6)]
    recs = [Rec(i, p) for i, p in enumerate(payloads)]
    nxt, at, index = native.encode_blocks(out, 0, recs, 0, 512 << 10, 0, True)
    assert nxt == 6 and len(index) == 6
    assert seen == [False] * 6, seen
    want, _, _ = encode_object([Record(1, i, 1, p) for i, p in enumerate(payloads)], 512 << 10)
    assert bytes(out[:at]) == bytes(want)[:at]
    out[:] = bytes(len(out))
    seen.clear()
    native.encode_blocks(out, 0, recs, 0, 512 << 10, 0, False)
    assert seen == [False] + [True] * 5, seen
    assert bytes(out[:at]) == bytes(want)[:at]
    # a batch ends after 256 records (at the end of the block holding the 256th): small
    # records are not all gathered with the lock held
    out[:] = bytes(len(out))
    seen.clear()
    small = [Rec(i, b"s" * 100) for i in range(600)]
    native.encode_blocks(out, 0, small, 0, 1000, 0, True)
    assert seen.index(True) in range(256, 266), seen.index(True)
