"""Object format: data blocks, an index block and a footer (the layout of AutoMQ's S3Stream objects).

Layout of one object::

    [data block]* [index block] [footer]

Data block: a 14-byte header (magic 0x5A, flags, record count, data length, CRC-32C of the data)
followed by stream records, each a 33-byte header (magic 0x22, stream id, epoch, base offset,
last offset delta, payload length) and the opaque payload. Within a block, one stream's records
are contiguous and sorted by offset; blocks are sorted by (stream, offset).

Index block: fixed 36-byte entries (stream id, start offset, end offset delta, record count,
block position, block size) - one entry per (stream, data block) run - so a reader finds the
blocks of a range with one ranged GET of the index. Footer: 48 bytes (index position, index
length, CRC-32C of the index, zero padding, magic), so a reader fetches the tail first.

All integers are big-endian. Every structure is checked (magic, lengths, CRC) and a mismatch
raises CorruptObjectError, which the engine reports as a storage error for that range.
"""
from __future__ import annotations

import ctypes
import mmap
import struct
import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterable, Iterator, NamedTuple, Union

from .. import copycrc as _native
from ..copycrc import NATIVE as COPY_CRC_NATIVE, copy_crc
# CRC-32C alone (block and index checks, the encoder's small-record runs): storage._copycrc's
# folded CRC, ~2x the crc32c package on large buffers (1 MiB cold 0.045 vs 0.085 ms), the same
# values; the crc32c package itself without the extension
from ..copycrc import crc as _crc

BLOCK_MAGIC = 0x5A
RECORD_MAGIC = 0x22
FOOTER_MAGIC = 0x88E241B785F4CFF7

BLOCK_HEADER = struct.Struct(">BBiiI")          # magic, flags, record count, data length, crc32c
RECORD_HEADER = struct.Struct(">BqqqiI")        # magic, stream id, epoch, base offset, last delta, len
INDEX_ENTRY = struct.Struct(">qqiiqi")          # stream, start, end delta, records, position, size
FOOTER = struct.Struct(">qiI24sQ")              # index pos, index len, index crc32c, pad, magic
assert BLOCK_HEADER.size == 14 and RECORD_HEADER.size == 33
assert INDEX_ENTRY.size == 36 and FOOTER.size == 48

DEFAULT_BLOCK_SIZE = 512 << 10
# payloads from this size on are copied with the GIL released (an encode on a worker thread
# then holds the interpreter lock only for its per-record bookkeeping)
NOGIL_COPY_FROM = 64 << 10
# payloads from this size are copied and checksummed in one pass (storage._copycrc) while they
# are added; smaller ones are copied by slice and the block's CRC covers them when it closes
FUSED_COPY_FROM = 4096 if COPY_CRC_NATIVE else 1 << 62
MMAP_FROM = 1 << 20                 # encoded objects from this size live in an anonymous mmap
# records the C encoder (storage._copycrc.encode_blocks) adds between two clock reads of a
# sliced encode: it stops at the end of the block where this many were reached (~0.2 us each)
NATIVE_CHECK_EVERY = 256
Buffer = Union[bytearray, mmap.mmap]


class CorruptObjectError(Exception):
    """An object's bytes fail a magic, length or checksum check."""


class Record(NamedTuple):
    """One stream batch as stored: the payload covers offsets [base_offset, base_offset + count)."""

    stream_id: int
    base_offset: int
    count: int
    payload: bytes | memoryview

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.count


class IndexEntry(NamedTuple):
    """Where one stream's run of records sits inside an object."""

    stream_id: int
    start_offset: int
    end_offset: int
    record_count: int
    position: int
    size: int


@dataclass
class StreamRange:
    """The offsets of one stream an object holds (what the metadata store records)."""

    stream_id: int
    start_offset: int
    end_offset: int


class _IndexBuilder:
    """The index entries and per-stream ranges of an object being encoded (both encoders)."""

    def __init__(self) -> None:
        self.index: list[IndexEntry] = []
        # the object's ranges in stream order, filled as blocks close: a streamed put's list is
        # complete once the put returns (the engine's NewObject holds this very list)
        self.ranges: list[StreamRange] = []
        self._ranges: dict[int, StreamRange] = {}

    def _index_entry(self, e: IndexEntry) -> None:
        """Note a closed block's run of one stream (the index and the object's ranges)."""
        self.index.append(e)
        self._range(e.stream_id, e.start_offset, e.end_offset)

    def _range(self, stream_id: int, start: int, end: int) -> None:
        """Extend the object's range of ``stream_id`` to ``end`` (a new one from ``start``)."""
        rng = self._ranges.get(stream_id)
        if rng is None:
            rng = self._ranges[stream_id] = StreamRange(stream_id, start, end)
            self.ranges.append(rng)
        else:
            rng.end_offset = end


