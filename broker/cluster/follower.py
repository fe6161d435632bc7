"""KIP-392, fetch from the closest replica: the leader sends a consumer to a broker of the
consumer's rack, and that broker serves the partition from the object store although it does
not lead it.

Every byte a leader uploads is in the shared object store, committed in the metadata
database, so any broker can read it. The rules:

- The leader (``preferred_replica``) answers a Fetch (v11+, ``rack_id`` set,
  read_uncommitted) with ``preferred_read_replica`` = a live broker of the consumer's rack
  among the partition's reported replicas (Metadata lists it, so Java's ``nodeIfOnline``
  accepts it) and no records, when the leader is in another rack and the fetch offset is
  below the stream's uploaded offset (that data is in the object store).
- That broker (``FollowerReads``) serves Fetch for the partition from the committed objects
  only, never at or past the stream's committed end offset (``s3_streams.end_offset``). The
  engine uploads only durable (WAL-confirmed) data, so the committed end never passes the
  leader's high watermark: nothing a consumer reads from a follower can vanish. The follower
  reports that committed end as the partition's high watermark.
- The tail beyond the uploaded offset lives only in the leader's WAL and log cache. A
  follower whose consumer reached the committed end answers no records and
  ``preferred_read_replica`` = the leader, so the consumer reads the tail from the leader
  (long-poll, no added latency); the leader sends it back to its rack only once it falls
  behind the uploaded offset again (catch-up and backlog reads are the bulk of the bytes).
- read_committed fetches are never redirected (a follower does not know the leader's open
  transactions, so it has no last stable offset).
- ListOffsets and OffsetForLeaderEpoch stay with the leader, as Kafka's consumers send them
  there; a follower answers NOT_LEADER_OR_FOLLOWER to them, as Kafka does.

A follower learns a stream's committed end from the metadata database, at most every
``REFRESH_S`` or when a consumer asks for an offset at or past what it knows.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from protocol import ErrorCode

from storage.reader import ObjectReader

from ..partition import ReadResult

log = logging.getLogger("broker.cluster")

REFRESH_S = 0.5          # how stale a follower's view of a stream's committed end may be
MIN_REFRESH_S = 0.05     # forced refreshes (a consumer at the end) at most this often
RETRY_S = 2.0            # after a failed refresh (metadata database unreachable)


class FollowerView:
    """One stream as the metadata database has it (committed objects only)."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.start = 0
        self.end = 0                 # committed end: nothing at or past it is served
        self.refreshed = -1.0
        self.warned = 0.0
        self.retry_at = 0.0          # after a failed refresh: no new attempt before this
        self.lock = asyncio.Lock()
        self.closed = False


