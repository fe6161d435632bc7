"""One Kafka topic-partition over a storage Stream.

The produce path never decodes records: batches are split and validated in place (CRC-32C),
offsets are written into the batch headers and the bytes go to the stream as one payload per
produce request. The partition also owns what Kafka keeps next to a log: the idempotent
producers' sequence windows, a sparse time index (for ListOffsets by timestamp) and the waiters
that Fetch long-polls park on until an append becomes durable.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import protocol
from protocol import ErrorCode
from storage.stream import (Batch, OffsetOutOfRange, PayloadChecksumError, RetriableStorageError,
                            StorageError, Stream)

from .eager import Drive
from .failures import log_failure
from .producer_state import (NO_PRODUCER_ID, BatchMeta, PartitionProducers, ProducerError,
                             ProducerStore, idempotent_batches, producer_store_for)
from .transactions import PartitionTxns, coordinator_for, ensure_transactions
from .transactions.markers import build_marker, marker_fields

log = logging.getLogger(__name__)

COMPRESSION_ZSTD = 4
DEFAULT_MAX_MESSAGE_BYTES = 1048588
SNAPSHOT_EVERY_BATCHES = 1000
# a lone batch from this size on has its CRC checked by the stream, while the storage engine
# copies it into the WAL (one pass over the bytes instead of two; HISTORY.md session 16)
STREAM_CHECKS_CRC_FROM = 64 * 1024
try:    # protocol/_produce.c: the checks and stamping of plain batches in one call
    from protocol import _produce
    # a stale in-place build answers in another shape: the Python path instead
    _stamp_plain = _produce.stamp_plain if getattr(_produce, "STAMP_PLAIN_DEFERS_CRC", 0) \
        else None
except ImportError:  # pragma: no cover - the extension is optional
    _stamp_plain = None
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
REPLAY_READ_BYTES = 8 << 20
CHUNK_BYTES = 1 << 20
LONG_MAX = 2**63 - 1
LEADER_EPOCH = 0  # a single broker's, and the first leader's, epoch
TXN_ATTRS = protocol.batches.TRANSACTIONAL_MASK | protocol.batches.CONTROL_MASK
_EARLIER_FAILED = "an earlier append of this partition failed"
DEFAULT_ADMISSION_TIMEOUT_S = 5.0  # the engine's default backpressure_timeout_s
REPLAY_FOREGROUND_S = 0.5  # open() waits this long for the log-tail replay, then it goes on
                           # in the background (the object store may be down)
REPLAY_RETRY_MAX_S = 5.0


class _Outcome:
    """A task-less append's outcome (``append_now``): ``ok`` None until it is settled, then
    whether it and every earlier append of the partition are durable. What the next append
    reads (``_tail``) instead of an asyncio future: nothing awaits it but a task-path append
    taken behind it while it is still pending (rare: ``wait_future`` makes one for it then),
    so the common case costs no future, no done() and no set_result per Produce request.
    No ``__init__`` (a Python call): the class attributes are the defaults."""

    ok: bool | None = None
    fut: "asyncio.Future[bool] | None" = None

    def wait_future(self, loop: asyncio.AbstractEventLoop) -> "asyncio.Future[bool]":
        """A future resolved with ``ok`` when this outcome is settled (made once)."""
        fut = self.fut
        if fut is None:
            fut = self.fut = loop.create_future()
            if self.ok is not None:
                fut.set_result(self.ok)
        return fut


@dataclass(slots=True)
class AppendResult:
    """Outcome of one partition's part of a Produce request."""

    error: int = 0
    base_offset: int = -1
    log_append_time: int = -1
    log_start_offset: int = -1
    message: str | None = None


@dataclass(slots=True)
class ReadResult:
    """Outcome of one partition's part of a Fetch request."""

    error: int = 0
    high_watermark: int = -1
    last_stable_offset: int = -1
    log_start_offset: int = -1
    batches: list[Batch] = field(default_factory=list)
    aborted: list[tuple[int, int]] | None = None  # read_committed: (producer id, first offset)

    @property
    def size(self) -> int:
        return sum(len(b.payload) for b in self.batches)


class LogIndex:
    """Coarse index of the log in chunks of about CHUNK_BYTES of whole payloads.

    Per chunk: base offset, size and the running max timestamp up to that chunk. The first
    chunk whose running max is >= T holds the first batch with a timestamp >= T, so ListOffsets
    by timestamp reads one chunk; chunk sizes drive retention.bytes and chunk timestamps
    retention.ms. Memory stays bounded (one entry per ~1 MiB); rebuilt from batch headers on open."""

    def __init__(self) -> None:
        self.bases: list[int] = []
        self.sizes: list[int] = []
        self.run_max: list[int] = []
        self.total_bytes = 0
        self.end_offset = -1  # next offset after the last payload indexed (-1: none yet)

    def to_state(self) -> dict[str, Any]:
        return {"bases": self.bases, "sizes": self.sizes, "run_max": self.run_max,
                "end": self.end_offset}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "LogIndex":
        idx = cls()
        idx.bases = [int(x) for x in state["bases"]]
        idx.sizes = [int(x) for x in state["sizes"]]
        idx.run_max = [int(x) for x in state["run_max"]]
        if not len(idx.bases) == len(idx.sizes) == len(idx.run_max):
            raise ValueError("inconsistent log index")
        idx.total_bytes = sum(idx.sizes)
        idx.end_offset = int(state["end"])
        return idx

    @property
    def max_timestamp(self) -> int:
        return self.run_max[-1] if self.run_max else -1

    def add(self, base_offset: int, size: int, max_timestamp: int, end_offset: int) -> None:
        """Account one appended payload (whole payloads only: chunk bases are trim points)."""
        self.end_offset = end_offset
        if size <= 0:
            return
        prev = self.run_max[-1] if self.run_max else -1
        if self.sizes and self.sizes[-1] < CHUNK_BYTES:
            self.sizes[-1] += size
            self.run_max[-1] = max(prev, max_timestamp)
        else:
            self.bases.append(base_offset)
            self.sizes.append(size)
            self.run_max.append(max(prev, max_timestamp))
        self.total_bytes += size

    def lookup(self, target: int) -> int | None:
        """Base offset of the chunk holding the first batch with max timestamp >= target."""
        i = bisect.bisect_left(self.run_max, target)
        return self.bases[i] if i < len(self.bases) else None

    def chunk_of_max(self) -> int | None:
        """Base offset of the chunk where the max timestamp was first reached."""
        if not self.run_max:
            return None
        return self.lookup(self.run_max[-1])

    def retention_point(self, cutoff_ts: int | None, max_bytes: int | None) -> int | None:
        """Chunk base offset below which every chunk is expired (never the last chunk)."""
        n = len(self.bases)
        keep = 0  # number of leading chunks to delete
        if cutoff_ts is not None:
            # a chunk is expired when its own newest timestamp is older than the cutoff; the
            # running max is monotone so the first chunk reaching the cutoff bounds the scan
            keep = bisect.bisect_left(self.run_max, cutoff_ts)
        if max_bytes is not None and max_bytes >= 0:
            size = self.total_bytes
            j = 0
            while j < n - 1 and size - self.sizes[j] >= max_bytes:
                size -= self.sizes[j]
                j += 1
            keep = max(keep, j)
        keep = min(keep, n - 1)
        return self.bases[keep] if keep > 0 else None

    def truncate_below(self, start_offset: int) -> None:
        """Forget chunks that lie wholly below ``start_offset``."""
        i = bisect.bisect_right(self.bases, start_offset) - 1
        if i > 0:
            self.total_bytes -= sum(self.sizes[:i])
            del self.bases[:i]
            del self.sizes[:i]
            del self.run_max[:i]


