"""Record compression codecs as Kafka uses them (codec ids from batch attributes bits 0-2).

gzip (zlib), snappy with Kafka's xerial framing (raw snappy accepted on input), LZ4 frame and
zstd; all through well-kept C-backed libraries.  Decompression is bounded so a tiny bomb
cannot exhaust memory.
"""
from __future__ import annotations

import struct
import zlib

import cramjam
import lz4.frame
import zstandard

from .errors import CorruptRecordError, UnsupportedCompressionError

NONE, GZIP, SNAPPY, LZ4, ZSTD = 0, 1, 2, 3, 4
CODEC_NAMES = {NONE: "none", GZIP: "gzip", SNAPPY: "snappy", LZ4: "lz4", ZSTD: "zstd"}
MAX_DECOMPRESSED = 256 << 20  # a batch can never legitimately inflate beyond this

_XERIAL_MAGIC = b"\x82SNAPPY\x00"
_XERIAL_HEADER = _XERIAL_MAGIC + struct.pack(">ii", 1, 1)
_XERIAL_BLOCK = 32 << 10


def compress(codec: int, data: bytes | bytearray | memoryview) -> bytes:
    """Compress ``data`` the way Kafka clients do for ``codec``."""
    if codec == NONE:
        return bytes(data)
    if codec == GZIP:
        c = zlib.compressobj(6, zlib.DEFLATED, 31)
        return c.compress(data) + c.flush()
    if codec == SNAPPY:
        mv = memoryview(data)
        parts = [_XERIAL_HEADER]
        for i in range(0, len(mv), _XERIAL_BLOCK):
            block = bytes(cramjam.snappy.compress_raw(mv[i:i + _XERIAL_BLOCK]))
            parts.append(struct.pack(">i", len(block)))
            parts.append(block)
        return b"".join(parts)
    if codec == LZ4:
        return lz4.frame.compress(bytes(data))
    if codec == ZSTD:
        return zstandard.ZstdCompressor(level=3).compress(bytes(data))
    raise UnsupportedCompressionError(f"unknown compression codec {codec}")


def decompress(codec: int, data: bytes | bytearray | memoryview,
               max_size: int = MAX_DECOMPRESSED) -> bytes:
    """Inflate a compressed record payload; CorruptRecordError on damage or excess size."""
    if codec == NONE:
        return bytes(data)
    try:
        if codec == GZIP:
            out = _gzip_decompress(bytes(data), max_size)
        elif codec == SNAPPY:
            out = _snappy_decompress(memoryview(data), max_size)
        elif codec == LZ4:
            d = lz4.frame.LZ4FrameDecompressor()
            out = d.decompress(bytes(data), max_length=max_size + 1)
        elif codec == ZSTD:
            reader = zstandard.ZstdDecompressor().stream_reader(bytes(data),
                                                                read_across_frames=True)
            out = reader.read(max_size + 1)
        else:
            raise UnsupportedCompressionError(f"unknown compression codec {codec}")
    except (UnsupportedCompressionError, CorruptRecordError):
        raise
    except Exception as exc:  # each library raises its own error types on bad input
        raise CorruptRecordError(f"cannot decompress {CODEC_NAMES[codec]}: {exc}") from None
    if len(out) > max_size:
        raise CorruptRecordError(f"{CODEC_NAMES[codec]} payload inflates beyond {max_size} bytes")
    return bytes(out)


def _gzip_decompress(data: bytes, max_size: int) -> bytes:
    """gzip members may be concatenated (Java's GZIPInputStream reads them all)."""
    parts = []
    total = 0
    while data:
        d = zlib.decompressobj(47)  # gzip or zlib header, auto-detected
        chunk = d.decompress(data, max_size + 1 - total)
        parts.append(chunk)
        total += len(chunk)
        if total > max_size:
            break
        if not d.eof:
            raise CorruptRecordError("truncated gzip stream")
        data = d.unused_data
    return b"".join(parts)


def _snappy_raw(block: memoryview, max_size: int) -> bytes:
    # the raw format declares its length up front: check it before anything is allocated
    if cramjam.snappy.decompress_raw_len(block) > max_size:
        raise CorruptRecordError("snappy payload inflates too much")
    return bytes(cramjam.snappy.decompress_raw(block))


def _snappy_decompress(mv: memoryview, max_size: int) -> bytes:
    if bytes(mv[:8]) != _XERIAL_MAGIC:
        return _snappy_raw(mv, max_size)
    pos = 16
    out = []
    total = 0
    while pos < len(mv):
        if pos + 4 > len(mv):
            raise CorruptRecordError("truncated xerial snappy block")
        (n,) = struct.unpack_from(">i", mv, pos)
        pos += 4
        if n < 0 or pos + n > len(mv):
            raise CorruptRecordError("bad xerial snappy block length")
        block = _snappy_raw(mv[pos:pos + n], max_size - total)
        total += len(block)
        if total > max_size:
            raise CorruptRecordError("snappy payload inflates too much")
        out.append(block)
        pos += n
    return b"".join(out)