def _index_tail(index: list[IndexEntry], index_pos: int) -> bytes:
    """The index block and the footer that end an object whose index starts at ``index_pos``."""
    index_bytes = b"".join(INDEX_ENTRY.pack(e.stream_id, e.start_offset,
                                            e.end_offset - e.start_offset, e.record_count,
                                            e.position, e.size) for e in index)
    return index_bytes + FOOTER.pack(index_pos, len(index_bytes), _crc(index_bytes), bytes(24),
                                     FOOTER_MAGIC)


class ObjectEncoder(_IndexBuilder):
    """Serialises records (sorted by stream, offset) into one object, in steps (encode()).

    The object's exact size is computed from the payload lengths before anything is copied,
    so the buffer is allocated once and every payload is copied exactly once, straight to its
    place: a growing buffer would be reallocated (and copied whole, measured 5 ms for a
    40 MiB object) now and then. Encoding in steps lets the engine encode on the event
    loop in short slices (storage/loop_slices.py) instead of in a thread that would hold the
    GIL for the whole object."""

    def __init__(self, records: list[Record], block_size: int = DEFAULT_BLOCK_SIZE,
                 into: Buffer | None = None, size: int | None = None,
                 release_gil: bool = False) -> None:
        """``into``: a buffer to encode into (its first bytes become the object, returned as a
        memoryview of them) instead of a fresh one: the engine reuses one across uploads, as
        fresh memory costs a page fault per 4 KiB (~0.5 ms per MiB on this VM). ``size``:
        ``object_size(records, block_size)`` when the caller computed it already (the engine
        does, in slices on the loop: a pass over tens of thousands of records). Records may
        be any objects with Record's fields (the engine passes its cache entries).
        ``release_gil``: the C encoder copies each block with the interpreter lock released
        (an encode on a worker thread; on the event loop that would only add hand-offs)."""
        super().__init__()
        self.block_size = block_size
        if size is None:
            size = object_size(records, block_size)
        if into is not None and len(into) >= size:
            self.out: Buffer | memoryview = memoryview(into)[:size]
        else:
            self.out = _zeroed_buffer(size)
        if not isinstance(records, list):
            records = list(records)
        self._records = records
        # the C encoder when built (whole blocks per call, no per-record Python); ``_add``
        # below is the same layout in Python (the fallback, and the reference of the tests)
        self._native = _native.encode_blocks
        self._release_gil = release_gil
        self._next = 0                      # records[_next:] are still to be added
        self._at = 0                        # write cursor in ``out``
        self._block_pos = -1                # where the open block's header sits
        self._block_records = 0
        self._crc = 0                       # CRC-32C of the open block's body up to _crc_at
        self._crc_at = 0
        self._runs: list[list[int]] = []    # [stream, start, end, count] within the open block
        self._last: tuple[int, int] | None = None

    def encode(self, until: float | None = None, clock: Callable[[], float] = time.perf_counter
               ) -> bool:
        """Add the remaining records, or (with ``until``) at least one and then stop once
        ``clock()`` reaches it; True when every record is in."""
        records, add = self._records, self._add
        native = self._native
        if native is not None:
            while self._next < len(records):
                self._next, self._at, entries = native(
                    self.out, self._at, records, self._next, self.block_size,
                    NATIVE_CHECK_EVERY if until is not None else 0, self._release_gil)
                for entry in entries:
                    self._index_entry(IndexEntry(*entry))
                if until is not None and clock() >= until:
                    break
            return self._next >= len(records)
        while self._next < len(records):
            add(records[self._next])
            self._next += 1
            if until is not None and clock() >= until:
                break
        return self._next >= len(records)

    def _add(self, r: Record) -> None:
        """Copy one record into its block (closing the block once it passes block_size)."""
        key = (r.stream_id, r.base_offset)
        if self._last is not None and key < self._last:
            raise ValueError("records must be sorted by stream and offset")
        self._last = key
        out = self.out
        if self._block_pos < 0:
            self._block_pos = self._at
            self._at += BLOCK_HEADER.size     # filled in by _close_block
            self._crc, self._crc_at = 0, self._at
        n = len(r.payload)
        at = self._at
        RECORD_HEADER.pack_into(out, at, RECORD_MAGIC, r.stream_id, 0, r.base_offset,
                                r.count - 1, n)
        at += RECORD_HEADER.size
        if n >= FUSED_COPY_FROM:    # the CRC so far (this record's header included), then
            with memoryview(out) as mv, mv[self._crc_at:at] as before:     # copy + CRC
                crc = _crc(before, self._crc)
            self._crc = copy_crc(out, at, r.payload, crc)
            self._crc_at = at + n
        elif n < NOGIL_COPY_FROM or not _copy_nogil(out, at, r.payload, n):
            out[at:at + n] = r.payload
        self._at = at + n
        self._block_records += 1
        runs = self._runs
        if runs and runs[-1][0] == r.stream_id:
            runs[-1][2] = r.end_offset
            runs[-1][3] += 1
        else:
            runs.append([r.stream_id, r.base_offset, r.end_offset, 1])
        self._range(r.stream_id, r.base_offset, r.end_offset)
        if self._at - self._block_pos - BLOCK_HEADER.size >= self.block_size:
            self._close_block()

    def _close_block(self) -> None:
        if not self._block_records:
            return
        pos = self._block_pos
        hdr = BLOCK_HEADER.size
        length = self._at - pos - hdr
        with memoryview(self.out) as mv, mv[self._crc_at:self._at] as rest:
            crc = _crc(rest, self._crc)
        BLOCK_HEADER.pack_into(self.out, pos, BLOCK_MAGIC, 0, self._block_records, length, crc)
        size = self._at - pos
        for sid, start, end, cnt in self._runs:
            self.index.append(IndexEntry(sid, start, end, cnt, pos, size))
        self._block_pos = -1
        self._block_records = 0
        self._runs = []

    def finish(self) -> tuple[Buffer | memoryview, list[IndexEntry], list[StreamRange]]:
        """Close the last block, append the index and the footer; (object, index, ranges)."""
        if self._next < len(self._records):
            raise AssertionError("finish() before encode() added every record")
        self._close_block()
        tail = _index_tail(self.index, self._at)
        out = self.out
        if self._at + len(tail) != len(out):
            raise AssertionError(f"object size {self._at + len(tail)} != precomputed {len(out)}")
        out[self._at:] = tail
        return out, self.index, self.ranges


