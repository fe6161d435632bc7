"""Objects whose data blocks are not contiguous (unreferenced bytes between them) read back
through every reader: the whole-object decode (compaction, maintenance.py) and the cold path's
ranged block reads (FileObjectStore.get_ranges_crc + decode_block, as reader.py). Readers find
blocks through the index's (position, size) only, so a writer may place a block wherever its
alignment wants it (a gather write of large payloads straight from their frames)."""
from __future__ import annotations

import random

from storage.objects.format import (FOOTER, INDEX_ENTRY, BLOCK_HEADER, FOOTER_MAGIC, IndexEntry,
                                    Record, decode_block, decode_footer, decode_index,
                                    decode_object, encode_object)
from storage.copycrc import crc
from storage.objects.store import FileObjectStore


def _with_gaps(data: bytes, rng: random.Random) -> tuple[bytes, list[IndexEntry]]:
    """``data`` (an encoded object) re-laid with 1-4095 garbage bytes before every block."""
    mv = memoryview(data)
    pos, length, icrc = decode_footer(mv[-FOOTER.size:], len(mv))
    index = decode_index(mv[pos:pos + length], icrc)
    out = bytearray()
    moved: dict[int, int] = {}
    for e in sorted(index, key=lambda e: e.position):
        if e.position not in moved:
            out += rng.randbytes(rng.randrange(1, 4096))
            moved[e.position] = len(out)
            out += mv[e.position:e.position + e.size]
    new = [e._replace(position=moved[e.position]) for e in index]
    ib = b"".join(INDEX_ENTRY.pack(e.stream_id, e.start_offset, e.end_offset - e.start_offset,
                                   e.record_count, e.position, e.size) for e in new)
    ipos = len(out)
    out += ib + FOOTER.pack(ipos, len(ib), crc(ib), bytes(24), FOOTER_MAGIC)
    return bytes(out), new


def _records(rng: random.Random) -> list[Record]:
    out = []
    for sid in (3, 5):
        off = 0
        for _ in range(40):
            n = rng.choice((10, 700, 5000, 70_000, 300_000))
            out.append(Record(sid, off, 2, rng.randbytes(n)))
            off += 2
    return out


def test_an_object_with_gaps_between_blocks_reads_back_everywhere(tmp_path) -> None:
    rng = random.Random(20)
    recs = _records(rng)
    data, _, _ = encode_object(recs, block_size=128 << 10)
    gapped, index = _with_gaps(bytes(data), rng)
    assert len(gapped) > len(data)
    want = [(r.stream_id, r.base_offset, r.count, bytes(r.payload)) for r in recs]
    # the whole-object decode (compaction)
    assert [(r.stream_id, r.base_offset, r.count, bytes(r.payload))
            for r in decode_object(gapped)] == want
    # the cold path: ranged block reads from a file store (O_DIRECT where the fs takes it)
    store = FileObjectStore(str(tmp_path), direct_writes=True)
    store.put("o", gapped)
    blocks = sorted({(e.position, e.size) for e in index})
    parts, crcs = store.get_ranges_crc("o", blocks, BLOCK_HEADER.size)
    got = []
    for part, body_crc in zip(parts, crcs):
        got.extend(decode_block(part, body_crc))
    assert [(r.stream_id, r.base_offset, r.count, bytes(r.payload)) for r in got] == want
    # one block at a time too (a reader's single-range fetch)
    for pos, size in blocks[:3]:
        (part,) = store.get_ranges("o", [(pos, size)])
        decode_block(part)
