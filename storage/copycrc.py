"""Copy a payload into a buffer and return its CRC-32C, reading it once.

The produce path copies each payload into an aligned WAL block and later into an object
buffer, checksumming it both times. ``copy_crc`` does the copy and the checksum in one pass in
C (storage/_copycrc.c, built by ``pip install -e .`` through setup.py; 20-25 % less CPU than
memmove + crc32c on 1 MiB, the interpreter lock released from 64 KiB). Without the compiled
extension (no compiler at install time, a worktree not built in place, no SSE4.2) the same
function runs as a slice copy + the crc32c package, and one warning line says so."""
from __future__ import annotations

import logging

import crc32c

log = logging.getLogger(__name__)

try:
    from . import _copycrc
except ImportError as _e:   # not built: the pure-Python path
    _copycrc = None
    _why = f"not built ({_e})"
_copycrc_module = _copycrc        # read_pieces and write_pieces need no SSE4.2
if _copycrc is not None:
    _why = "" if _copycrc.HARDWARE else "no SSE4.2 CRC-32C instruction on this CPU"
    if not _copycrc.HARDWARE:
        _copycrc = None

NATIVE = _copycrc is not None
_warned = False


def warn_if_missing() -> None:
    """One warning line (once per process) when copies fall back to the pure-Python path; the
    broker calls it at start-up so the slower path is visible in its log."""
    global _warned
    if not NATIVE and not _warned:
        _warned = True
        log.warning("storage._copycrc %s: payloads are copied and checksummed in two passes "
                    "(build it with `pip install -e .` or `python setup.py build_ext --inplace`)",
                    _why)


def _copy_crc_py(dst, offset: int, src, value: int = 0) -> int:
    """dst[offset:offset + len(src)] = src; return crc32c(src, value)."""
    n = len(src)
    crc = crc32c.crc32c(src, value)
    dst[offset:offset + n] = src
    return crc


def _copy_crc_split_py(dst, offset: int, src, value: int, split: int) -> tuple[int, int]:
    """copy_crc(dst, offset, src, value) plus crc32c(src[split:]): (crc, tail crc)."""
    mv = memoryview(src).cast("B")
    head = copy_crc(dst, offset, mv[:split], value)
    tail = copy_crc(dst, offset + split, mv[split:])
    return crc32c.crc32c(mv[split:], head), tail


copy_crc = _copycrc.copy_crc if NATIVE else _copy_crc_py


def _copy_record_py(dst, at: int, pos: int, head, body) -> None:
    """copy_record without the extension: the body (head + body) at ``at`` + 24, then its
    record header (storage/wal/format.pack_record_header) at ``at``."""
    from .wal.format import RECORD_HEADER_SIZE, pack_record_header
    n = len(head) + len(body)
    if at < 0 or at + RECORD_HEADER_SIZE + n > len(dst):
        raise ValueError("copy_record: record does not fit at that offset")
    o = at + RECORD_HEADER_SIZE
    crc = copy_crc(dst, o, head)
    crc = copy_crc(dst, o + len(head), body, crc)
    pack_record_header(dst, at, n, pos, crc)


# one WAL record - header + body of (head, body), the CRC in the copy - in one call
# (DeltaWAL._reserve's common case); a stale in-place build without it runs the Python one
copy_record = getattr(_copycrc, "copy_record", None) or _copy_record_py

# the object encoder's per-record work in C (storage/objects/format.py uses them when present;
# None without the extension or with a stale in-place build that predates them)
encode_blocks = getattr(_copycrc, "encode_blocks", None)
# encode_blocks for a streamed put that also writes each full window to the object's O_DIRECT
# file, in the same release of the interpreter lock (StreamEncoder.fill_writing); None without
# the extension or with a stale build
encode_write = getattr(_copycrc, "encode_write", None)
object_size_steps = getattr(_copycrc, "object_size_steps", None)
# the gather put: an object's layout with large checked payloads written straight from their
# memory, and its writes (storage/objects/format.py GatherSource); None without the extension
# or with a stale build
gather_layout = getattr(_copycrc, "gather_layout", None)
gather_write = getattr(_copycrc, "gather_write", None)
# an extension built in place before copy_crc_split existed (a worktree's stale build) lacks
# it: the split copy then runs as two copy_crc calls and a pass over the tail
copy_crc_split = getattr(_copycrc, "copy_crc_split", None) or _copy_crc_split_py
# crc_split(src, value, split) -> (crc32c(src, value), crc32c(src[split:])) in one pass, no
# copy (the WAL's records received in place); None without the extension (or a stale build):
# the WAL then copies those records as any other
crc_split = getattr(_copycrc, "crc_split", None) if NATIVE else None