# the C encoder takes ``fit`` and ``base`` (stops before a block that does not fit: needed by
# StreamEncoder); False without the extension or with a build older than these arguments
STREAM_ENCODE = _native.encode_blocks is not None and \
    "fit=False" in (_native.encode_blocks.__doc__ or "")
# ... and encode_write (StreamEncoder.fill_writing); False without it (a stale build)
STREAM_WRITE = STREAM_ENCODE and _native.encode_write is not None


class StreamEncoder(_IndexBuilder):
    """One object encoded a window at a time (whole data blocks, then the index and footer)
    into a small buffer that a streamed put writes out and refills (FileObjectStore.put with
    a source): each put in flight then needs a few MiB of buffer instead of the whole object
    (28 MiB). Fresh huge pages cost ~2.3 s of CPU per GiB on the test VM: five 32 MiB encode
    buffers were ~0.36 s of every fresh broker's CPU (bench/HISTORY.md, session 30).

    The bytes are exactly ObjectEncoder's (the same C encoder, storage._copycrc.encode_blocks,
    block by block: a block's header carries its data's CRC, so a window holds whole blocks
    only). Needs the C encoder with ``fit`` (STREAM_ENCODE); the engine encodes whole objects
    otherwise. ``len()`` is the object's size; ``ranges`` fills as blocks are encoded and is
    complete once ``done``."""

    # fill_writing works (the C encoder with encode_write): the store's put then lets it write
    writes_windows = STREAM_WRITE

    def __init__(self, records: list[Record], block_size: int = DEFAULT_BLOCK_SIZE,
                 size: int | None = None, release_gil: bool = True) -> None:
        """``size``: object_size(records, block_size) when the caller has it; ``release_gil``:
        copy with the interpreter lock released (a put on a worker thread)."""
        if not STREAM_ENCODE:
            raise RuntimeError("StreamEncoder needs storage._copycrc with encode_blocks' fit")
        super().__init__()
        if not isinstance(records, list):
            records = list(records)
        self.block_size = block_size
        self.size = object_size(records, block_size) if size is None else size
        self._records = records
        self._release_gil = release_gil
        self._next = 0                  # records[_next:] are still to be encoded
        self._pos = 0                   # object bytes produced so far
        self._tail: bytes | None = None     # the index and footer, once every block is in
        self._tail_at = 0               # ... of which this much is produced

    def __len__(self) -> int:
        return self.size

    @property
    def done(self) -> bool:
        """Every byte of the object is produced."""
        return self._tail is not None and self._tail_at == len(self._tail)

    def fill(self, out: Buffer | memoryview, at: int) -> int:
        """Produce the object's next bytes into ``out[at:]`` - whole blocks (as many as fit),
        then the index and footer (as much as fits) - and return where they end. ``at``:
        bytes already in ``out`` before this window (produced, not yet written: the bytes
        right before ``out[at]`` in the object). Returns ``at`` when nothing fit (the next
        block is larger than ``len(out) - at``: the caller needs a larger buffer)."""
        return self._fill(out, at, -1, 0, 1)[0]

    def fill_writing(self, out: Buffer | memoryview, at: int, fd: int, chunk: int,
                     align: int) -> tuple[int, int]:
        """fill() that writes as it goes (needs STREAM_WRITE): each time ``out`` is full, its
        whole ``align`` units go to ``fd`` (an O_DIRECT file, ``out`` aligned) in ``chunk``
        pieces and the rest moves to its start - in C, in the same release of the
        interpreter lock as the window's copies (storage._copycrc.encode_write), no Python
        between windows. Returns (where the unwritten bytes in ``out`` end - they start at
        ``out[0]`` once something was written -, bytes written to ``fd``). It stops with the
        last window unwritten once every block is in (the index and footer then follow as
        in fill), when the next block is larger than ``out`` (nothing written for it: the
        caller needs a larger buffer), or after a short write (O_DIRECT refused: the
        unwritten window is the caller's to write). It always releases the interpreter lock,
        whatever ``release_gil`` says: a file write must not hold it."""
        return self._fill(out, at, fd, chunk, align)

    def _fill(self, out: Buffer | memoryview, at: int, fd: int, chunk: int, align: int
              ) -> tuple[int, int]:
        """fill (``fd`` < 0) or fill_writing: (end, bytes written to ``fd``)."""
        records = self._records
        end, written = at, 0
        if self._next < len(records):
            base = self._pos - at               # the object position of out[0]
            if fd < 0:
                self._next, end, entries = _native.encode_blocks(
                    out, at, records, self._next, self.block_size, 0, self._release_gil, True,
                    base)
            else:
                self._next, end, entries, written = _native.encode_write(
                    out, at, records, self._next, self.block_size, base, fd, chunk, align)
            for entry in entries:
                self._index_entry(IndexEntry(*entry))
            self._pos = base + written + end
            if self._next < len(records):
                return end, written
        if self._tail is None:
            self._tail = _index_tail(self.index, self._pos)
            if self._pos + len(self._tail) != self.size:
                raise AssertionError(f"object size {self._pos + len(self._tail)} != "
                                     f"precomputed {self.size}")
        n = min(len(self._tail) - self._tail_at, len(out) - end)
        with memoryview(out) as mv:
            mv[end:end + n] = self._tail[self._tail_at:self._tail_at + n]
        self._tail_at += n
        self._pos += n
        return end + n, written


