"""Idempotent-producer state: producer id allocation and per-partition sequence windows.

Kafka's idempotence contract is exact: per partition and producer, a retried batch that matches
one of the last five appended batches is answered with its original offsets, a gap in the
sequence numbers is OUT_OF_ORDER_SEQUENCE_NUMBER and an older epoch is fenced. The state must
survive restarts, so producer ids are allocated through a durable counter in the metadata
database and each partition's windows are snapshotted there (tables prefixed ``kafka_producer_``);
the log tail written after the last snapshot is replayed from batch headers on start.

A batch enters a window only once the stream has taken its offsets (never while it waits for
room), and an append that fails before that leaves no trace: the window stays exactly as if
the batch had never arrived. What it does leave is a *failed mark* (producer, epoch, first
sequence): a later batch of that producer is refused with a retriable error until the failed
one is retried, so nothing is ever appended after a hole in the sequence (docs/datapath.md).
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

import protocol
from storage import sqldb

log = logging.getLogger(__name__)

NO_PRODUCER_ID = -1
NO_PRODUCER_EPOCH = -1
NO_SEQUENCE = -1
WINDOW = 5  # Kafka keeps the last 5 batches per producer (max.in.flight for idempotence)
INT32_MAX = 2**31 - 1
EPOCH_MAX = 2**15 - 1
# how long a failed mark holds back a producer's later batches: the clients' default
# delivery.timeout.ms, after which they give the failed batch up (and Kafka's rules apply)
FAILED_MARK_S = 120.0


def idempotent_batches(records: Any) -> Iterator[tuple[int, int, int]]:
    """(producer id, epoch, first sequence) of each idempotent data batch in ``records``: what
    a refused request's failed marks are keyed by (``PartitionProducers.fail``). Raises
    protocol.CorruptRecordError where the records stop parsing."""
    for view in protocol.iter_batches(records):
        if view.producer_id != NO_PRODUCER_ID and not view.is_control:
            yield view.producer_id, view.producer_epoch, view.base_sequence


class ProducerError(Exception):
    """A sequence/epoch check failed; ``code`` is the Kafka error code name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class BatchMeta:
    """What the dedup window remembers of one appended batch."""

    first_seq: int
    last_seq: int
    base_offset: int
    last_offset: int
    timestamp: int
    # asyncio.Future[bool] of an append still in flight (True once it and every earlier
    # append of the partition are durable); None for batches known durable (replayed)
    outcome: Any = None


@dataclass(slots=True)
class ProducerEntry:
    """One producer's state in one partition."""

    epoch: int
    batches: deque[BatchMeta] = field(default_factory=lambda: deque(maxlen=WINDOW))
    last_timestamp: int = -1
    last_seen_ms: int = 0  # broker wall clock of the last append (for producer id expiry)

    @property
    def last_seq(self) -> int:
        return self.batches[-1].last_seq if self.batches else NO_SEQUENCE

    def find_duplicate(self, epoch: int, first_seq: int, last_seq: int) -> BatchMeta | None:
        if epoch != self.epoch:
            return None
        for b in self.batches:
            if b.first_seq == first_seq and b.last_seq == last_seq:
                return b
        return None


def _in_sequence(last_seq: int, first_seq: int) -> bool:
    """Next sequence after ``last_seq`` (sequences wrap from INT32_MAX to 0)."""
    return first_seq == last_seq + 1 or (last_seq == INT32_MAX and first_seq == 0)


def _after(seq: int, ref: int) -> bool:
    """``seq`` comes after ``ref`` in sequence space (which wraps at INT32_MAX)."""
    return 0 < (seq - ref) % (INT32_MAX + 1) < (INT32_MAX + 1) // 2


def _last_seq(first_seq: int, count: int) -> int:
    last = first_seq + count - 1
    return last - INT32_MAX - 1 if last > INT32_MAX else last


