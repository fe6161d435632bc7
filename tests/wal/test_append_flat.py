"""DeltaWAL.append_flat (the engine's task-less append: one call, the offset only) and
copycrc.place_record (a record received in place: its CRCs, headers and page tail in one call).
The promises of append_loop(then=...) hold through them: acknowledged once the record and every
earlier one of its stream are durable, in order per stream, a failed write failing exactly the
records from it on, and the records recovered byte for byte after the WAL is abandoned."""
from __future__ import annotations


import crc32c
import pytest

from storage import copycrc
from storage.wal import WALError, placed
from storage.wal.format import ALIGN, RECORD_HEADER_SIZE as H, unpack_record_header

from .test_append_then import _until
from .test_loop_aio import body, reopen
from .test_placed import ENG, batch_like, frame_with


def _payload(i: int) -> bytes:
    return batch_like(20_000 + 4093 * i, seed=i)


async def test_placed_and_copied_records_of_two_streams_complete_in_order_and_recover(
        make_wal, wal_path):
    """Records of streams 1 and 2, alternating, half received in place (offered frames) and
    half copied: each callback once, in order per stream, only after its write; the offsets
    are the ones the WAL recovers, with the bodies byte for byte."""
    w, _ = make_wal(capacity=16 << 20)
    assert w.attach_loop()
    seen: list[tuple[int, int, object]] = []
    offsets: dict[int, int] = {}
    bodies: list[bytes] = []
    keep = []
    for i in range(24):
        sid = 1 + i % 2
        payload = _payload(i)
        head = ENG.pack(sid, 100 * i, 3)
        if i % 4 < 2:                          # received in place
            frame, off = frame_with(payload)
            keep.append(frame)
            view = memoryview(frame)[off:off + len(payload)]
        else:
            view = memoryview(bytearray(payload))
        check = (ENG.size + 21, crc32c.crc32c(payload[21:]))
        offsets[i] = w.append_flat(head, view, sid, check,
                                   lambda off, exc, i=i: seen.append((i, off, exc)))
        bodies.append(head + payload)
    assert w.stats["placed_records"] == 12
    await _until(lambda: len(seen) == 24)
    assert sorted(i for i, _o, _e in seen) == list(range(24))
    assert all(exc is None and off == offsets[i] for i, off, exc in seen)
    for sid in (1, 2):
        mine = [i for i, _o, _e in seen if 1 + i % 2 == sid]
        assert mine == sorted(mine)
    w.close()
    assert reopen(wal_path, 16 << 20) == [(offsets[i], bodies[i]) for i in range(24)]


async def test_a_failed_placed_write_fails_it_and_every_record_after_it(make_wal, wal_path):
    """The first records are durable and acknowledged without error; once the device fails,
    the placed record whose write failed and every record appended after it (either stream)
    get the WAL's error, none of them an acknowledgement; recovery has exactly the first."""
    w, _ = make_wal(capacity=16 << 20)
    assert w.attach_loop()
    driver = w._driver
    got: dict[int, object] = {}
    keep = []

    def append(i: int) -> None:
        payload = _payload(i)
        frame, off = frame_with(payload)
        keep.append(frame)
        w.append_flat(ENG.pack(1 + i % 2, i, 1), memoryview(frame)[off:off + len(payload)],
                      1 + i % 2, None, lambda off, exc, i=i: got.__setitem__(i, exc))

    for i in range(3):
        append(i)
    await _until(lambda: len(got) == 3)

    def broken(*a, **kw):
        raise OSError(5, "injected EIO")

    driver.aio.submit_write = broken
    for i in range(3, 7):
        append(i)
    await _until(lambda: len(got) == 7)
    assert [got[i] for i in range(3)] == [None] * 3
    assert all(isinstance(got[i], WALError) for i in range(3, 7))
    w.close()
    assert [b[:ENG.size] for _o, b in reopen(wal_path, 16 << 20)] == \
        [ENG.pack(1 + i % 2, i, 1) for i in range(3)]


async def test_append_flat_off_the_loop_thread_is_append_loop(make_wal, wal_path):
    """From a thread other than the driver's (or with IO threads writing) append_flat is
    append_loop(flat=True): the same record, the callback on the caller's loop."""
    w, _ = make_wal(io_engine="threads")
    seen: list[tuple[int, int]] = []
    offs = [w.append_flat(b"h%02d" % i, body(0, i, 3000), 0, None,
                          lambda off, exc, i=i: seen.append((i, off)) if exc is None else None)
            for i in range(10)]
    await _until(lambda: len(seen) == 10)
    assert seen == list(enumerate(offs))
    w.close()
    assert reopen(wal_path) == [(offs[i], b"h%02d" % i + body(0, i, 3000)) for i in range(10)]