# a payload is written straight from its memory from this size on (GatherSource): smaller
# ones are copied with their block (a gathered payload costs a block of its own, a gap of up to
# 4 KiB and two extra writes)
GATHER_FROM = 64 << 10
GATHER = _native.gather_layout is not None and _native.gather_write is not None
# the most bytes staged between two gathered payloads (a put's staging buffer is one of the
# store's streamed-put buffers, storage/objects/store.py PUT_RING_BYTES)
GATHER_STAGING_MAX = 8 << 20


class GatherSource(_IndexBuilder):
    """One object whose large payloads are written straight from their memory (the LogCache's
    frames) instead of being copied into an encode buffer: storage._copycrc's gather_write.

    A record qualifies when its payload is at least ``min_gather`` bytes and carries a
    ``check``: (split, crc), the CRC-32C of payload[split:] that the WAL verified at its
    append (CacheEntry.check). It gets a data block of its own, placed so that its payload has
    the same offset within a 4 KiB page in the object as in memory (a gap of < 4 KiB before
    the block: readers find blocks through the index alone), and its block CRC is carried:
    crc(record header + payload[:split]) combined with the checked one. Its whole pages are
    then written from its frame (io_uring WRITE_FIXED where the frame's slab is registered:
    no page pinned per write); the headers, its two partial pages, the other records' blocks
    (encoded as ObjectEncoder's, into a small staging buffer), the gaps and the index go
    through the staging buffer. The encode copy from cold frames was the largest upload cost
    left (bench/HISTORY.md, session 40).

    The layout is fixed here (sizes, index, ranges: the engine's metadata needs them before
    the put); ``write`` lays the same records out again in C and checks that it ends where
    the index starts. Build with ``gather_source``, which says None when nothing qualifies."""

    def __init__(self, records: list, block_size: int, min_gather: int, layout: tuple) -> None:
        super().__init__()
        self._records = records
        self.block_size = block_size
        self._min_gather = min_gather
        self.size, entries, self.gathered, self.staging_bytes, data_end = layout
        for entry in entries:
            self._index_entry(IndexEntry(*entry))
        self._tail = _index_tail(self.index, data_end)

    def __len__(self) -> int:
        return self.size

    def write(self, ring: object, fd: int, staging: Buffer, chunk: int, alloc: int
              ) -> tuple[int, int]:
        """Write the whole object to ``fd`` from offset 0 (see _copycrc.gather_write: ``ring``
        an io_uring or None, ``staging`` at least ``staging_bytes``, ``alloc`` bytes
        fallocated first); its last page is written whole, the caller truncates the file to
        ``len(self)``. Returns the bytes written and the pieces written from registered
        buffers (WRITE_FIXED)."""
        return _native.gather_write(ring, fd, self._records, self.block_size, self._min_gather,
                                    staging, chunk, alloc, self._tail)