class PartitionProducers:
    """Sequence windows of every idempotent producer writing to one partition."""

    def __init__(self) -> None:
        self.entries: dict[int, ProducerEntry] = {}
        # producer id -> (epoch, first sequence, monotonic time, upto) of a batch whose
        # append failed after validation; later batches wait for its retry. ``upto``: the
        # highest first sequence refused behind it meanwhile (held back, or failed itself and
        # never stored), else None: the marked batch's retry then moves the mark to the next
        # sequence instead of removing it (_retried)
        self.failed: dict[int, tuple[int, int, float, int | None]] = {}

    def check(self, producer_id: int, epoch: int, first_seq: int, count: int) -> BatchMeta | None:
        """Validate a batch before it is appended.

        Returns the remembered batch when this one is a duplicate (answer with its offsets),
        None when the batch may be appended; raises ProducerError otherwise. Mirrors Kafka:
        a producer this partition has no state for (new, or expired by retention) may start at
        any sequence; a new epoch must start at sequence 0."""
        entry = self.entries.get(producer_id)
        mark = self.failed.get(producer_id)
        if mark is not None:
            m_epoch, m_seq, t, _upto = mark
            if epoch > m_epoch or time.monotonic() - t > FAILED_MARK_S:
                del self.failed[producer_id]
                mark = None
            elif epoch == m_epoch and _after(first_seq, m_seq):
                # duplicates too (a replayed batch behind one refused while the replay ran):
                # answered with its offset before the marked batch's retry, a stored batch
                # of librdkafka's would be acknowledged implicitly, without an offset
                self._held(producer_id, mark, first_seq)
                raise ProducerError(
                    "NOT_ENOUGH_REPLICAS",
                    f"producer {producer_id}: the batch at sequence {m_seq} failed and must be "
                    f"retried before sequence {first_seq}")
        if entry is not None:
            dup = entry.find_duplicate(epoch, first_seq, _last_seq(first_seq, count))
            if dup is not None:
                if mark is not None and mark[0] == epoch and mark[1] == first_seq:
                    # the marked batch was stored after all (refused while the replay that
                    # found it ran): its retry is answered, the successors may follow
                    self._retried(producer_id, mark, dup.last_seq)
                return dup
        if entry is None:
            return None
        if epoch < entry.epoch:
            raise ProducerError(
                "INVALID_PRODUCER_EPOCH",
                f"producer {producer_id} epoch {epoch} is older than {entry.epoch}")
        if epoch > entry.epoch:
            if first_seq != 0:
                raise ProducerError(
                    "OUT_OF_ORDER_SEQUENCE_NUMBER",
                    f"new epoch {epoch} of producer {producer_id} starts at {first_seq}, not 0")
            return None
        if entry.batches and not _in_sequence(entry.last_seq, first_seq):
            raise ProducerError(
                "OUT_OF_ORDER_SEQUENCE_NUMBER",
                f"producer {producer_id}: expected sequence {entry.last_seq + 1}, got {first_seq}")
        return None

    def stored(self, producer_id: int, epoch: int, first_seq: int, count: int) -> bool:
        """Whether this batch is one the window remembers (a duplicate), without the checks
        and mark bookkeeping of ``check``."""
        entry = self.entries.get(producer_id)
        return entry is not None and \
            entry.find_duplicate(epoch, first_seq, _last_seq(first_seq, count)) is not None

    def record(self, producer_id: int, epoch: int, first_seq: int, count: int,
               base_offset: int, timestamp: int, outcome: Any = None,
               replayed: bool = False) -> BatchMeta:
        """Remember a batch the stream took (or a ``replayed`` one); ``outcome`` resolves to
        whether it became durable. A replayed batch leaves failed marks alone: its retry,
        refused during the replay, is still on its way (``check`` clears the mark then)."""
        mark = None if replayed else self.failed.get(producer_id)
        if mark is not None and epoch > mark[0]:
            del self.failed[producer_id]      # a new epoch
        elif mark is not None and epoch == mark[0] and first_seq == mark[1]:
            # the failed batch's retry
            self._retried(producer_id, mark, _last_seq(first_seq, count))
        entry = self.entries.get(producer_id)
        if entry is None or epoch != entry.epoch:
            if entry is not None and epoch < entry.epoch:
                # replaying an old batch after a newer epoch was snapshotted: ignore
                return BatchMeta(first_seq, _last_seq(first_seq, count), base_offset,
                                 base_offset + count - 1, timestamp)
            entry = ProducerEntry(epoch)
            self.entries[producer_id] = entry
        meta = BatchMeta(first_seq, _last_seq(first_seq, count), base_offset,
                         base_offset + count - 1, timestamp, outcome)
        entry.batches.append(meta)
        entry.last_timestamp = max(entry.last_timestamp, timestamp)
        entry.last_seen_ms = int(time.time() * 1000)
        return meta

    def fail(self, producer_id: int, epoch: int, first_seq: int) -> None:
        """A batch that passed validation was not appended (back-pressure, storage error,
        shutdown) or was refused before its duplicate check: its window is untouched, and
        the producer's later batches are refused (retriably) until this one is retried.

        A refused duplicate (a retry of a stored batch still in the window) leaves a mark
        too: the client saw an error for it and retries it, and a stored successor answered
        with its offset first would make librdkafka acknowledge it implicitly, without an
        offset (back-pressure chaos suite, CI of session 22). A batch at or before the
        window's last sequence that is not in the window (older) leaves none: no retry of
        it could clear the mark."""
        entry = self.entries.get(producer_id)
        if entry is not None and entry.epoch == epoch and entry.batches \
                and not _after(first_seq, entry.last_seq) \
                and not any(b.first_seq == first_seq for b in entry.batches):
            return
        if entry is not None and epoch < entry.epoch:
            return
        mark = self.failed.get(producer_id)
        upto = None
        if mark is not None and mark[0] == epoch:
            if _after(first_seq, mark[1]):
                # an earlier failure already holds them back; its retry must not free them
                self._held(producer_id, mark, first_seq)
                return
            # the marked batch failed again (upto kept), or one below it did (a refused
            # duplicate): the mark moves down to it and still remembers the old one
            # (``upto`` is only ever after the mark's sequence: _held, _retried)
            upto = mark[3] if first_seq == mark[1] or mark[3] is not None else mark[1]
        self.failed[producer_id] = (epoch, first_seq, time.monotonic(), upto)

    def _held(self, producer_id: int, mark: tuple[int, int, float, int | None],
              first_seq: int) -> None:
        """A batch after the marked one was refused: remember the highest such sequence."""
        upto = mark[3]
        if upto is None or _after(first_seq, upto):
            self.failed[producer_id] = (mark[0], mark[1], mark[2], first_seq)

    def _retried(self, producer_id: int, mark: tuple[int, int, float, int | None],
                 last_seq: int) -> None:
        """The marked batch's retry was taken (or answered as a duplicate): the mark goes,
        or, when later batches were refused while it stood, it moves to the next sequence
        (the first of them), so the ones after it wait for its retry in turn. Without that,
        seq n+1 refused behind seq n's mark was forgotten once seq n's retry was taken, and
        seq n+2, pipelined behind it, was answered OUT_OF_ORDER_SEQUENCE (cluster chaos
        suite, session 21: a librdkafka epoch bump re-sending 'possibly persisted' records);
        a stored seq n+2 would have been answered, and seq n+1 acknowledged implicitly,
        without an offset."""
        upto = mark[3]
        nxt = 0 if last_seq == INT32_MAX else last_seq + 1
        if upto is None or _after(nxt, upto):
            del self.failed[producer_id]
        else:
            self.failed[producer_id] = (mark[0], nxt, time.monotonic(),
                                        upto if _after(upto, nxt) else None)

    def expire_below(self, log_start_offset: int) -> None:
        """Drop producers whose every remembered batch fell below the log start (retention)."""
        for pid in [p for p, e in self.entries.items()
                    if e.batches and e.batches[-1].last_offset < log_start_offset]:
            del self.entries[pid]

    def expire_idle(self, now_ms: int, max_idle_ms: int) -> int:
        """Forget producers idle for longer than ``max_idle_ms`` (Kafka's
        producer.id.expiration.ms); returns how many were dropped."""
        idle = [pid for pid, e in self.entries.items() if now_ms - e.last_seen_ms > max_idle_ms]
        for pid in idle:
            del self.entries[pid]
        mono = time.monotonic()
        for pid in [p for p, m in self.failed.items() if mono - m[2] > FAILED_MARK_S]:
            del self.failed[pid]
        return len(idle)

    # --- snapshots -------------------------------------------------------------------------
    def to_json(self, durable_end: int | None = None) -> str:
        """Serialise the windows; batches at or above ``durable_end`` (appends still in
        flight) are left out so a snapshot never remembers data that may not survive."""
        out = {}
        for pid, e in self.entries.items():
            rows = [[b.first_seq, b.last_seq, b.base_offset, b.last_offset, b.timestamp]
                    for b in e.batches if durable_end is None or b.last_offset < durable_end]
            if rows:
                out[str(pid)] = {"epoch": e.epoch, "ts": e.last_timestamp,
                                 "seen": e.last_seen_ms, "batches": rows}
        return json.dumps(out)

    @classmethod
    def from_json(cls, text: str) -> "PartitionProducers":
        out = cls()
        for pid, e in json.loads(text).items():
            entry = ProducerEntry(int(e["epoch"]), last_timestamp=int(e.get("ts", -1)),
                                  last_seen_ms=int(e.get("seen", 0)))
            for fs, ls, bo, lo, ts in e["batches"]:
                entry.batches.append(BatchMeta(fs, ls, bo, lo, ts))
            out.entries[int(pid)] = entry
        return out


