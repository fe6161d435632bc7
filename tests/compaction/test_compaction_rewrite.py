"""storage: rewrite a stream's objects through a payload filter (Kafka-free)."""
from __future__ import annotations

import pytest

import sys
import pathlib

from storage.engine import open_engine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "storage"))
from storage_helpers import fill, payload, small_config  # noqa: E402


async def _batches(stream, start: int = 0) -> list[tuple[int, int, bytes]]:
    out, off = [], start
    while off < stream.confirmed_offset:
        got = await stream.read(off, 64 << 10)
        assert got, f"no data at {off}"
        for b in got:
            out.append((b.base_offset, b.count, bytes(b.payload)))
            off = b.next_offset
    return out


async def test_rewrite_drops_and_shrinks_payloads_keeping_offsets(tmp_path) -> None:
    cfg = small_config(tmp_path, compaction_min_objects=2)
    eng = open_engine(cfg)
    await eng.start()
    try:
        s, other = await eng.create_stream(), await eng.create_stream()
        for _ in range(4):                        # several objects, stream set objects too
            await fill(s, 30)
            await fill(other, 3)
            await eng.flush()
        await fill(s, 5)                          # not uploaded yet: never rewritten
        other_before = await _batches(other)
        n_objects = len(eng.store.list())

        def keep(base: int, count: int, data, must_keep: bool):
            if must_keep or base % 20 == 0:
                return bytes(data[:10])           # shrunk
            return None                           # dropped: a gap in the offsets

        res = await s.rewrite(0, s.uploaded_offset, keep)
        assert (res.start, res.end) == (0, 600)
        assert res.objects_before >= 4 and res.objects_after == 1
        assert res.bytes_after < res.bytes_before / 10
        await eng.maintenance.purge()
        eng.drop_caches()
        got = await _batches(s)
        expect = [(b, 5, payload(s.stream_id, b)[:10]) for b in range(0, 600, 5)
                  if b % 20 == 0 or b == 595]
        assert got[:len(expect)] == expect
        assert [b for b, _, _ in got[len(expect):]] == list(range(600, 625, 5))
        assert await s.read(7, 1 << 20) and (await s.read(7, 1 << 20))[0].base_offset == 20
        assert await _batches(other) == other_before
        assert len(eng.store.list()) < n_objects
        # merging small objects afterwards keeps the sparse ranges readable
        await eng.flush()
        await eng.maintenance.compact()
        await eng.maintenance.purge()
        eng.drop_caches()
        assert (await _batches(s))[:len(expect)] == expect
    finally:
        await eng.close()
    eng = open_engine(cfg)                        # the rewritten layout survives a restart
    await eng.start()
    try:
        s2 = await eng.open_stream(s.stream_id)
        assert (await _batches(s2))[:len(expect)] == expect
    finally:
        await eng.close()


async def test_rewrite_refuses_to_drop_the_last_payload(tmp_path) -> None:
    eng = open_engine(small_config(tmp_path))
    await eng.start()
    try:
        s = await eng.create_stream()
        await fill(s, 10)
        await eng.flush()
        before = await _batches(s)
        with pytest.raises(ValueError):
            await s.rewrite(0, s.uploaded_offset, lambda *a: None)
        await eng.maintenance.purge()
        assert await _batches(s) == before        # nothing committed
    finally:
        await eng.close()


async def test_rewrite_keeps_other_streams_ranges_that_lie_between_rewritten_objects(
        tmp_path) -> None:
    """Another stream's records in the rewritten stream set objects are carried over, but its
    offsets in between live in an object the rewrite does not touch: the carried records must
    not claim those offsets (a fresh-clone CI run, with an upload tick between two appends,
    lost 'other' batches 10 and 35-40 to a carried range that spanned them)."""
    eng = open_engine(small_config(tmp_path, upload_interval_s=3600))
    await eng.start()
    try:
        s, other = await eng.create_stream(), await eng.create_stream()
        await fill(s, 3)
        await fill(other, 1)
        await eng.flush()                         # {s 0..15, other 0..5}
        await fill(other, 1)
        await eng.flush()                         # {other 5..10}: holds nothing of s
        await fill(s, 3)
        await fill(other, 1)
        await eng.flush()                         # {s 15..30, other 10..15}
        layout = sorted((r.stream_id, r.start_offset, r.end_offset)
                        for rs in eng.reader.objects.values() for r in rs)
        assert (other.stream_id, 5, 10) in layout and len(eng.reader.objects) == 3
        before = await _batches(other)
        res = await s.rewrite(0, s.uploaded_offset, lambda b, c, d, last: bytes(d[:10]))
        assert (res.start, res.end) == (0, 30)
        await eng.maintenance.purge()
        eng.drop_caches()
        assert await _batches(other) == before
        assert [b for b, _, _ in await _batches(s)] == list(range(0, 30, 5))
    finally:
        await eng.close()
    eng = open_engine(small_config(tmp_path, upload_interval_s=3600))
    await eng.start()                             # and so does the committed metadata
    try:
        assert await _batches(await eng.open_stream(other.stream_id)) == before
    finally:
        await eng.close()
