"""The Stream a partition lives on: the only storage surface the broker uses.

A stream is an append-only sequence of opaque payloads, each covering a contiguous range of
offsets ``[base_offset, base_offset + count)``. Storage never looks inside a payload.
"""
from __future__ import annotations

import abc
from typing import NamedTuple


class StorageError(Exception):
    """A range could not be read or written (Kafka maps this to KAFKA_STORAGE_ERROR)."""


class RetriableStorageError(StorageError):
    """Temporary back-pressure (cache full of unuploaded data, WAL over capacity, store down)."""


class PayloadChecksumError(StorageError):
    """append(check=...): the payload's checked range did not have the caller's CRC-32C;
    nothing was appended (the broker answers CORRUPT_MESSAGE)."""


class OffsetOutOfRange(StorageError):
    """The requested offset lies below start_offset or above end_offset."""


class Batch(NamedTuple):
    """One appended payload as read back: offsets it covers and its bytes (possibly a memoryview)."""

    base_offset: int
    count: int
    payload: bytes | memoryview

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.count


class Stream(abc.ABC):
    """One partition's log. All methods are called from the event loop thread."""

    stream_id: int
    # append() takes ``check``: streams without it are handed payloads already checked (a
    # subclass of a stream that has it must keep the parameter when it overrides append)
    checks_payloads = False

    @property
    @abc.abstractmethod
    def start_offset(self) -> int:
        """First readable offset (log start offset)."""

    @property
    @abc.abstractmethod
    def end_offset(self) -> int:
        """Next offset to assign; includes appends not yet durable."""

    @property
    @abc.abstractmethod
    def confirmed_offset(self) -> int:
        """Every offset below this is durable (the high watermark)."""

    @abc.abstractmethod
    async def append(self, payload: bytes | memoryview, base_offset: int, count: int,
                     check: tuple[int, int] | None = None) -> None:
        """Append a payload; ``base_offset`` must equal ``end_offset`` at call time.

        ``end_offset`` advances synchronously (before the first await) so that callers can
        assign offsets to concurrent appends; the coroutine completes once the payload and every
        earlier payload of this stream are durable. Raises RetriableStorageError under
        back-pressure (nothing is appended in that case). ``check`` = (start, crc), only where
        ``checks_payloads``: payload[start:] must have that CRC-32C, else PayloadChecksumError
        before anything is appended (the engine computes it while copying into the WAL)."""

    @abc.abstractmethod
    async def read(self, start_offset: int, max_bytes: int) -> list[Batch]:
        """Batches from the one containing ``start_offset`` up to ``confirmed_offset``.

        Returns at least one batch when one exists, even if larger than ``max_bytes`` (KIP-74),
        then stops before exceeding ``max_bytes``. Empty list at the end of the stream.
        Raises OffsetOutOfRange below start_offset / above end_offset, StorageError when the
        data cannot be read (corrupt object)."""

    @abc.abstractmethod
    async def trim(self, new_start_offset: int) -> None:
        """Advance start_offset (retention, DeleteRecords); never moves backwards."""


class OffsetStream(Stream):
    """A Stream whose log start and end offsets are the fields ``_start`` and ``_end`` (set by
    the subclass: the engine's and the in-memory stream)."""

    _start: int
    _end: int

    @property
    def start_offset(self) -> int:
        return self._start

    @property
    def end_offset(self) -> int:
        return self._end


class StreamStore(abc.ABC):
    """Creates, opens and deletes streams; one per broker process (the storage engine)."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Open the WAL and metadata, recover what a crash left behind."""

    @abc.abstractmethod
    async def create_stream(self) -> Stream:
        """A new empty stream with a fresh id (persisted in the metadata store)."""

    @abc.abstractmethod
    async def open_stream(self, stream_id: int) -> Stream:
        """An existing stream, with every durable payload readable."""

    @abc.abstractmethod
    async def delete_stream(self, stream_id: int) -> None:
        """Drop a stream and, eventually, its objects."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush in-flight appends and stop background work (graceful shutdown)."""