def _now_ms() -> int:
    return int(time.time() * 1000)


def _config_int(configs: dict[str, str], name: str, default: int) -> int:
    try:
        return int(configs.get(name, default))
    except (TypeError, ValueError):
        return default


class Partition:
    """One topic-partition over a Stream; owns offsets, idempotence state, time index, HW/LSO."""

    def __init__(self, broker: Any, topic: str, topic_id: uuid.UUID, index: int, stream: Stream,
                 configs: dict[str, str], producer_store: ProducerStore | None) -> None:
        self.broker = broker
        self.topic = topic
        self.topic_id = topic_id
        self.index = index
        self.stream = stream
        self.configs = configs
        self.producers = PartitionProducers()
        self.log_index = LogIndex()
        self.txns = PartitionTxns()
        self._producer_store = producer_store
        self._waiters: set[asyncio.Future[None]] = set()
        self._batches_since_snapshot = 0
        self._dirty = True  # nothing saved yet for this open partition
        self._index_pending: dict[int, tuple[int, int, int]] = {}
        self._closed = False
        self.bytes_in = 0    # produced payload bytes and records (batch header counts),
        self.records_in = 0  # read by broker.metrics at scrape time
        self._loop: asyncio.AbstractEventLoop | None = None   # the broker's, once an append ran
        self._admission = _Admission()       # held from offset assignment to the stream taking them
        # outcome of the latest taken append: a future (append) or an _Outcome (append_now)
        self._tail: asyncio.Future[bool] | _Outcome | None = None
        # outcome -> the settling step of the task-less append taken right after it, run by
        # _settle in the same call (a future's callbacks would each wait a loop iteration: a
        # chain of N pipelined appends was answered over N iterations)
        self._then: dict[Any, tuple] = {}   # prev outcome -> (outcome, done, taken)
        self._offline: str | None = None     # why appends are refused until restart
        # (the raw config values _header_checks reads, what it made of them): re-parsed only
        # when a value changed (configs is updated in place by AlterConfigs)
        self._limits: tuple[tuple, tuple[int, bool, int, int]] | None = None
        self._producers_ready = True         # False while the log tail is still being replayed
        self._replay_from = 0                # where that replay started (caps the LSO)
        self._replay_task: asyncio.Task[None] | None = None
        engine = getattr(getattr(broker, "config", None), "engine", None) or {}
        try:
            wait = float(engine.get("backpressure_timeout_s", DEFAULT_ADMISSION_TIMEOUT_S))
        except (TypeError, ValueError, AttributeError):
            wait = DEFAULT_ADMISSION_TIMEOUT_S
        self._admission_timeout_s = wait     # longest wait behind an append that waits for room
        # stamped into every appended batch (partitionLeaderEpoch), so consumers validate
        # their position against the real epoch history (OffsetForLeaderEpoch); the cluster
        # room sets it when it opens the partition at a new epoch
        self.leader_epoch = _cluster_epoch(broker, topic_id, index)

    # --- life cycle ------------------------------------------------------------------------
    @classmethod
    async def open(cls, broker: Any, topic: str, topic_id: uuid.UUID, index: int, stream: Stream,
                   configs: dict[str, str]) -> "Partition":
        """Open over ``stream``, restoring producer state and the time index."""
        store = None
        if broker is not None:
            try:
                store = producer_store_for(broker)
            except Exception as exc:  # noqa: BLE001 - state then lives in memory only, say so
                # a metadata outage: the store's one-line episode (a bug: the traceback)
                log_failure(log, exc, "producer state store unavailable; idempotence not durable")
        p = cls(broker, topic, topic_id, index, stream, configs, store)
        await p._restore()
        if broker is not None and getattr(broker, "meta", None) is not None:
            try:  # the coordinator finishes transactions a restart interrupted
                await ensure_transactions(broker)
            except Exception as exc:  # noqa: BLE001 - transactions then start on first use
                log_failure(log, exc, "transaction coordinator did not start")
        if broker is not None:
            from .retention import ensure_retention  # noqa: PLC0415 - retention imports us
            ensure_retention(broker)
        return p

    async def _restore(self) -> None:
        """Load the last snapshot (producer windows + log index) and replay the batch headers
        written after it; without a usable snapshot the whole log is scanned."""
        start, end = self.stream.start_offset, self.stream.confirmed_offset
        snap_end = -1
        snap = None
        if self._producer_store is not None:
            snap = self._producer_store.load_snapshot(str(self.topic_id), self.index,
                                                      self.stream.stream_id)
        if snap is not None:
            try:
                state = json.loads(snap[1])
                producers = PartitionProducers.from_json(json.dumps(state["producers"]))
                index = LogIndex.from_state(state["index"])
                txns = PartitionTxns.from_state(state.get("txns"))
                if not (snap[0] == index.end_offset or index.end_offset == -1) \
                        or snap[0] > end:
                    raise ValueError(f"snapshot end {snap[0]} does not fit log end {end}")
                self.producers, self.log_index, self.txns = producers, index, txns
                snap_end = snap[0]
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring producer snapshot topic=%s partition=%d: %s",
                            self.topic, self.index, e)
        offset = max(start, snap_end)
        log.info("producer state topic=%s partition=%d stream=%d: snapshot end %d (%d producers)"
                 ", replaying %d..%d", self.topic, self.index, self.stream.stream_id, snap_end,
                 len(self.producers.entries), offset, end)
        self.log_index.truncate_below(start)
        if offset >= end:
            self._replayed(end)
            return
        # producer state is incomplete until the tail is replayed: idempotent produces are
        # refused (retriably) until then, never checked against a guess
        self._producers_ready = False
        self._replay_from = offset
        self._replay_task = asyncio.get_running_loop().create_task(
            self._replay(offset, end), name=f"s3kafka-replay-{self.topic}-{self.index}")
        await asyncio.wait({self._replay_task}, timeout=REPLAY_FOREGROUND_S)
        if not self._replay_task.done():
            log.warning("producer state replay continues in the background topic=%s "
                        "partition=%d offsets=%d..%d", self.topic, self.index, offset, end)

    async def _replay(self, offset: int, end: int) -> None:
        """Replay batch headers in [offset, end) into the producer windows and the log index,
        retrying reads that fail (object store down) until the whole range is read."""
        delay = 0.2
        floor = offset                        # batches below it are in the snapshot
        while offset < end and not self._closed:
            if self.stream.start_offset >= end:
                break                         # the whole range went below the log start
            try:
                batches = await self.stream.read(max(offset, self.stream.start_offset),
                                                 REPLAY_READ_BYTES)
            except StorageError as e:
                log.error("replay waits for storage topic=%s partition=%d offset=%d "
                          "(retry in %.1fs): %s", self.topic, self.index, offset, delay, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, REPLAY_RETRY_MAX_S)
                continue
            if not batches:
                # nothing readable below the end (a stream just released or taken over, its
                # objects not visible here yet): producer state must not be declared complete
                # without the tail, or the producers' next batches are refused out of order
                # (fatal in librdkafka; chaos suite) - read again, as after a storage error
                log.error("replay read nothing topic=%s partition=%d offset=%d end=%d (retry in "
                          "%.1fs)", self.topic, self.index, offset, end, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, REPLAY_RETRY_MAX_S)
                continue
            offset = max(offset, self.stream.start_offset)
            for b in batches:
                if b.next_offset <= offset or b.base_offset >= end:
                    continue
                max_ts = -1
                try:
                    for view in protocol.iter_batches(b.payload):
                        max_ts = max(max_ts, view.max_timestamp)
                        if view.base_offset < floor:
                            continue
                        if view.attributes & TXN_ATTRS:
                            self._replay_txn(view)
                            if view.is_control:
                                continue
                        if view.producer_id != NO_PRODUCER_ID:
                            self.producers.record(view.producer_id, view.producer_epoch,
                                                  view.base_sequence, view.last_offset_delta + 1,
                                                  view.base_offset, view.max_timestamp,
                                                  replayed=True)
                except protocol.CorruptRecordError as e:
                    # never stop a broker from starting: the payload stays readable as stored
                    log.error("unreadable batch header topic=%s partition=%d offset=%d: %s",
                              self.topic, self.index, b.base_offset, e)
                self.log_index.add(b.base_offset, len(b.payload), max_ts, b.next_offset)
                offset = b.next_offset
        self._replayed(end)

    def _replayed(self, end: int) -> None:
        """The tail up to ``end`` is replayed: producer state is complete."""
        self.producers.expire_below(self.stream.start_offset)
        self.txns.trim_below(self.stream.start_offset)
        # appends taken meanwhile (non-idempotent ones) wait in _index_pending from ``end``
        self.log_index.end_offset = end
        self.log_index.truncate_below(self.stream.start_offset)
        idx = self.log_index
        while idx.end_offset in self._index_pending:
            b = idx.end_offset
            size, max_ts, nxt = self._index_pending.pop(b)
            idx.add(b, size, max_ts, nxt)
        if not self._producers_ready:
            log.info("producer state replayed topic=%s partition=%d", self.topic, self.index)
        self._producers_ready = True
        self._dirty = True

    def snapshot(self, force: bool = False) -> "concurrent.futures.Future[None] | None":
        """Persist producer state and log index up to the indexed end (called periodically;
        skipped when nothing changed since the last one). The write runs on the store's
        thread; the returned future completes when it is durable."""
        if self._producer_store is None or not (force or self._dirty) \
                or not self._producers_ready:
            return None
        self._batches_since_snapshot = 0
        self._dirty = False
        # the index only holds payloads whose append completed: it defines what the snapshot
        # covers, and producer batches beyond it are replayed on open
        covered = self.log_index.end_offset
        if covered < 0:
            covered = self.stream.start_offset
        state = json.dumps({"producers": json.loads(self.producers.to_json(covered)),
                            "index": self.log_index.to_state(),
                            "txns": self.txns.to_state(covered)})
        try:
            fut = self._producer_store.save_snapshot_later(
                str(self.topic_id), self.index, self.stream.stream_id, covered, state)
        except RuntimeError:  # store already shut down (broker stopping)
            self._dirty = True
            return None
        fut.add_done_callback(self._snapshot_done)
        return fut

    def _snapshot_done(self, fut: "concurrent.futures.Future[None]") -> None:
        exc = fut.exception()
        if exc is not None:  # the log tail still rebuilds the state on start
            self._dirty = True
            log_failure(log, exc, "producer snapshot failed topic=%s partition=%d",
                        self.topic, self.index)

    async def close(self, snapshot: bool = True) -> None:
        """Snapshot producer state and release long-polling fetches (``snapshot=False``: the
        caller saves one itself once the appends in flight are done - a partition move)."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self._replay_task is not None and not self._replay_task.done():
            self._replay_task.cancel()
        if not snapshot:
            return
        fut = self.snapshot()
        if fut is not None:
            try:
                await asyncio.wrap_future(fut)
            except Exception:  # noqa: BLE001 - logged by _snapshot_done
                pass

    def mark_changed(self) -> None:
        """Producer state changed outside an append (expiry): the next snapshot saves it."""
        self._dirty = True

    @property
    def closed(self) -> bool:
        """Closed partitions (topic deleted, broker stopping) take no appends and end long-polls."""
        return self._closed

    # --- offsets ---------------------------------------------------------------------------
    @property
    def log_start_offset(self) -> int:
        return self.stream.start_offset

    @property
    def high_watermark(self) -> int:
        return self.stream.confirmed_offset

    @property
    def last_stable_offset(self) -> int:
        """The first offset of the oldest ongoing transaction, else the high watermark; while
        the log tail is still being replayed (transactions in it not known yet), no further
        than where the replay started."""
        lso = self.txns.lso(self.stream.confirmed_offset)
        if not self._producers_ready:
            return min(lso, self._replay_from)
        return lso

    @property
    def log_end_offset(self) -> int:
        return self.stream.end_offset

    # --- produce ---------------------------------------------------------------------------
    async def append(self, records: bytes | bytearray | memoryview | None,
                     api_version: int = 9, owned: bool = False,
                     control: bool = False) -> AppendResult:
        """Validate, assign offsets in place and append one produce payload durably.

        ``owned``: ``records`` is a writable buffer nobody else reads or reuses (the server's
        request frame), so offsets are written into it directly instead of into a copy. The
        stream may keep the buffer it is given (the engine's LogCache does): an owned frame
        is then held by the cache, a caller's buffer is copied first.
        Returns when the payload is durable (acks=1/all); the caller decides whether to answer.
        Errors are returned as Kafka error codes, never raised. ``control``: the broker's own
        transaction marker (clients may not write control batches)."""
        res = AppendResult(log_start_offset=self.log_start_offset)
        if self._closed:
            res.error = ErrorCode.NOT_LEADER_OR_FOLLOWER
            return res
        if records is None or len(records) == 0:
            res.error = ErrorCode.CORRUPT_MESSAGE
            res.message = "empty records"
            return res
        try:
            buf, views, check = self._prepare(records, owned)
        except protocol.CorruptRecordError as e:
            res.error, res.message = ErrorCode.CORRUPT_MESSAGE, str(e)
            return res
        if not views:
            res.error, res.message = ErrorCode.CORRUPT_MESSAGE, "no record batch"
            return res
        if check is None:
            return await self._append_checked(res, buf, views, None, api_version, control)
        res = await self._append_checked(res, buf, views, check, api_version, control)
        if res.error and res.error != ErrorCode.CORRUPT_MESSAGE:
            self._corrupt_first(res, views)
        return res

    @staticmethod
    def _corrupt_first(res: AppendResult, views: list[tuple[int, Any]]) -> None:
        """A lone batch refused on a header field before the stream checked its CRC: a
        corrupt batch is answered CORRUPT_MESSAGE whatever else is wrong with it (rare path:
        a pass here)."""
        try:
            protocol.validate_batch(views[0][1])
        except protocol.CorruptRecordError as e:
            res.error, res.message = ErrorCode.CORRUPT_MESSAGE, str(e)

    async def _append_checked(self, res: AppendResult, buf: bytearray | memoryview,
                              views: list[tuple[int, Any]], check: tuple[int, int] | None,
                              api_version: int, control: bool) -> AppendResult:
        """append() of validated batches (``check``: the one batch's CRC, left to the stream)."""
        checked = self._header_checks(buf, views, api_version, control, res)
        if checked is None:
            return res
        count, max_ts_of, log_append, now, transactional = checked
        if log_append and check is not None and not self._checked_before_stamp(res, views):
            return res

        # one append at a time goes from here to the stream taking its offsets: a batch that
        # waits for room holds the ones behind it, so each is checked against the true outcome
        # of everything before it (never against a predecessor that may still fail)
        idempotent = [(v.producer_id, v.producer_epoch, v.base_sequence) for _pos, v in views
                      if v.producer_id != NO_PRODUCER_ID and not v.is_control] \
            if views[0][1].producer_id != NO_PRODUCER_ID or len(views) > 1 else []
        if (idempotent or control) and not self._producers_ready:
            # failed marks: a successor arriving once the replay is done must wait for this
            # batch's retry too, or a stored one is acknowledged implicitly, without an offset
            return self._not_appended(
                res, idempotent, ErrorCode.NOT_ENOUGH_REPLICAS,
                "producer state of this partition is still being rebuilt; retry")
        if self._offline is not None:
            res.error, res.message = ErrorCode.KAFKA_STORAGE_ERROR, self._offline
            return res
        admission = self._admission
        if admission.held and len(views) == 1 and idempotent and not self._closed:
            # a retry of a stored batch needs no room: answered now, not queued behind an
            # append that waits for room, where its wait would time out and the refusal hold
            # back its stored successors (failed marks) until it is retried once more
            view = views[0][1]
            count_1 = view.last_offset_delta + 1
            if self.producers.stored(view.producer_id, view.producer_epoch,
                                     view.base_sequence, count_1):
                try:
                    dup = self.producers.check(view.producer_id, view.producer_epoch,
                                               view.base_sequence, count_1)
                except ProducerError as e:
                    res.error, res.message = ErrorCode[e.code], str(e)
                    return res
                if dup is not None:
                    return await self._answer_duplicate(dup, res)
        if not admission.try_take() and not await admission.take(self._admission_timeout_s):
            return self._not_appended(res, idempotent, ErrorCode.NOT_ENOUGH_REPLICAS,
                                      "storage busy: earlier appends still wait; retry")
        held = True
        dup: BatchMeta | None = None
        outcome: asyncio.Future[bool] | None = None
        prev: asyncio.Future[bool] | _Outcome | None = None
        error: Exception | None = None
        try:
            if self._closed or self._offline is not None:
                return self._not_appended(
                    res, idempotent, ErrorCode.KAFKA_STORAGE_ERROR if self._offline
                    else ErrorCode.NOT_LEADER_OR_FOLLOWER, self._offline)
            # idempotence checks (all batches of the request stand or fall together, like Kafka)
            producers = self.producers
            pending: dict[int, tuple[int, int]] = {}  # pid -> (epoch, last seq) in this request
            for _pos, view in views if idempotent else ():
                pid = view.producer_id
                if pid == NO_PRODUCER_ID or view.is_control:
                    continue
                try:
                    if pid in pending:
                        epoch, last = pending[pid]
                        if view.producer_epoch != epoch or view.base_sequence != last + 1:
                            raise ProducerError("OUT_OF_ORDER_SEQUENCE_NUMBER",
                                                "sequence gap inside one request")
                    else:
                        dup = producers.check(pid, view.producer_epoch, view.base_sequence,
                                              view.last_offset_delta + 1)
                except ProducerError as e:
                    res.error, res.message = ErrorCode[e.code], str(e)
                    if e.code == "OUT_OF_ORDER_SEQUENCE_NUMBER":   # rare, and fatal for
                        log.warning("produce refused topic=%s partition=%d: %s (log end %d)",
                                    self.topic, self.index, e, self.stream.end_offset)
                    return res
                if dup is not None:
                    break
                pending[pid] = (view.producer_epoch,
                                view.base_sequence + view.last_offset_delta)
            if dup is None and transactional and not control:
                err = self._verify_txn(views)
                if err:
                    res.error = err
                    res.message = ("transactional batch outside an ongoing transaction of this "
                                   "partition")
                    return res
            if dup is None:
                # offsets and timestamps, in place
                base = self.stream.end_offset
                end = base + count
                payload_max_ts = self._stamp(buf, views, base, max_ts_of, log_append, now)
                if log_append and check is not None:
                    check = self._stamped_check(buf, views)

                def take() -> None:
                    """The stream took the offsets: the windows remember the batches
                    (pending until durable) and the next append is admitted."""
                    nonlocal held, outcome, prev
                    loop = self._loop
                    if loop is None:    # looked up once: each lookup is a getpid() syscall
                        loop = self._loop = asyncio.get_running_loop()
                    outcome = loop.create_future()
                    prev, self._tail = self._tail, outcome
                    if idempotent:
                        first = base
                        for (_pos, view), max_ts in zip(views, max_ts_of):
                            if transactional and view.is_transactional \
                                    and not view.is_control:
                                self.txns.begin(view.producer_id, first)
                            if view.producer_id != NO_PRODUCER_ID and not view.is_control:
                                producers.record(view.producer_id, view.producer_epoch,
                                                 view.base_sequence,
                                                 view.last_offset_delta + 1, first,
                                                 now if log_append else max_ts, outcome)
                            first += view.last_offset_delta + 1
                    held = False
                    admission.release()

                def on_suspend() -> bool:
                    # the stream's append waits: for room (offsets not taken yet: keep the
                    # admission, the appends behind wait for its fate) or for durability
                    if self.stream.end_offset < end:
                        return False
                    take()
                    return True

                try:
                    await Drive(self.stream.append(buf, base, count) if check is None else
                                self.stream.append(buf, base, count, check), on_suspend)
                except PayloadChecksumError as e:   # the batch's CRC, checked by the stream
                    res.error, res.message = ErrorCode.CORRUPT_MESSAGE, \
                        f"record batch CRC-32C mismatch ({e})"
                    return res                      # nothing taken, nothing remembered
                except Exception as e:  # noqa: BLE001 - StorageError or a storage bug
                    error = e
                except BaseException:   # cancelled (broker stopping)
                    if outcome is not None:
                        self._settle(outcome, False, "append cancelled")
                    else:
                        self._not_appended(res, idempotent, 0, None)
                    raise
                if outcome is None:
                    if self.stream.end_offset < end:
                        # never taken: nothing of it remains
                        retriable = error is None or isinstance(error, RetriableStorageError)
                        if not retriable:
                            log.error("append failed topic=%s partition=%d error=%r",
                                      self.topic, self.index, error)
                        return self._not_appended(
                            res, idempotent, ErrorCode.NOT_ENOUGH_REPLICAS if retriable
                            else ErrorCode.KAFKA_STORAGE_ERROR,
                            f"storage busy: {error}" if retriable else str(error))
                    take()                    # taken and done in one step
        finally:
            if held:
                admission.release()
        if dup is not None:
            return await self._answer_duplicate(dup, res)

        # acknowledged only when this append and every earlier one are durable
        assert outcome is not None
        ok, why = error is None, f"WAL write failed: {error!r}"
        if ok and prev is not None:
            if type(prev) is _Outcome:      # a task-less append's: a future made for it
                prev = prev.wait_future(self._loop or asyncio.get_running_loop())
            if not prev.done():
                try:
                    await asyncio.shield(prev)
                except BaseException:
                    self._settle(outcome, False, "append cancelled")
                    raise
            ok, why = prev.result(), _EARLIER_FAILED
        self._settle(outcome, ok, why)
        return self._finished(ok, res, base, end, len(buf), len(views), payload_max_ts,
                              now if log_append else -1)

    def _stamp(self, buf: Any, views: list[tuple[int, Any]], base: int, max_ts_of: list[int],
               log_append: bool, now: int) -> int:
        """Offsets, leader epoch (and LogAppendTime) written into the batch headers in place;
        the payload's max timestamp."""
        next_offset = base
        epoch_stamp = self.leader_epoch
        payload_max_ts = -1
        for (pos, view), max_ts in zip(views, max_ts_of):
            protocol.set_base_offset(buf, pos, next_offset)
            protocol.set_partition_leader_epoch(buf, pos, epoch_stamp)
            if log_append:
                protocol.set_log_append_time(buf, pos, now)
            payload_max_ts = max(payload_max_ts, now if log_append else max_ts)
            next_offset += view.last_offset_delta + 1
        return payload_max_ts

    @staticmethod
    def _checked_before_stamp(res: AppendResult, views: list[tuple[int, Any]]) -> bool:
        """A lone large batch whose CRC the stream was to check, on a LogAppendTime topic: the
        stamp rewrites its CRC, so the client's is checked here first (False: corrupt, answered
        CORRUPT_MESSAGE in ``res``) unless _prepare checked it already (producer state). The
        stream checked the client's CRC against the restamped bytes before, and refused every
        such batch."""
        view = views[0][1]
        if view.producer_id != NO_PRODUCER_ID or view.attributes & TXN_ATTRS:
            return True                      # validated whole by _prepare
        try:
            protocol.validate_batch(view)
        except protocol.CorruptRecordError as e:
            res.error, res.message = ErrorCode.CORRUPT_MESSAGE, str(e)
            return False
        return True

    @staticmethod
    def _stamped_check(buf: Any, views: list[tuple[int, Any]]) -> tuple[int, int]:
        """The stream's check of a lone batch after the LogAppendTime stamp: its new CRC (the
        upload then still writes it from its frame, storage GatherSource)."""
        pos = views[0][0]
        return protocol.CRC_START, protocol.BatchView(buf, pos).crc

    def _finished(self, ok: bool, res: AppendResult, base: int, end: int, size: int,
                  batches: int, payload_max_ts: int, append_time: int) -> AppendResult:
        """Bookkeeping of a taken append whose outcome is settled (durable with every
        earlier one, or failed): log index, counters, waiters, snapshots; the answer (its
        log start offset read here, once, for an answer with or without an error)."""
        if not ok:
            self._indexed(base, 0, -1, end)  # offsets consumed: keep the chain
            res.error, res.message = ErrorCode.KAFKA_STORAGE_ERROR, self._offline
            res.log_start_offset = self.stream.start_offset
            return res
        idx = self.log_index
        if base == idx.end_offset and not self._index_pending:
            idx.add(base, size, payload_max_ts, end)    # _indexed's common case, a call less
        else:
            self._indexed(base, size, payload_max_ts, end)
        self.bytes_in += size
        self.records_in += end - base
        if self._waiters:               # fetches waiting for data (none: no call, no new set)
            self._wake()
        self._batches_since_snapshot += batches
        self._dirty = True
        if self._batches_since_snapshot >= SNAPSHOT_EVERY_BATCHES:
            self.snapshot()
        res.base_offset = base
        res.log_append_time = append_time
        res.log_start_offset = self.stream.start_offset
        return res

    def append_now(self, records: Any, api_version: int,
                   done: Callable[[AppendResult], None]) -> bool:
        """``append`` for a payload of plain batches (no producer id, not transactional) in
        a writable buffer the caller hands over (``owned``), without a coroutine: everything
        up to the stream taking the offsets runs in this call, the rest in the WAL's
        completion callback, which calls ``done(result)`` once the append and every earlier
        one of the partition are durable (or failed). A refused payload (corrupt, too large,
        timestamps) calls ``done`` before returning. False, with nothing changed, when the
        payload needs ``append``: idempotent or transactional batches, earlier appends still
        waiting for room, a stream without ``append_now`` or without room (back-pressure),
        the partition closed, offline or its producer state being rebuilt. Produce requests
        are cheaper this way (no task, no Drive, no shield futures); a large lone batch has
        its CRC checked in the WAL's copy (``_prepare``'s check, passed to the stream)."""
        append_now = getattr(self.stream, "append_now", None)
        if append_now is None or self._closed or self._offline is not None \
                or self._admission.held or not records:
            return False
        res = AppendResult()            # its log start offset: read where it is answered
        stream = self.stream
        stamped = None
        if _stamp_plain is not None and type(records) is memoryview and not records.readonly \
                and records.format == "B" and records.contiguous:
            max_bytes, log_append, before, after = self._limits_now()
            if not log_append:
                # the checks of _prepare and _header_checks and _stamp in one C call when all
                # pass; None (nothing changed): the Python path below, which answers errors
                now = _now_ms()
                base = stream.end_offset
                # a lone large batch comes back with its CRC for the WAL's copy to check,
                # when the stream checks payloads (else stamp_plain checks it)
                stamped = _stamp_plain(records, base, self.leader_epoch, max_bytes,
                                       api_version >= 7, max(now - before, _I64_MIN),
                                       min(now + after, _I64_MAX),
                                       STREAM_CHECKS_CRC_FROM if stream.checks_payloads
                                       else _I64_MAX)
        if stamped is not None:
            count, batches, payload_max_ts, crc = stamped
            buf, append_time = records, -1
            check = None if crc is None else (protocol.CRC_START, crc)
            end = base + count
            size = len(buf)
        else:
            if len(records) >= protocol.HEADER_SIZE and records[16] >= 2:
                first = protocol.BatchView(records)
                if first.producer_id != NO_PRODUCER_ID or first.attributes & TXN_ATTRS:
                    # producer state: append() validates it (not here as well: a whole CRC
                    # pass per idempotent request went twice)
                    return False
            try:
                buf, views, check = self._prepare(records, True)
            except protocol.CorruptRecordError as e:
                res.error, res.message = ErrorCode.CORRUPT_MESSAGE, str(e)
                return self._refused_now(res, done)
            if not views:
                return False
            for _pos, view in views:
                if view.producer_id != NO_PRODUCER_ID or view.attributes & TXN_ATTRS:
                    return False
            checked = self._header_checks(buf, views, api_version, False, res)
            if checked is None:
                if check is not None:   # a large lone batch whose CRC the stream checks
                    self._corrupt_first(res, views)
                return self._refused_now(res, done)
            count, max_ts_of, log_append, now, _txn = checked
            if log_append and check is not None:
                if not self._checked_before_stamp(res, views):
                    return self._refused_now(res, done)
            base = stream.end_offset
            end = base + count
            payload_max_ts = self._stamp(buf, views, base, max_ts_of, log_append, now)
            if log_append and check is not None:
                check = self._stamped_check(buf, views)
            append_time = now if log_append else -1
            size, batches = len(buf), len(views)
        outcome = _Outcome()
        prev = self._tail
        # the stream calls it in the WAL's completion of this append's write (with the write's
        # error, None when durable): one call, no closure (its cells) built per append
        durable = functools.partial(self._settle, outcome, True, "", done,
                                    (res, base, end, size, batches, payload_max_ts, append_time),
                                    prev)
        try:
            # a large lone batch (``check``): its CRC-32C is checked in the WAL's copy
            if not (append_now(buf, base, count, durable) if check is None
                    else append_now(buf, base, count, durable, check)):
                return False                  # no room: append() waits for it
        except PayloadChecksumError as e:     # nothing appended
            res.error, res.message = ErrorCode.CORRUPT_MESSAGE, \
                f"record batch CRC-32C mismatch ({e})"
            return self._refused_now(res, done)
        except StorageError:
            return False                      # deleted, released, fenced: append() answers
        self._tail = outcome
        return True

    def _refused_now(self, res: AppendResult, done: Callable[[AppendResult], None]) -> bool:
        """append_now's answer to a payload refused before anything was taken (its error set
        in ``res``): with the log start offset, as ``append`` answers it."""
        res.log_start_offset = self.stream.start_offset
        done(res)
        return True

    def _header_checks(self, buf: bytearray | memoryview, views: list[tuple[int, Any]],
                       api_version: int, control: bool, res: AppendResult) -> tuple | None:
        """The checks of validated batches that need no state of the partition's log:
        max.message.bytes, compression, control and transactional flags, the CreateTime
        bounds. None with ``res.error`` set when refused, else (record count, max timestamp
        per batch, LogAppendTime, now ms, transactional)."""
        max_bytes, log_append, before, after = self._limits_now()
        count = 0
        max_ts_of: list[int] = []
        transactional = False
        now = _now_ms()
        if not log_append:
            # KIP-937 bounds on CreateTime, checked on the batch header (first timestamp and
            # max timestamp) so records stay undecoded
            earliest = now - before
            latest = now + after
        for pos, view in views:
            if view.size > max_bytes:
                res.error = ErrorCode.MESSAGE_SIZE_TOO_LARGE
                res.message = f"batch of {view.size} bytes > max.message.bytes {max_bytes}"
                return None
            if view.compression == COMPRESSION_ZSTD and api_version < 7:
                res.error = ErrorCode.UNSUPPORTED_COMPRESSION_TYPE
                return None
            if view.attributes & TXN_ATTRS:
                if view.is_control and not control:
                    res.error = ErrorCode.INVALID_RECORD
                    res.message = "clients may not write control batches"
                    return None
                if view.producer_id == NO_PRODUCER_ID:
                    res.error = ErrorCode.INVALID_RECORD
                    res.message = "a transactional batch needs a producer id"
                    return None
                transactional = True
            if view.compression > COMPRESSION_ZSTD:
                res.error, res.message = ErrorCode.CORRUPT_MESSAGE, "unknown compression codec"
                return None
            max_ts = view.max_timestamp
            if max_ts < 0 and not log_append:
                # rare producers leave it unset; timestamp lookups need it (decodes records)
                try:
                    max_ts = protocol.fill_max_timestamp(buf, pos)
                except protocol.CorruptRecordError as e:
                    res.error = getattr(e, "code", None) or ErrorCode.CORRUPT_MESSAGE
                    res.message = str(e)
                    return None
                except Exception as e:  # noqa: BLE001 - undecodable records are bad input
                    res.error, res.message = ErrorCode.CORRUPT_MESSAGE, f"bad records: {e!r}"
                    return None
            if not log_append and (max_ts > latest or 0 <= view.base_timestamp < earliest):
                res.error = ErrorCode.INVALID_TIMESTAMP
                res.message = "timestamp outside message.timestamp.before/after.max.ms"
                return None
            max_ts_of.append(max_ts)
            count += view.last_offset_delta + 1
        return count, max_ts_of, log_append, now, transactional

    def _limits_now(self) -> tuple[int, bool, int, int]:
        """max.message.bytes, LogAppendTime or not, message.timestamp.before/after.max.ms:
        parsed again only when one of their values in ``configs`` changed."""
        c = self.configs
        raw = (c.get("max.message.bytes"), c.get("message.timestamp.type"),
               c.get("message.timestamp.before.max.ms"), c.get("message.timestamp.after.max.ms"))
        lim = self._limits
        if lim is not None and lim[0] == raw:
            return lim[1]
        parsed = (_config_int(c, "max.message.bytes", DEFAULT_MAX_MESSAGE_BYTES),
                  c.get("message.timestamp.type", "CreateTime") == "LogAppendTime",
                  _config_int(c, "message.timestamp.before.max.ms", LONG_MAX),
                  _config_int(c, "message.timestamp.after.max.ms", LONG_MAX))
        self._limits = (raw, parsed)
        return parsed

    def refused(self, records: Any) -> None:
        """A produce refused before any append (this broker's lease lapsed): like an append
        that failed, its idempotent batches leave failed marks, so the producer's next
        pipelined batch, arriving a moment later, is refused retriably (NOT_ENOUGH_REPLICAS)
        instead of OUT_OF_ORDER_SEQUENCE - on which librdkafka bumps the producer's epoch and
        re-sends records that may have been stored (duplicates; chaos suite)."""
        try:
            for pid, epoch, first_seq in idempotent_batches(records):
                self.producers.fail(pid, epoch, first_seq)
        except protocol.CorruptRecordError:
            pass                            # refused anyway; nothing to remember

    def _not_appended(self, res: AppendResult, idempotent: list[tuple[int, int, int]],
                      error: int, message: str | None) -> AppendResult:
        """Answer an append that never reached the stream: its producers' windows are as if
        it never arrived, and their later batches wait for its retry (failed marks)."""
        for pid, epoch, first_seq in idempotent:
            self.producers.fail(pid, epoch, first_seq)
        res.error, res.message = error, message
        return res

    def _settle(self, outcome: "asyncio.Future[bool] | _Outcome", ok: bool, why: str,
                done: Callable[[AppendResult], None] | None = None,
                taken: tuple | None = None, prev: "asyncio.Future[bool] | _Outcome | None" = None,
                error: BaseException | None = None) -> None:
        """Resolve a taken append's outcome (duplicates and later appends wait on it); a
        task-less one (``append_now``) is then accounted and answered,
        ``done(_finished(ok, *taken))``; then the same for the task-less appends chained
        behind it (``_then``: their ``ok`` is this one's), in this call and in order (a
        loop, not recursion: a chain can be long).

        A task-less append's WAL completion is a partial of this call (``append_now``: the
        stream adds the write's ``error``, None when durable): it settles with every earlier
        append of the partition (``prev``: the one taken before it), or, while ``prev`` is
        not settled yet, is chained behind it, settled in the call that settles ``prev``."""
        if error is not None:
            ok, why = False, f"WAL write failed: {error!r}"
        elif prev is not None:
            if type(prev) is _Outcome:
                if prev.ok is None:
                    self._then[prev] = (outcome, done, taken)
                    return
                ok = prev.ok
            else:
                if not prev.done():
                    self._then[prev] = (outcome, done, taken)
                    return
                ok = prev.result()
            why = _EARLIER_FAILED
        while True:
            if not ok:
                self._go_offline(why)
            if type(outcome) is _Outcome:
                if outcome.ok is None:
                    outcome.ok = ok
                    if outcome.fut is not None and not outcome.fut.done():
                        outcome.fut.set_result(ok)  # a task-path append behind it waits
            elif not outcome.done():
                outcome.set_result(ok)
            if done is not None:
                try:
                    done(self._finished(ok, *taken))
                except Exception:  # noqa: BLE001 - the appends chained behind still settle
                    log.exception("answering an append failed topic=%s partition=%d",
                                  self.topic, self.index)
            if not self._then:
                return
            step = self._then.pop(outcome, None)
            if step is None:
                return
            outcome, done, taken = step
            why = _EARLIER_FAILED

    def _go_offline(self, why: str) -> None:
        """An append the stream had taken failed: whether its bytes survive is unknown until
        restart (the cache may still upload them), so no later produce is acknowledged on
        top of it (KAFKA_STORAGE_ERROR, like a Kafka log directory gone offline); a restart
        rebuilds producer state from what was actually stored."""
        if self._offline is None:
            self._offline = f"partition offline until restart: {why}"
            log.error("partition offline topic=%s partition=%d: %s", self.topic, self.index, why)

    # --- transactions ------------------------------------------------------------------------
    def _verify_txn(self, views: list[tuple[int, Any]]) -> int:
        """Server-side verification of transactional batches (KIP-890 part 1): the producer's
        transaction is ongoing at the coordinator and holds this partition; a batch of an
        epoch older than its last marker is a zombie's."""
        coord = coordinator_for(self.broker)
        for _pos, view in views:
            if not view.is_transactional:
                continue
            if self.txns.fenced(view.producer_id, view.producer_epoch):
                return ErrorCode.INVALID_PRODUCER_EPOCH
            if self.txns.verified.get(view.producer_id) == view.producer_epoch:
                continue   # confirmed by its coordinator on another broker
            if coord is None:
                return ErrorCode.INVALID_TXN_STATE
            err = coord.verify(view.producer_id, view.producer_epoch, self.topic, self.index)
            if err:
                return err
        return ErrorCode.NONE

    async def write_marker(self, producer_id: int, epoch: int, commit: bool,
                           coordinator_epoch: int, from_coordinator: bool = False) -> int:
        """Append a COMMIT/ABORT marker durably and end the producer's transaction here
        (the LSO moves past it, an abort enters the aborted index); an error code. A
        coordinator's marker already written here (``PartitionTxns.marked``) is answered
        without writing it again: a late copy must not end the next transaction."""
        if from_coordinator and self.txns.marked_already(producer_id, coordinator_epoch):
            log.info("marker written already topic=%s partition=%d producer_id=%d epoch=%d "
                     "coordinator_epoch=%d", self.topic, self.index, producer_id, epoch,
                     coordinator_epoch)
            return ErrorCode.NONE
        res = await self.append(build_marker(producer_id, epoch, commit, coordinator_epoch,
                                             _now_ms()), owned=True, control=True)
        if res.error:
            return int(res.error)
        self.txns.end(producer_id, epoch, commit, res.base_offset, coordinator_epoch)
        self._dirty = True
        self._wake()  # read_committed fetches wait for the LSO
        return ErrorCode.NONE

    def _replay_txn(self, view: Any) -> None:
        """Rebuild transaction state from a replayed transactional batch or marker."""
        if view.is_control:
            fields = marker_fields(view)
            if fields is not None:
                self.txns.end(view.producer_id, view.producer_epoch, fields[0], view.base_offset,
                              fields[1])
        else:
            self.txns.begin(view.producer_id, view.base_offset)

    def aborted_between(self, start: int, end: int) -> list[tuple[int, int]]:
        return self.txns.aborted_between(start, end)

    def _indexed(self, base: int, size: int, max_ts: int, end: int) -> None:
        """Add a completed payload to the log index in offset order (completions of
        concurrent appends may resume out of order)."""
        idx = self.log_index
        if base != idx.end_offset:
            self._index_pending[base] = (size, max_ts, end)
            return
        idx.add(base, size, max_ts, end)
        while idx.end_offset in self._index_pending:
            b = idx.end_offset
            size, max_ts, end = self._index_pending.pop(b)
            idx.add(b, size, max_ts, end)

    def _prepare(self, records: bytes | bytearray | memoryview, owned: bool = False
                 ) -> tuple[bytearray | memoryview, list[tuple[int, Any]], tuple[int, int] | None]:
        """A writable buffer of v2 batches, (position, header view) of each batch, and the CRC
        check left to the stream: a large lone batch without a producer id has its CRC-32C
        checked by the storage engine in the pass that copies it into the WAL (Stream.append
        ``check``; a mismatch appends nothing), not in a pass of its own here. Batches with
        producer state (idempotent, transactional) are checked here, before that state is
        consulted, as are small ones; a large lone one still hands its CRC to the stream, whose
        pass checks it again at no extra cost: the upload then writes it straight from its
        frame (storage GatherSource needs a checked CRC)."""
        mv = memoryview(records)
        if mv.nbytes > 16 and mv[16] < 2:
            buf: bytearray | memoryview = bytearray(protocol.convert_legacy(mv))
        elif owned and not mv.readonly and mv.contiguous and mv.format == "B":
            buf = mv  # offsets go straight into the request frame: no copy
        else:
            # a caller's buffer is not ours to change: one copy
            buf = bytearray(mv)
        views = [(view.pos, view) for view in protocol.iter_batches(buf)]
        if len(views) == 1:
            view = views[0][1]
            if view.size >= STREAM_CHECKS_CRC_FROM and self.stream.checks_payloads:
                plain = view.producer_id == NO_PRODUCER_ID and not view.attributes & TXN_ATTRS
                protocol.validate_batch(view, crc=not plain)
                return buf, views, (protocol.CRC_START, view.crc)
        for _pos, view in views:
            protocol.validate_batch(view)
        return buf, views, None

    async def _answer_duplicate(self, dup: BatchMeta, res: AppendResult) -> AppendResult:
        """A retried batch: wait until the original is durable and answer with its offset
        (only that batch's own outcome counts: a high watermark passing its offsets could be
        another batch's after it failed)."""
        if dup.outcome is not None:
            if not await asyncio.shield(dup.outcome):
                res.error = ErrorCode.KAFKA_STORAGE_ERROR
                res.message = self._offline or "the original append failed"
                return res
        else:
            await self.wait_for(dup.last_offset + 1)
        res.base_offset = dup.base_offset
        res.log_start_offset = self.log_start_offset
        if self.configs.get("message.timestamp.type", "CreateTime") == "LogAppendTime":
            res.log_append_time = dup.timestamp
        return res

    async def wait_for(self, offset: int, timeout: float | None = None) -> bool:
        """Wait until the high watermark reaches ``offset`` (or timeout); True if it did."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.high_watermark < offset and not self._closed:
            fut = self.new_waiter()
            try:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return False
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                return self.high_watermark >= offset
            finally:
                self._waiters.discard(fut)
        return self.high_watermark >= offset

    # --- fetch -----------------------------------------------------------------------------
    def new_waiter(self, fut: asyncio.Future[None] | None = None) -> asyncio.Future[None]:
        """Register a future resolved by the next durable append (Fetch long-poll)."""
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        return fut

    def remove_waiter(self, fut: asyncio.Future[None]) -> None:
        self._waiters.discard(fut)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def read(self, offset: int, max_bytes: int, read_committed: bool = False) -> ReadResult:
        """Batches from ``offset`` up to the HW (LSO for read_committed; equal here)."""
        hw = self.high_watermark
        res = ReadResult(high_watermark=hw, last_stable_offset=self.last_stable_offset,
                         log_start_offset=self.log_start_offset)
        if offset < res.log_start_offset or offset > hw:
            if offset > hw and offset <= self.log_end_offset:
                return res  # data in flight: nothing visible yet, not an error
            res.error = ErrorCode.OFFSET_OUT_OF_RANGE
            return res
        if offset == hw:
            return res
        try:
            batches = await self.stream.read(offset, max(max_bytes, 1))
        except OffsetOutOfRange:
            res.error = ErrorCode.OFFSET_OUT_OF_RANGE
            res.log_start_offset = self.log_start_offset
            return res
        except StorageError as e:
            log.error("read failed topic=%s partition=%d offset=%d error=%s",
                      self.topic, self.index, offset, e)
            res.error = ErrorCode.KAFKA_STORAGE_ERROR
            return res
        if not read_committed:
            res.batches = [b for b in batches if b.base_offset < hw]
            return res
        limit = res.last_stable_offset
        res.batches = [b for b in batches if b.base_offset < limit]
        if self.txns.aborted and res.batches:
            res.aborted = self.txns.aborted_between(offset, res.batches[-1].next_offset)
        return res

    # --- list offsets ----------------------------------------------------------------------
    async def offset_for_timestamp(self, timestamp: int) -> tuple[int, int]:
        """(offset, timestamp) of the first record with timestamp >= ``timestamp``.

        (-1, -1) when there is none. The log index names the chunk to read; within it the first
        batch whose max timestamp reaches the target is decoded (not a hot path)."""
        base = self.log_index.lookup(timestamp)
        if base is None:
            return -1, -1
        start = self.log_start_offset
        async for payload, pos, view in self._scan(max(base, start)):
            if view.max_timestamp < timestamp:
                continue
            for offset, ts in protocol.record_timestamps(payload, pos):
                if ts >= timestamp and offset >= start:
                    return offset, ts
        return -1, -1

    async def max_timestamp_offset(self) -> tuple[int, int]:
        """(offset, timestamp) of the first record carrying the largest timestamp."""
        ts = self.log_index.max_timestamp
        base = self.log_index.chunk_of_max()
        if base is None or ts < 0:
            return -1, -1
        start = self.log_start_offset
        async for payload, pos, view in self._scan(max(base, start)):
            if view.max_timestamp != ts:
                continue
            for offset, rts in protocol.record_timestamps(payload, pos):
                if rts == ts and offset >= start:
                    return offset, rts
        return -1, -1

    async def _scan(self, offset: int):  # -> AsyncIterator[tuple[payload, pos, BatchView]]
        """Batch headers from ``offset`` to the high watermark (reads whole payloads)."""
        hw = self.high_watermark
        while offset < hw:
            try:
                batches = await self.stream.read(offset, REPLAY_READ_BYTES)
            except StorageError:
                return
            if not batches:
                return
            for b in batches:
                for pos, view in _views_with_pos(b.payload):
                    if view.base_offset + view.last_offset_delta >= offset:
                        yield b.payload, pos, view
                offset = max(offset, b.next_offset)

    # --- trimming --------------------------------------------------------------------------
    async def trim_to(self, offset: int) -> int:
        """Advance the log start offset to ``offset`` (DeleteRecords / retention)."""
        offset = min(offset, self.high_watermark)
        if offset > self.log_start_offset:
            await self.stream.trim(offset)
            self._dirty = True
            self.log_index.truncate_below(self.log_start_offset)
            self.producers.expire_below(self.log_start_offset)
            self.txns.trim_below(self.log_start_offset)
        return self.log_start_offset

    def producer_rows(self) -> list[tuple[int, int, int, int, int, int]]:
        """(producer id, epoch, last sequence, last timestamp, first offset of its ongoing
        transaction or -1, coordinator epoch of its last marker or -1) for DescribeProducers."""
        rows = []
        for pid, e in self.producers.entries.items():
            rows.append((pid, e.epoch, e.last_seq, e.last_timestamp,
                         self.txns.ongoing.get(pid, -1), self.txns.marked.get(pid, -1)))
        return rows


class _Admission:
    """A FIFO lock for Partition.append: free, it is taken with one attribute test (the hot
    path); held, appends queue in arrival order and ``release`` hands it to the first."""

    __slots__ = ("held", "_waiters")

    def __init__(self) -> None:
        self.held = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def try_take(self) -> bool:
        if self.held:
            return False
        self.held = True
        return True

    async def take(self, timeout: float) -> bool:
        """Wait in line (at most ``timeout`` s); True once this caller holds it.

        The waiter's future resolves True when handed over, False when its timer fires
        first (``_timed_out``): a timer handle instead of ``asyncio.wait_for``, whose
        machinery (its own future chaining, callbacks, a cancel at the timeout) was ~15
        Python calls per append waiting in line - under back-pressure every request behind
        the one waiting for room."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append(fut)
        timer = loop.call_later(timeout, _timed_out, fut)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.result():
                self.release()                    # handed over as we were cancelled
            raise
        finally:
            timer.cancel()
            if not fut.done() or fut.cancelled() or not fut.result():
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(True)              # handed over: stays held
                return
        self.held = False


def _timed_out(fut: "asyncio.Future[bool]") -> None:
    """An admission waiter's timer: it gives up (False) unless already handed over."""
    if not fut.done():
        fut.set_result(False)


def _views_with_pos(payload: bytes | memoryview) -> list[tuple[int, Any]]:
    return [(view.pos, view) for view in protocol.iter_batches(payload)]


# --- lookups shared by the datapath handlers -------------------------------------------------
def _cluster_epoch(broker: Any, topic_id: uuid.UUID, index: int) -> int:
    """The partition's leader epoch in the cluster's assignment (0 without a cluster)."""
    assign = getattr(getattr(broker, "cluster", None), "assign", None)
    if not isinstance(assign, dict):
        return LEADER_EPOCH
    a = assign.get((str(topic_id), index))
    return int(getattr(a, "leader_epoch", LEADER_EPOCH)) if a is not None else LEADER_EPOCH


def find_topic(broker: Any, name: str | None) -> Any | None:
    """The broker's Topic called ``name`` (``broker.topics: dict[str, Topic]``), else None."""
    if not name:
        return None
    return getattr(broker, "topics", {}).get(name)


def find_topic_by_id(broker: Any, topic_id: uuid.UUID | None) -> Any | None:
    """The broker's Topic with this id (Produce v13+ / Fetch v13+ address topics by id)."""
    if topic_id is None:
        return None
    for t in list(getattr(broker, "topics", {}).values()):
        if getattr(t, "topic_id", None) == topic_id:
            return t
    return None


def get_partition(topic: Any | None, index: int) -> Partition | None:
    """Partition ``index`` of ``topic`` if both exist."""
    if topic is None:
        return None
    parts = getattr(topic, "partitions", None) or []
    if 0 <= index < len(parts):
        return parts[index]
    return None


async def topic_for_produce(broker: Any, name: str | None) -> Any | None:
    """The topic to produce to, auto-created when the broker allows it (like Kafka's
    auto.create.topics.enable). The broker core exposes ``broker.auto_create_topic(name)``."""
    topic = find_topic(broker, name)
    if topic is not None or not name:
        return topic
    create = getattr(broker, "auto_create_topic", None)
    if create is None:
        return None
    try:
        result = create(name)
        if asyncio.iscoroutine(result):
            result = await result
    except Exception:  # noqa: BLE001 - an invalid name just stays unknown
        log.debug("auto-create of %r failed", name, exc_info=True)
        return None
    return result if result is not None else find_topic(broker, name)