STEPS: list[sqldb.Step] = [
    (1, """
CREATE TABLE IF NOT EXISTS kafka_producer_ids (
    id INTEGER PRIMARY KEY CHECK (id = 0), next_id BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS kafka_producer_txn_ids (
    transactional_id TEXT PRIMARY KEY, producer_id BIGINT NOT NULL, epoch INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS kafka_producer_snapshots (
    topic_id TEXT NOT NULL, partition INTEGER NOT NULL, stream_id BIGINT NOT NULL,
    end_offset BIGINT NOT NULL, state TEXT NOT NULL, PRIMARY KEY (topic_id, partition));
INSERT INTO kafka_producer_ids (id, next_id) VALUES (0, 1000) ON CONFLICT (id) DO NOTHING
"""),
]


class ProducerStore:
    """Durable producer-id counter and partition snapshots in the metadata database.

    Uses its own connection (``storage.sqldb``, tables ``kafka_producer_*``) so it needs nothing
    from the broker core's metastore; writes are small and committed synchronously, which is
    what makes an allocated producer id never reused after a crash, and, with brokers sharing a
    PostgreSQL database, never handed out twice in the cluster."""

    def __init__(self, db_url: str) -> None:
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="s3kafka-producer-snapshots")
        self._db = sqldb.connect(db_url)
        try:
            self._db.migrate("producers", STEPS)
        except BaseException:
            self._db.close()
            raise

    def allocate_producer_id(self) -> int:
        """A producer id never handed out before (committed before it is returned)."""
        return self._db.transact(self._allocate)

    @staticmethod
    def _allocate(tx: sqldb.Tx) -> int:
        (pid,) = tx.query_one("SELECT next_id FROM kafka_producer_ids WHERE id = 0")
        tx.execute("UPDATE kafka_producer_ids SET next_id = ? WHERE id = 0", (pid + 1,))
        return int(pid)

    def init_transactional(self, transactional_id: str) -> tuple[int, int]:
        """Producer id and bumped epoch for a transactional id (fences the previous instance);
        one transaction, so two brokers never hand out the same (id, epoch)."""
        def body(tx: sqldb.Tx) -> tuple[int, int]:
            row = tx.query_one("SELECT producer_id, epoch FROM kafka_producer_txn_ids"
                               " WHERE transactional_id = ?", (transactional_id,))
            if row is None or row[1] + 1 >= EPOCH_MAX:
                pid, epoch = self._allocate(tx), 0
            else:
                pid, epoch = int(row[0]), int(row[1]) + 1
            tx.execute("INSERT INTO kafka_producer_txn_ids (transactional_id, producer_id, epoch)"
                       " VALUES (?, ?, ?) ON CONFLICT (transactional_id) DO UPDATE SET"
                       " producer_id=excluded.producer_id, epoch=excluded.epoch",
                       (transactional_id, pid, epoch))
            return pid, epoch
        return self._db.transact(body)

    def save_snapshot_later(self, topic_id: str, partition: int, stream_id: int,
                            end_offset: int, state: str) -> "concurrent.futures.Future[None]":
        """Write a snapshot on the store's own thread (in submission order), off the event
        loop: each write is an fsync."""
        return self._writer.submit(self.save_snapshot, topic_id, partition, stream_id,
                                   end_offset, state)

    def save_snapshot(self, topic_id: str, partition: int, stream_id: int, end_offset: int,
                      state: str) -> None:
        self._db.execute(
            "INSERT INTO kafka_producer_snapshots (topic_id, partition, stream_id, end_offset,"
            " state) VALUES (?, ?, ?, ?, ?) ON CONFLICT (topic_id, partition) DO UPDATE SET"
            " stream_id=excluded.stream_id, end_offset=excluded.end_offset,"
            " state=excluded.state",
            (topic_id, partition, stream_id, end_offset, state))

    def load_snapshot(self, topic_id: str, partition: int,
                      stream_id: int) -> tuple[int, str] | None:
        """(end offset covered, state JSON) of the last snapshot of this partition's stream."""
        row = self._db.query_one(
            "SELECT stream_id, end_offset, state FROM kafka_producer_snapshots"
            " WHERE topic_id = ? AND partition = ?", (topic_id, partition))
        if row is None or int(row[0]) != stream_id:
            return None
        return int(row[1]), str(row[2])

    def delete_snapshots(self, topic_id: str) -> None:
        self._db.execute("DELETE FROM kafka_producer_snapshots WHERE topic_id = ?", (topic_id,))

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._db.close()


def producer_store_for(broker: object) -> ProducerStore:
    """The broker's ProducerStore, opened on first use next to the broker's metadata."""
    store = getattr(broker, "_datapath_producer_store", None)
    if store is None:
        store = ProducerStore(_meta_db_url(broker))
        setattr(broker, "_datapath_producer_store", store)
    return store


def _meta_db_url(broker: object) -> str:
    cfg = getattr(broker, "config", None)
    url = str(getattr(cfg, "metadata_url", "") or getattr(cfg, "metadata", "") or "")
    if url:
        return url
    data_dir = str(getattr(cfg, "data_dir", None) or ".")
    return f"{data_dir}/meta.db"