def gather_source(records: list, block_size: int = DEFAULT_BLOCK_SIZE,
                  min_gather: int = GATHER_FROM, max_staging: int = GATHER_STAGING_MAX
                  ) -> GatherSource | None:
    """A GatherSource of ``records`` (sorted by stream and offset), or None: no C extension,
    no record qualifies, or a run of staged blocks between two gathered payloads larger than
    ``max_staging`` (the put's staging buffer)."""
    if not GATHER:
        return None
    layout = _native.gather_layout(records, block_size, min_gather)
    if not layout[2] or layout[3] > max_staging:
        return None
    return GatherSource(records, block_size, min_gather, layout)


def _copy_nogil(out: Buffer | memoryview, at: int, payload: bytes | memoryview, n: int) -> bool:
    """Copy ``payload`` to ``out[at:at + n]`` with the interpreter lock released (ctypes'
    memmove), so an encode on a worker thread does not hold the event loop for its copies;
    False when a buffer cannot be exported this way (read-only: the caller slices instead)."""
    try:
        src = (ctypes.c_char * n).from_buffer(payload)
        dst = (ctypes.c_char * n).from_buffer(out, at)
    except (TypeError, ValueError):
        return False
    ctypes.memmove(dst, src, n)
    return True


def _zeroed_buffer(size: int) -> Buffer:
    """A writable buffer of ``size`` zero bytes. From 1 MiB on an anonymous mmap: its pages are
    zeroed by the kernel when first written, spread over the encoding; bytearray(size) zeroes
    them all at once (measured 5 ms for 10 MiB, an event-loop stall when encoding on the loop)."""
    if size >= MMAP_FROM:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    return bytearray(size)


def object_size_steps(records: list[Record], block_size: int,
                      every: int = 0) -> Generator[None, None, int]:
    """object_size() as a generator that yields after every ``every`` records (0: never) and
    returns the size: the event loop's sliced sizing (loop_slices.object_size_in_slices)
    runs the same block-closing rule as encode_object."""
    rec_hdr, blk_hdr = RECORD_HEADER.size, BLOCK_HEADER.size
    native = _native.object_size_steps
    if native is not None and isinstance(records, list):
        # the same pass in C (storage._copycrc), ``every`` records per call
        state: tuple[int, int, int, int | None] = (0, 0, -1, None)
        step = every or len(records)
        for i in range(0, len(records), step or 1):
            state = native(records, block_size, i, i + step, state)
            if every:
                yield
        total, entries, block, _ = state
        if block >= 0:
            total += blk_hdr + block
        return total + entries * INDEX_ENTRY.size + FOOTER.size
    total = 0
    entries = 0
    block = -1                          # bytes in the open block; -1: none open
    last_stream = None
    for i, r in enumerate(records):
        if block < 0:
            block = 0
            last_stream = None
        block += rec_hdr + len(r.payload)
        if r.stream_id != last_stream:
            entries += 1                # a new run, so a new index entry
            last_stream = r.stream_id
        if block >= block_size:
            total += blk_hdr + block
            block = -1
        if every and not i % every:
            yield
    if block >= 0:
        total += blk_hdr + block
    return total + entries * INDEX_ENTRY.size + FOOTER.size