class FollowerReads:
    """This broker's follower views, refreshed from the metadata database on demand."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.views: dict[int, FollowerView] = {}
        self.served: set[tuple[str, int]] = set()      # logged once per partition
        self.fetches = 0                               # follower fetches answered with data
        self.bytes = 0                                 # ... and their bytes
        self.redirects = 0                             # leader: consumers sent to their rack
        self._reader: ObjectReader | None = None

    @property
    def reader(self) -> ObjectReader:
        """An object reader of its own: the engine's reader (and its cleanup, which deletes
        objects of streams the engine does not know) never sees another leader's objects."""
        if self._reader is None:
            eng = self.broker.store
            c = eng.config
            self._reader = ObjectReader(eng.store, eng.cold_io, max(c.block_cache_bytes // 4,
                                                                    8 << 20),
                                        c.readahead_max_bytes)
        return self._reader

    def available(self) -> bool:
        """Only the object store engine has committed objects to read (not mem://)."""
        eng = self.broker.store
        return all(hasattr(eng, a) for a in ("reader", "meta", "io", "cold_io", "config"))

    async def view(self, topic: Any, index: int, force: bool = False) -> FollowerView | None:
        """The follower view of a partition this broker does not lead (None without an
        object store engine)."""
        if not self.available():
            return None
        sid = topic.stream_ids[index]
        v = self.views.get(sid)
        if v is None:
            v = self.views[sid] = FollowerView(sid)
        age = REFRESH_S if not force else MIN_REFRESH_S
        if time.monotonic() < v.retry_at:
            if v.refreshed < 0:
                raise RuntimeError("metadata database unreachable a moment ago")
            return v
        if time.monotonic() - v.refreshed > age:
            async with v.lock:
                if time.monotonic() - v.refreshed > age:
                    try:
                        await self._refresh(topic, index, v)
                    except Exception as e:  # noqa: BLE001 - e.g. metadata database cut
                        # what was committed stays committed: serve the last view (if
                        # any) meanwhile, and look again in RETRY_S
                        now = time.monotonic()
                        v.retry_at = now + RETRY_S
                        if v.refreshed < 0:
                            raise
                        if now - v.warned > 10:
                            v.warned = now
                            log.warning("follower view not refreshed topic=%s partition=%d: "
                                        "%s", topic.name, index, e)
        return v

    async def _refresh(self, topic: Any, index: int, v: FollowerView) -> None:
        eng = self.broker.store
        m = await eng.io(eng.meta.stream, v.stream_id)
        if m is None or m.deleted:
            v.closed = True
            return
        if m.end_offset != v.end or v.refreshed < 0:
            self.reader.replace_stream(v.stream_id,
                                       await eng.io(eng.meta.stream_ranges, v.stream_id))
        v.start, v.end = m.start_offset, m.end_offset
        v.refreshed = time.monotonic()

    async def read(self, topic: Any, index: int, v: FollowerView, offset: int,
                   max_bytes: int) -> ReadResult:
        """Batches from the committed objects from ``offset`` on, below the committed end.
        At the end: no batches (the caller points the consumer to the leader)."""
        if offset >= v.end:      # the leader may have uploaded more since: look again
            try:
                v = await self.view(topic, index, force=True) or v
            except Exception as e:  # noqa: BLE001 - metadata unreachable: what we know
                log.warning("follower view failed topic=%s partition=%d: %s",
                            topic.name, index, e)
        res = ReadResult(high_watermark=v.end, last_stable_offset=v.end,
                         log_start_offset=v.start)
        if offset < v.start:
            # retention moved the log start: OFFSET_OUT_OF_RANGE sends Java and librdkafka
            # back to the leader, which answers it with the partition's own offsets
            res.error = ErrorCode.OFFSET_OUT_OF_RANGE
            return res
        if offset >= v.end:
            return res          # the tail: only the leader has it
        try:
            batches = await self.reader.read(v.stream_id, offset, max(max_bytes, 1), v.end,
                                            first_required=True)
        except Exception as e:  # noqa: BLE001 - e.g. objects compacted or deleted meanwhile
            log.warning("follower read failed topic=%s partition=%d offset=%d: %s",
                        topic.name, index, offset, e)
            v.refreshed = -1.0
            return res                     # nothing: the consumer goes back to the leader
        res.batches = [b for b in batches if b.base_offset < v.end]
        if res.batches:
            self.fetches += 1
            self.bytes += res.size
            if (topic.name, index) not in self.served:
                self.served.add((topic.name, index))
                log.info("serving fetches as a follower (KIP-392) topic=%s partition=%d "
                         "committed_end=%d", topic.name, index, v.end)
        return res


def preferred_replica(cluster: Any, topic: Any, index: int, rack: str) -> int:
    """The leader's choice for a consumer in ``rack``: a live broker of that rack among the
    partition's reported replicas, not the leader; -1 to stay with the leader."""
    if not rack or (cluster.rack or "") == rack:
        return -1
    leader, _ = cluster.leader(topic, index)
    if leader != cluster.node_id:
        return -1
    for n in cluster.replicas(topic, index, leader)[1:]:
        b = cluster.live.get(n)
        if b is not None and b.state == "live" and (b.rack or "") == rack:
            return n
    return -1


