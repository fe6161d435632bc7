"""In-memory StreamStore: no durability, for unit tests of the layers above storage."""
from __future__ import annotations

import bisect

import crc32c

from .stream import (Batch, OffsetOutOfRange, OffsetStream, PayloadChecksumError, Stream,
                     StreamStore)


class MemoryStream(OffsetStream):
    """A list of batches; appends are durable at once."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self._batches: list[Batch] = []
        self._bases: list[int] = []
        self._start = 0
        self._end = 0

    @property
    def confirmed_offset(self) -> int:
        return self._end

    checks_payloads = True

    async def append(self, payload: bytes | memoryview, base_offset: int, count: int,
                     check: tuple[int, int] | None = None) -> None:
        if base_offset != self._end:
            raise ValueError(f"append at {base_offset}, expected {self._end}")
        if check is not None and crc32c.crc32c(memoryview(payload)[check[0]:]) != check[1]:
            raise PayloadChecksumError("payload CRC-32C mismatch")
        self._batches.append(Batch(base_offset, count, bytes(payload)))
        self._bases.append(base_offset)
        self._end = base_offset + count

    async def read(self, start_offset: int, max_bytes: int) -> list[Batch]:
        if start_offset < self._start or start_offset > self._end:
            raise OffsetOutOfRange(f"{start_offset} not in [{self._start}, {self._end}]")
        i = max(bisect.bisect_right(self._bases, start_offset) - 1, 0)
        out: list[Batch] = []
        size = 0
        for b in self._batches[i:]:
            if b.next_offset <= start_offset:
                continue
            if out and size + len(b.payload) > max_bytes:
                break
            out.append(b)
            size += len(b.payload)
        return out

    async def trim(self, new_start_offset: int) -> None:
        if new_start_offset <= self._start:
            return
        self._start = min(new_start_offset, self._end)
        while self._batches and self._batches[0].next_offset <= self._start:
            self._batches.pop(0)
            self._bases.pop(0)


class MemoryStreamStore(StreamStore):
    """Streams kept in a dict; ids count up from 1."""

    def __init__(self) -> None:
        self._streams: dict[int, MemoryStream] = {}
        self._next_id = 1

    async def start(self) -> None:
        return None

    async def create_stream(self) -> Stream:
        s = MemoryStream(self._next_id)
        self._streams[s.stream_id] = s
        self._next_id += 1
        return s

    async def open_stream(self, stream_id: int) -> Stream:
        return self._streams[stream_id]

    async def delete_stream(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    async def close(self) -> None:
        return None