def object_size(records: list[Record], block_size: int) -> int:
    """Bytes encode_object will produce for ``records``: the same block-closing rule, lengths
    only (one cheap pass, no copies)."""
    steps = object_size_steps(records, block_size)
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise AssertionError("object_size_steps yielded without ``every``")


def encode_object(records: Iterable[Record], block_size: int = DEFAULT_BLOCK_SIZE
                  ) -> tuple[Buffer, list[IndexEntry], list[StreamRange]]:
    """Serialise records (already sorted by stream, offset) into one object.

    Returns the object bytes, its index and the per-stream ranges it covers. A block is closed
    once it passes ``block_size``; a block never splits a record. Every payload is copied
    exactly once, straight into the object buffer (ObjectEncoder)."""
    enc = ObjectEncoder(list(records), block_size)
    enc.encode()
    return enc.finish()


def decode_footer(tail: bytes | memoryview, object_size: int) -> tuple[int, int, int]:
    """(index position, index length, index crc) from the last 48 bytes of an object."""
    if len(tail) < FOOTER.size:
        raise CorruptObjectError("object shorter than its footer")
    pos, length, crc, pad, magic = FOOTER.unpack_from(tail, len(tail) - FOOTER.size)
    if magic != FOOTER_MAGIC or pad != bytes(24):
        raise CorruptObjectError("bad footer magic")
    if pos < 0 or length < 0 or length % INDEX_ENTRY.size or pos + length + FOOTER.size != object_size:
        raise CorruptObjectError("footer points outside the object")
    return pos, length, crc


def decode_index(data: bytes | memoryview, crc: int) -> list[IndexEntry]:
    """Parse and check the index block."""
    if _crc(data) != crc:
        raise CorruptObjectError("index checksum mismatch")
    entries = []
    for sid, start, delta, cnt, pos, size in INDEX_ENTRY.iter_unpack(data):
        if delta < 0 or cnt < 0 or pos < 0 or size < BLOCK_HEADER.size:
            raise CorruptObjectError("bad index entry")
        entries.append(IndexEntry(sid, start, start + delta, cnt, pos, size))
    return entries


def decode_block(data: bytes | memoryview, body_crc: int | None = None) -> list[Record]:
    """Parse and check one data block (header included); payloads are views into ``data``.
    ``body_crc``: the CRC-32C of the block's body (the bytes after its header) when the
    caller computed it already (the cold read threads, in the same C call as the read: see
    FileObjectStore.get_ranges_crc); it is compared with the header's instead of computing
    it again."""
    mv = memoryview(data)
    if len(mv) < BLOCK_HEADER.size:
        raise CorruptObjectError("truncated block header")
    magic, flags, count, length, crc = BLOCK_HEADER.unpack_from(mv, 0)
    if magic != BLOCK_MAGIC or flags != 0 or length != len(mv) - BLOCK_HEADER.size or count < 0:
        raise CorruptObjectError("bad block header")
    body = mv[BLOCK_HEADER.size:]
    if (_crc(body) if body_crc is None else body_crc) != crc:
        raise CorruptObjectError("block checksum mismatch")
    out: list[Record] = []
    pos = 0
    for _ in range(count):
        if pos + RECORD_HEADER.size > len(body):
            raise CorruptObjectError("truncated record header")
        rmagic, sid, _epoch, base, delta, plen = RECORD_HEADER.unpack_from(body, pos)
        pos += RECORD_HEADER.size
        if rmagic != RECORD_MAGIC or delta < 0 or pos + plen > len(body):
            raise CorruptObjectError("bad record header")
        out.append(Record(sid, base, delta + 1, body[pos:pos + plen]))
        pos += plen
    if pos != len(body):
        raise CorruptObjectError("trailing bytes in block")
    return out


def decode_object(data: bytes | memoryview) -> Iterator[Record]:
    """Every record of a whole object (compaction, tests)."""
    mv = memoryview(data)
    pos, length, crc = decode_footer(mv[-FOOTER.size:], len(mv))
    seen: set[int] = set()
    for e in decode_index(mv[pos:pos + length], crc):
        if e.position in seen:
            continue
        seen.add(e.position)
        if e.position + e.size > pos:
            raise CorruptObjectError("index entry points outside the data")
        yield from decode_block(mv[e.position:e.position + e.size])