def is_replica(cluster: Any, topic: Any, index: int) -> bool:
    """This broker is among the replicas Metadata reports for the partition."""
    leader, _ = cluster.leader(topic, index)
    return leader >= 0 and cluster.node_id in cluster.replicas(topic, index, leader)


class Redirected:
    """A Fetch slot the leader answers with ``preferred_read_replica`` and no records."""

    def __init__(self, partition: Any, node: int) -> None:
        self.partition = partition
        self.node = node

    @property
    def high_watermark(self) -> int:
        return self.partition.high_watermark

    @property
    def last_stable_offset(self) -> int:
        return self.partition.last_stable_offset

    @property
    def log_start_offset(self) -> int:
        return self.partition.log_start_offset

    async def read(self, offset: int, max_bytes: int, read_committed: bool = False) -> ReadResult:
        return ReadResult(high_watermark=self.high_watermark,
                          last_stable_offset=self.last_stable_offset,
                          log_start_offset=self.log_start_offset)


class FollowerSlot:
    """A Fetch slot this broker serves as a follower from the object store."""

    def __init__(self, reads: FollowerReads, topic: Any, index: int, view: FollowerView,
                 leader: int) -> None:
        self.reads, self.topic, self.index, self.view, self.leader = \
            reads, topic, index, view, leader

    @property
    def high_watermark(self) -> int:
        return self.view.end

    @property
    def last_stable_offset(self) -> int:
        return self.view.end

    @property
    def log_start_offset(self) -> int:
        return self.view.start

    async def read(self, offset: int, max_bytes: int, read_committed: bool = False) -> ReadResult:
        return await self.reads.read(self.topic, self.index, self.view, offset, max_bytes)


def follower_reads(broker: Any) -> FollowerReads:
    fr = getattr(broker, "_follower_reads", None)
    if fr is None:
        fr = broker._follower_reads = FollowerReads(broker)
    return fr


async def route(cluster: Any, broker: Any, topic: Any, index: int, rack: str, offset: int,
                part: Any, err: int) -> tuple[Any, int]:
    """KIP-392 for one partition of a Fetch from a consumer in ``rack`` (read_uncommitted):
    (slot, error) - the leader's redirect, a follower read, or ``(part, err)`` unchanged."""
    if part is not None and not err:
        node = preferred_replica(cluster, topic, index, rack)
        if node >= 0 and part.log_start_offset <= offset < \
                getattr(part.stream, "uploaded_offset", -1):
            follower_reads(broker).redirects += 1
            return Redirected(part, node), 0
        return part, err
    if err == ErrorCode.NOT_LEADER_OR_FOLLOWER and is_replica(cluster, topic, index):
        reads = follower_reads(broker)
        try:
            v = await reads.view(topic, index)
        except Exception as e:  # noqa: BLE001 - metadata unreachable: the leader serves it
            log.warning("follower view failed topic=%s partition=%d: %s", topic.name, index, e)
            return part, err
        if v is not None and not v.closed:
            return FollowerSlot(reads, topic, index, v, cluster.leader(topic, index)[0]), 0
    return part, err


def waits(slot: Any) -> bool:
    """A slot the long-poll parks on (a Partition); redirects and follower reads answer at
    once (a follower has no appends to wait for: at its end the consumer goes to the leader)."""
    return slot is not None and not isinstance(slot, (Redirected, FollowerSlot))


def preferred_read_replica(slot: Any, result: ReadResult) -> int:
    """The Fetch answer's ``preferred_read_replica`` for one slot: where the leader sends the
    consumer, or (a follower at the end of what is in the object store) back to the leader."""
    if isinstance(slot, Redirected):
        return slot.node
    if isinstance(slot, FollowerSlot) and not result.batches and not result.error:
        return slot.leader
    return -1
