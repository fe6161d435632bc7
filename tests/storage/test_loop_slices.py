"""Encoding an object on the event loop in slices lets other callbacks run in between."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from storage.loop_slices import encode_object_in_slices
from storage.objects.format import Record, encode_object


def _records(n: int) -> list[Record]:
    return [Record(1, 3 * i, 3, bytes([i % 251]) * 700) for i in range(n)]


async def _turns_during(work: Awaitable[Any]) -> tuple[int, Any]:
    """(loop turns another task got while ``work`` ran, work's result)."""
    turns = 0
    done = False

    async def count_turns() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.ensure_future(count_turns())
    await asyncio.sleep(0)
    start = turns
    result = await work
    during = turns - start
    done = True
    await counter
    return during, result


async def test_sliced_encode_yields_to_the_loop_and_matches_encode_object() -> None:
    """With a zero slice the encoder yields after every record: a task that counts loop turns
    must get about one turn per record (without yields it would get none until the encode is
    over), and the bytes are those of encode_object."""
    recs = _records(200)
    during, (data, index, ranges) = await _turns_during(
        encode_object_in_slices(recs, 4096, slice_s=0.0))
    assert during >= len(recs) - 1
    want, want_index, want_ranges = encode_object(recs, 4096)
    assert bytes(data) == bytes(want)
    assert index == want_index
    assert [(r.stream_id, r.start_offset, r.end_offset) for r in ranges] == \
        [(r.stream_id, r.start_offset, r.end_offset) for r in want_ranges]


async def test_sliced_encode_does_not_yield_within_a_slice() -> None:
    """A long slice does the whole (small) object in one go, on the loop (a worker thread
    would let the counting task run meanwhile): slicing costs nothing when the work is
    short."""
    during, _ = await _turns_during(encode_object_in_slices(_records(20), 4096, slice_s=10.0))
    assert during == 0