def _place_record_py(region, head, payload, pos: int, split: int, want: int,
                     summed_from: int = -1, summed: int = 0) -> int | None:
    """place_record without the extension (or with a stale build): the same checks, CRCs and
    writes in Python; ``payload`` must be the region's bytes after the two headers. A sum
    from the receive (``summed``: CRC of payload[summed_from:]) equal to ``want`` stands for
    the pass over payload[split:] when it starts there."""
    from .wal.format import ALIGN_DOWN, ALIGN_MASK, RECORD_HEADER_SIZE, pack_record_header
    h, k = len(head), len(payload)
    size = RECORD_HEADER_SIZE + h + k
    view = memoryview(region)
    if len(view) != (size + ALIGN_MASK) & ALIGN_DOWN or \
            view[RECORD_HEADER_SIZE + h:size] != memoryview(payload).cast("B"):
        raise ValueError("place_record: payload not in place in the region")
    if split > k:
        raise ValueError("place_record: split outside the payload")
    if split >= 0 and not (summed_from == split and summed == want):
        tail = crc32c.crc32c(memoryview(payload).cast("B")[split:])
        if tail != want:
            return tail
    crc = crc32c.crc32c(payload, crc32c.crc32c(head))
    view[RECORD_HEADER_SIZE:RECORD_HEADER_SIZE + h] = head
    pack_record_header(view, 0, h + k, pos, crc)
    view[size:] = bytes(len(view) - size)
    return None


# a WAL record received in place (DeltaWAL._reserve_placed): its CRCs in one pass, then its
# headers and the zeroed tail of its last page, in one call (or nothing, on a CRC mismatch)
place_record = getattr(_copycrc, "place_record", None) or _place_record_py
# the address of a writable buffer (storage/wal/placed.py); None without the extension
buffer_address = getattr(_copycrc_module, "buffer_address", None)

# CRC-32C alone, crc(data, value=0) as crc32c.crc32c: in C folded with VPCLMULQDQ where the
# CPU has it (_copycrc.FOLD, FOLD_BITS 512 on AVX-512: 1 MiB 0.018 ms hot / 0.045 cold against
# the package's 0.037 / 0.085; 256 on AVX2-only CPUs such as Zen 3: 5-27 % under the crc32
# instruction), else the crc32 instruction; the crc32c package without the extension
crc = _copycrc.crc if NATIVE else crc32c.crc32c

# the cold path's paced span reads, one piece at a time on the device without taking the
# interpreter lock per piece (storage/objects/store.py); None without the extension (or with
# a stale build of it): the store then loops over the pieces in Python
read_pieces = getattr(_copycrc_module, "read_pieces", None)
# a cold span's read and its blocks' CRC-32Cs in one call releasing the interpreter lock once
# (storage/objects/store.py: FileObjectStore.get_ranges_crc); None without the extension, a
# stale build of it, or SSE4.2 (then the blocks are checked by crc above, one call each)
read_span_crcs = getattr(_copycrc, "read_span_crcs", None) if NATIVE else None
# the cold read buffer pool's fresh buffers: mmap (+ MADV_HUGEPAGE) with the interpreter lock
# released (storage/objects/buffers.py); None without the extension or with a stale build of it
map_buffer = getattr(_copycrc_module, "map_buffer", None)
# the exact type of what it returns (the pool takes back only its own buffers)
MappedBuffer = type(map_buffer(4096, False)) if map_buffer is not None else None
# large request frames in huge-page slabs faulted in once (broker/frames.py); None likewise:
# the frames are then bytearrays
frame_arena = getattr(_copycrc_module, "frame_arena", None)
# a buffer's pages faulted in a write per page, the interpreter lock released (broker/frames.py
# prefill, storage/objects/buffers.py fresh read buffers: not one madvise, nor the O_DIRECT read
# itself, which fault pages in under mmap_lock across the buffer); None likewise
fault_in = getattr(_copycrc_module, "fault_in", None)
# the O_DIRECT object writes' pieces in one call that releases the interpreter lock once
# (storage/objects/store.py); None likewise: the store then writes the pieces in Python
write_pieces = getattr(_copycrc_module, "write_pieces", None)
