"""Records received in place (storage/wal/placed.py): a payload offered where the WAL writes it
is written from its own buffer - the WAL's headers go into the bytes before it, no copy into a
pooled block - and recovered byte for byte after a crash; anything else takes the copy path."""
from __future__ import annotations

import struct

import crc32c
import pytest

from storage.wal import DeltaWAL, WALConfig
from storage.wal import placed
from storage.wal.errors import ChecksumMismatchError
from storage.wal.format import ALIGN, RECORD_HEADER_SIZE as H, unpack_record_header

from .test_boundaries import small_wal

ENG = struct.Struct(">qqi")          # the engine's stream-record header (storage/engine.py)


def frame_with(payload: bytes, head: int = H + ENG.size, lead: int = 100) -> tuple[bytearray, int]:
    """A frame-like bytearray holding ``payload`` at a place offered to the WAL (after
    ``lead`` bytes of a request envelope); returns it and the payload's offset."""
    buf = bytearray(lead + len(payload) + 3 * ALIGN)
    off = placed.place(buf, lead, head)
    buf[:off] = b"e" * off
    buf[off:off + len(payload)] = payload
    buf[off + len(payload):] = b"t" * (len(buf) - off - len(payload))
    placed.offer(buf, off, len(payload))
    return buf, off


def batch_like(n: int, seed: int = 1) -> bytes:
    unit = struct.pack(">IQ", 0xBA7C0000 ^ seed, seed)
    return (unit * (n // len(unit) + 1))[:n]


def wal_at(path: str, engine: str, cap: int = 4 << 20) -> DeltaWAL:
    """An opened WAL sealed only by size or flush (test_boundaries' small_wal, larger)."""
    return small_wal(path, engine, cap)


@pytest.mark.parametrize("engine", ["threads", "uring", "aio"])
async def test_an_offered_payload_is_written_from_its_own_buffer_and_recovered_after_a_crash(
        tmp_path, engine):
    path = str(tmp_path / "wal")
    w = wal_at(path, engine)
    small = w.append_loop(b"s" * 300)                      # an open block before it
    payload = batch_like(300_000)
    frame, off = frame_with(payload)
    head = ENG.pack(7, 1000, 5)
    view = memoryview(frame)[off:off + len(payload)]
    big = w.append_loop((head, view), 7, (ENG.size + 21, crc32c.crc32c(payload[21:])))
    assert w.stats["placed_records"] == 1
    # the WAL's headers were written into the frame, right before the payload: the block
    # written is the frame's memory (its pool gave no buffer for it)
    start = off - H - ENG.size
    assert (placed.address(frame) + start) % ALIGN == 0
    assert unpack_record_header(bytes(frame[start:start + H]))[:2] == \
        (ENG.size + len(payload), ALIGN)
    assert bytes(frame[start + H:off]) == head
    assert bytes(frame[off:off + len(payload)]) == payload
    end = off + len(payload)
    assert bytes(frame[end:start + (end - start + ALIGN - 1) // ALIGN * ALIGN]).strip(b"\0") == b""
    assert await small.future == 0
    assert await big.future == ALIGN                       # the small record's block, sealed
    after = w.append_loop(b"a" * 50)                       # the copy path goes on after it
    w.flush()
    assert await after.future == ALIGN + (H + ENG.size + len(payload) + ALIGN - 1) // ALIGN * ALIGN
    del view
    # a crash: the WAL is abandoned, not closed; recovery reads the records byte for byte
    w2 = DeltaWAL(WALConfig(path=path, capacity=4 << 20))
    assert list(w2.open()) == [(0, b"s" * 300), (ALIGN, head + payload),
                               (after.offset, b"a" * 50)]
    w2.close()
    w.close()


async def test_a_record_that_would_cross_the_ring_end_takes_the_copy_path(tmp_path):
    path = str(tmp_path / "wal")
    w = wal_at(path, "threads", cap=72 << 10)              # a 64 KiB ring
    ring = w.ring_size
    first = w.append_loop(b"f" * (40_000 - H))             # [0, 40000): the next page 40960
    w.flush()
    assert await first.future == 0
    w.trim(first.next_offset)
    payload = batch_like(30_000, 2)                        # 40960 + 30044 > ring
    frame, off = frame_with(payload)
    before = bytes(frame)
    head = ENG.pack(1, 0, 1)
    r = w.append_loop((head, memoryview(frame)[off:off + len(payload)]), 1,
                      (ENG.size + 21, crc32c.crc32c(payload[21:])))
    w.flush()
    assert await r.future == ring                          # jumped to the next lap: copied
    assert w.stats["placed_records"] == 0
    assert bytes(frame) == before                          # the frame was not written to
    w.close()
    w2 = DeltaWAL(WALConfig(path=path, capacity=72 << 10))
    assert list(w2.open()) == [(ring, head + payload)]
    w2.close()


async def test_a_payload_that_is_not_the_offered_one_takes_the_copy_path(tmp_path):
    w = wal_at(str(tmp_path / "wal"), "threads")
    payload = batch_like(100_000, 3)
    frame, off = frame_with(payload)
    before = bytes(frame)
    part = memoryview(frame)[off:off + 50_000]             # e.g. the first of two batches
    r = w.append_loop((ENG.pack(1, 0, 1), part), 1)
    w.flush()
    await r.future
    assert w.stats["placed_records"] == 0 and bytes(frame) == before
    assert id(frame) not in placed._offered                # its offer is used up either way
    w.close()


async def test_a_placed_record_with_a_wrong_batch_crc_is_refused_and_nothing_is_taken(tmp_path):
    w = wal_at(str(tmp_path / "wal"), "threads")
    payload = batch_like(100_000, 4)
    frame, off = frame_with(payload)
    head = ENG.pack(1, 0, 1)
    with pytest.raises(ChecksumMismatchError):
        w.append_loop((head, memoryview(frame)[off:off + len(payload)]), 1,
                      (ENG.size + 21, crc32c.crc32c(payload[21:]) ^ 1))
    assert w.stats["placed_records"] == 0
    r = w.append_loop(b"n" * 10)
    w.flush()
    assert await r.future == 0                             # nothing was taken before it
    w.close()


def test_offers_are_bounded_and_withdrawn():
    bufs = [bytearray(10) for _ in range(placed.MAX_OFFERED + 5)]
    for b in bufs:
        placed.offer(b, 0, 10)
    assert len(placed._offered) == placed.MAX_OFFERED
    for b in bufs:
        placed.withdraw(b)
    assert not placed.offered()


async def test_an_offer_summed_as_received_is_checked_from_its_sum_and_recovered(tmp_path):
    """An offer carrying the CRC of the batch's checked bytes (the receive's sum) is placed
    without a pass over them (stats: placed_summed); its record's CRC, combined from that sum,
    is the CRC of its bytes: recovery after a crash reads it back."""
    path = str(tmp_path / "wal")
    w = wal_at(path, "uring")
    payload = batch_like(250_000, 6)
    frame, off = frame_with(payload)
    placed.offer(frame, off, len(payload), 21, crc32c.crc32c(payload[21:]))
    head = ENG.pack(3, 0, 1)
    r = w.append_loop((head, memoryview(frame)[off:off + len(payload)]), 3,
                      (ENG.size + 21, crc32c.crc32c(payload[21:])))
    w.flush()
    assert await r.future == 0
    assert w.stats["placed_records"] == 1 and w.stats["placed_summed"] == 1
    w2 = DeltaWAL(WALConfig(path=path, capacity=4 << 20))
    assert list(w2.open()) == [(0, head + payload)]
    w2.close()
    w.close()


async def test_bytes_stamped_after_their_sum_are_checked_by_a_pass(tmp_path):
    """Bytes rewritten after the receive summed them (a LogAppendTime stamp, with the batch's
    new CRC as the check) make the sum stale: it is set aside, the pass checks the new bytes,
    and they are what the WAL keeps."""
    path = str(tmp_path / "wal")
    w = wal_at(path, "threads")
    payload = batch_like(120_000, 7)
    frame, off = frame_with(payload)
    placed.offer(frame, off, len(payload), 21, crc32c.crc32c(payload[21:]))
    frame[off + 40:off + 48] = b"STAMPED!"
    stamped = bytes(frame[off:off + len(payload)])
    head = ENG.pack(4, 0, 1)
    r = w.append_loop((head, memoryview(frame)[off:off + len(payload)]), 4,
                      (ENG.size + 21, crc32c.crc32c(stamped[21:])))
    w.flush()
    assert await r.future == 0
    assert w.stats["placed_records"] == 1 and w.stats["placed_summed"] == 0
    w2 = DeltaWAL(WALConfig(path=path, capacity=4 << 20))
    assert list(w2.open()) == [(0, head + stamped)]
    w2.close()
    w.close()