@pytest.mark.parametrize("split", [-1, 0, 21, 5000])
def test_place_record_python_and_native_write_the_same_record(split):
    """copycrc.place_record (C) and its pure-Python fallback: the same record header (magic,
    length, offset, CRC of head + payload), head, payload and zeroed tail; with a matching
    check None, with a wrong one the tail CRC returned and not a byte changed."""
    if copycrc._copycrc_module is None or not hasattr(copycrc._copycrc_module, "place_record"):
        pytest.skip("the extension is not built")
    payload = batch_like(70_001, seed=3)
    head = ENG.pack(5, 6, 7)
    want = crc32c.crc32c(payload[split:]) if split >= 0 else 0
    out = []
    for fn in (copycrc._copycrc_module.place_record, copycrc._place_record_py):
        frame, off = frame_with(payload)
        start = off - H - ENG.size
        end = start + (H + ENG.size + len(payload) + ALIGN - 1) // ALIGN * ALIGN
        region = memoryview(frame)[start:end]
        pay = memoryview(frame)[off:off + len(payload)]
        if split >= 0:
            before = bytes(frame)
            assert fn(region, head, pay, 12 * ALIGN, split, want ^ 1) == want
            assert bytes(frame) == before
        assert fn(region, head, pay, 12 * ALIGN, split, want) is None
        out.append(bytes(region))
    assert out[0] == out[1]
    rec = out[0]
    assert unpack_record_header(rec) == (ENG.size + len(payload), 12 * ALIGN,
                                         crc32c.crc32c(head + payload))
    assert rec[H:H + ENG.size] == head and rec[H + ENG.size:H + ENG.size + len(payload)] == payload
    assert rec[H + ENG.size + len(payload):].strip(b"\0") == b""


def test_place_record_takes_the_receives_sum_for_its_pass_only_when_it_is_the_check():
    """A sum made as the payload was received (CRC of payload[summed_from:]) stands for the
    pass over payload[split:] when it starts at ``split`` and equals ``want``: the record's
    CRC is then combined from it, equal to the CRC of its bytes. A sum of other bytes (a stamp
    rewrote them since: want is their new CRC) or from another place is set aside and the pass
    decides, so a corrupt batch is still refused."""
    if copycrc._copycrc_module is None or not hasattr(copycrc._copycrc_module, "place_record"):
        pytest.skip("the extension is not built")
    payload = batch_like(200_003, seed=5)
    head = ENG.pack(1, 2, 3)
    real = crc32c.crc32c(payload[21:])
    stale = real ^ 0x5A5A

    def place(fn, want, summed_from, summed):
        frame, off = frame_with(payload)
        start = off - H - ENG.size
        end = start + (H + ENG.size + len(payload) + ALIGN - 1) // ALIGN * ALIGN
        got = fn(memoryview(frame)[start:end], head, memoryview(frame)[off:off + len(payload)],
                 3 * ALIGN, 21, want, summed_from, summed)
        return got, bytes(frame[start:end])

    for fn in (copycrc._copycrc_module.place_record, copycrc._place_record_py):
        for summed_from, summed in ((21, real), (21, stale), (0, real), (-1, 0)):
            got, rec = place(fn, real, summed_from, summed)
            assert got is None, (fn, summed_from, summed)
            assert unpack_record_header(rec)[2] == crc32c.crc32c(head + payload)
        # a corrupt batch (its bytes' CRC is not its field's): a sum of its bytes is not the
        # check, so the pass runs and refuses it
        assert place(fn, stale, 21, real)[0] == real
        # the sum, when it is the check, is taken for the bytes: no pass over them
        assert place(fn, stale, 21, stale)[0] is None


def test_place_record_refuses_a_payload_not_in_its_region():
    frame, off = frame_with(batch_like(9000))
    start = off - H - ENG.size
    region = memoryview(frame)[start:start + 3 * ALIGN]
    elsewhere = bytearray(9000)
    for fn in (copycrc.place_record, copycrc._place_record_py):
        with pytest.raises(ValueError):
            fn(region, ENG.pack(1, 2, 3), memoryview(elsewhere), 0, -1, 0)


def _take_cases():
    """(kind, frame, payload offset, payload length, view, head) cases for placed.take:
    offered exactly, another length, not offered, read-only, the headers not on a page, a
    slice of the payload."""
    payload = batch_like(30_000)
    cases = []
    for kind in ("exact", "length", "unoffered", "readonly", "unaligned", "inner"):
        frame, off = frame_with(payload)
        view = memoryview(frame)[off:off + len(payload)]
        head = H + ENG.size
        if kind == "length":
            view = view[:-1]
        elif kind == "readonly":
            view = view.toreadonly()
        elif kind == "unaligned":
            head += 8
        elif kind == "inner":
            view = memoryview(frame)[off + 8:off + 8 + len(payload)]
        cases.append((kind, frame, off, len(payload), view, head))
    return cases


def test_take_in_c_is_take_in_python():
    """placed.take (storage/_copycrc.c take_offered over the registry) returns the region
    _take_py returns for the same frame and offer - the same bytes at the same address and the
    offer's sum, or None - and uses the offer up (or leaves it) alike."""
    if placed._take_offered is None:
        pytest.skip("the extension is not built")
    taken = []
    for kind, frame, off, n, view, head in _take_cases():
        got = []
        for fn in (placed.take, placed._take_py):
            placed.withdraw(frame)
            if kind != "unoffered":
                placed.offer(frame, off, n, 21, 0xC0FFEE)
            res = fn(view, head)
            got.append(None if res is None else
                       (placed.address(res[0]), bytes(res[0]), res[1:]))
            got.append(id(frame) in placed._offered)
        placed.withdraw(frame)
        assert got[:2] == got[2:], kind
        if got[0] is not None:
            assert got[0][2] == (21, 0xC0FFEE)     # the offer's sum comes with its region
            taken.append(kind)
    assert taken == ["exact"]
