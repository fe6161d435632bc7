"""Records received in place: buffers laid out so that a record's payload already sits where
the WAL writes it, and the WAL writes that record's pages straight from the buffer.

The broker receives a large Produce frame of one partition and one record batch into a
buffer (a bytearray from its frame pool) at an offset chosen so that the batch starts
``head`` bytes (the WAL's record header and the engine's stream-record header) past a 4 KiB
page boundary, and ``offer``s it here with the batch's place. When that very payload is then
appended (``DeltaWAL.append_loop``), the WAL ``take``s the buffer back: it writes the two
headers into the bytes before the payload (the request's already parsed envelope), zeroes the
tail up to the next page (bytes after the batch: parsed too) and writes those pages as a block
of their own - no copy of the payload into a block of its pool (bench/HISTORY.md, session 24).

``offer`` means: the bytes of ``buf`` outside ``[offset, offset + length)`` may be overwritten
once the payload is appended. A payload that is not exactly the offered one (several batches,
another partition's bytes), one whose place does not suit the WAL, or a buffer offered and
never appended simply takes the copy path. The registry holds at most MAX_OFFERED buffers
(the oldest are dropped: a connection closed with offered frames does not keep them).

An offer may carry the CRC-32C of ``payload[summed_from:]`` taken as the bytes arrived, while
the receive had just left them in the cache: when that sum is the batch check's CRC, the
WAL's pass reads only the bytes before ``summed_from`` (that pass over a whole frame ran at
the memory's speed: ~80 us per MiB on session 44's host against ~50 right after the receive).
A sum that is not the check's (bytes stamped since, a corrupt batch) is set aside.
"""
from __future__ import annotations

import ctypes
import functools

from ..copycrc import _copycrc_module, buffer_address
from .format import ALIGN_DOWN, ALIGN_MASK

MAX_OFFERED = 64

# id(buf) -> (buf, payload offset in buf, payload length, summed from, CRC-32C of the payload
# from there: -1 and 0 without one); the entry's reference keeps the id from being reused
# while it is here
_offered: dict[int, tuple[bytearray, int, int, int, int]] = {}


def _ctypes_address(buf) -> int:
    """The address of a writable buffer's first byte."""
    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c)
    finally:
        del c


# in C one call, without the two ctypes objects (twice per request received in place)
address = buffer_address or _ctypes_address


def place(buf: bytearray, start: int, head: int) -> int:
    """Where in ``buf`` (from ``start`` on) to put a payload so that the ``head`` bytes before
    it begin on a page: the payload's offset. The caller checks it still fits."""
    return start + head + (-(address(buf) + start) & ALIGN_MASK)


def offer(buf: bytearray, offset: int, length: int, summed_from: int = -1,
          summed: int = 0) -> None:
    """``buf[offset:offset + length]`` will be a payload that may be written in place;
    ``summed`` is the CRC-32C of its bytes from ``summed_from`` on, as received (-1: none)."""
    if len(_offered) >= MAX_OFFERED:
        del _offered[next(iter(_offered))]
    _offered[id(buf)] = (buf, offset, length, summed_from, summed)


def withdraw(buf) -> None:
    """Forget an offer (its request was answered: appended in place or not)."""
    if _offered:
        ent = _offered.get(id(buf))
        if ent is not None and ent[0] is buf:
            del _offered[id(buf)]


def offered() -> bool:
    return bool(_offered)


def _take_py(payload, head: int):
    """The writable block (a view of the offered buffer: ``head`` bytes, the payload, the
    rest of its last page) and the offer's sum (summed_from, summed) for ``payload`` if it is
    exactly an offered payload whose headers begin on a page; the offer is used up. None
    otherwise (nothing changes)."""
    if type(payload) is not memoryview:
        return None
    buf = payload.obj
    ent = _offered.get(id(buf))
    if ent is None or ent[0] is not buf:
        return None
    _buf, offset, length, summed_from, summed = ent
    del _offered[id(buf)]
    if len(payload) != length or payload.readonly or not payload.c_contiguous:
        return None
    base = address(buf)
    if address(payload) - base != offset:
        return None
    start = offset - head
    end = start + ((head + length + ALIGN_MASK) & ALIGN_DOWN)     # align_up, inline
    if start < 0 or (base + start) & ALIGN_MASK or end > len(buf):
        return None
    return memoryview(buf)[start:end], summed_from, summed


_take_offered = getattr(_copycrc_module, "take_offered", None)


# the WAL calls take once per large record: one C call (storage/_copycrc.c take_offered, the
# same checks over this registry) where the extension has it, no Python frame
take = functools.partial(_take_offered, _offered) if _take_offered is not None else _take_py
