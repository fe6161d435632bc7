"""The log cleaner: ``cleanup.policy=compact`` keeps the latest record per key.

Done as Kafka's LogCleaner does it, over the stream's objects instead of segments:

- Only data already in objects is cleaned (``Stream.uploaded_offset``); the un-uploaded tail
  plays the active segment. The first offset not yet cleaned (the "first dirty offset") and
  the earliest delete horizon of a kept tombstone are kept per stream in
  ``<data-dir>/cleaner-offset-checkpoint`` (Kafka's file of that name); without it (lost, or
  the partition moved to another broker) the whole log counts as dirty once.
- A partition is cleaned when its dirty bytes are at least ``min.cleanable.dirty.ratio`` of
  its bytes, or when its first dirty batch is older than ``max.compaction.lag.ms``. Batches
  newer than ``min.compaction.lag.ms`` are not cleaned yet.
- A pass reads the dirty section and builds an offset map (key hash -> latest offset) of at
  most ``--log-cleaner-dedupe-buffer-size`` bytes; when the map fills, the pass stops there
  and the rest waits for the next pass. The stream's objects from the log start up to the
  end of the mapped section are then rewritten (``Stream.rewrite``, storage/maintenance.py):
  a record is kept unless a later offset of its key is in the map. Batches keep their base
  offset, last offset delta, producer id/epoch and base sequence (offsets are preserved; a
  compacted log has gaps), kept records are re-encoded with their offsets and timestamps and a
  new CRC-32C; a batch left without records is dropped, except the last batch of a producer
  and the last batch of a payload storage needs to pin a range's end, kept empty (as Kafka
  keeps empty batches to preserve producer state).
- Tombstones (records with a key and a null value) get a delete horizon the first time the
  cleaner processes them (KIP-534: the batch's delete-horizon flag, base timestamp = now +
  ``delete.retention.ms``) and are removed by the first pass after it.
- Keyless records are kept (the produce path refuses them on compacted topics).
- Transactions: nothing at or past the last stable offset is cleaned (an ongoing transaction
  may still abort). Aborted transactional batches (the partition's aborted index) are never
  mapped (they supersede nothing) and are removed, except a producer's last batch, kept
  empty. A COMMIT or ABORT marker whose transaction has no batch left gets a delete horizon
  (now + ``delete.retention.ms``) and is removed by the first pass after it, with its
  aborted-index entry (Kafka's rule: a reader that fetched the data before it went still
  finds the marker for as long as a tombstone would be kept).

Cost and pacing: every record of the log is decoded in Python on a background thread
(SCHED_BATCH and the idle I/O class, but nice 0: see docs/storage.md on priority inversion),
reads are paced to ``--log-cleaner-io-max-bytes-per-second``, and the rewrite holds one input
and one output object at a time, so memory is bounded by the offset map plus two objects.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from protocol.batches import CONTROL_MASK, DELETE_HORIZON_MASK, TRANSACTIONAL_MASK, iter_batches
from protocol.errors import CorruptRecordError
from protocol.records import decode_records, rebuild_batch
from storage.thread_priority import background_executor

from .partition import Partition
from .periodic import Periodic

log = logging.getLogger(__name__)

DEFAULT_BACKOFF_MS = 15_000                   # Kafka's log.cleaner.backoff.ms
DEFAULT_DEDUPE_BUFFER = 128 << 20             # Kafka's log.cleaner.dedupe.buffer.size
DEFAULT_IO_BYTES_PER_S = 32 << 20             # log.cleaner.io.max.bytes.per.second
MAP_ENTRY_BYTES = 120                         # a Python dict entry int -> int, measured
READ_BYTES = 1 << 20
CHECKPOINT_FILE = "cleaner-offset-checkpoint"
NO_PRODUCER = -1
LONG_MAX = (1 << 63) - 1


def _num(configs: dict[str, str], name: str, default: float) -> float:
    try:
        return float(configs.get(name, default))
    except (TypeError, ValueError):
        return default


def is_compacted(configs: dict[str, str]) -> bool:
    return "compact" in str(configs.get("cleanup.policy", "delete")).replace(" ", "").split(",")


@dataclass
class CleanResult:
    """One pass over one partition (logged, and returned to tests and the benchmark)."""

    start: int
    end: int
    map_end: int
    keys: int
    bytes_before: int
    bytes_after: int
    objects_before: int
    objects_after: int
    records_read: int = 0
    records_dropped: int = 0
    tombstones_dropped: int = 0
    aborted_dropped: int = 0          # records of aborted transactions removed
    markers_dropped: int = 0          # markers removed (their transaction's data is gone)


@dataclass
class _OffsetMap:
    """Key hash -> latest offset over [start, end) of the dirty section, plus the base offset
    of each live idempotent producer's last batch (never dropped, even emptied: it carries
    the producer's sequence state, as in Kafka)."""

    capacity: int
    start: int
    end: int = -1
    latest: dict[int, int] = field(default_factory=dict)
    producer_last: dict[int, int] = field(default_factory=dict)
    records: int = 0
    aborted: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # pid -> (first, last)

    def is_aborted(self, producer_id: int, offset: int) -> bool:
        return any(first <= offset < last for first, last in self.aborted.get(producer_id, ()))


def _map_payloads(m: _OffsetMap, payloads: list[tuple[int, int, memoryview]], end: int,
                  max_ts_allowed: int) -> bool:
    """Map the keys of whole payloads (base, next offset, bytes) in order, advancing ``m.end``;
    False once a payload cannot be mapped: past ``end``, the map full, a batch too recent for
    min.compaction.lag.ms (or unreadable). Runs on the cleaner's thread."""
    latest = m.latest
    for base, nxt, payload in payloads:
        if nxt <= m.end:
            continue
        if nxt > end or (latest and len(latest) + (nxt - base) > m.capacity):
            return False
        views = list(iter_batches(payload))
        if any(v.max_timestamp > max_ts_allowed for v in views):
            return False
        for v in views:
            if v.attributes & CONTROL_MASK:
                continue
            if v.attributes & TRANSACTIONAL_MASK and m.is_aborted(v.producer_id, v.base_offset):
                continue                 # aborted data never supersedes anything
            for r in decode_records(v):
                m.records += 1
                if r.key is not None:
                    latest[hash(r.key)] = r.offset
        m.end = nxt
    return True


class _Filter:
    """The payload filter handed to ``Stream.rewrite`` (runs on a storage thread, called for
    every payload of the rewritten range in offset order, from the log start).

    Transactions, as Kafka's cleaner does them: an aborted transaction's batches are removed
    (the producer's last batch is kept empty: it carries its sequence state); a marker whose
    transaction has no batch left in the log gets a delete horizon (now +
    ``delete.retention.ms``, the KIP-534 flag a tombstone gets) and is removed by the first
    pass after it, so a reader that fetched the transaction's data before it went still sees
    its marker. ``txn_retained`` follows, per producer, whether a batch of its transaction in
    progress (in offset order) survived this pass."""

    def __init__(self, m: _OffsetMap, now_ms: int, delete_retention_ms: int) -> None:
        self.m = m
        self.now = now_ms
        self.horizon = now_ms + delete_retention_ms
        self.records = self.dropped = self.tombstones = 0
        self.aborted_dropped = 0                 # records of aborted transactions removed
        self.markers_removed: list[tuple[int, int]] = []   # (producer id, marker offset)
        self.next_horizon: int | None = None     # earliest horizon of a tombstone/marker kept
        self.txn_retained: dict[int, bool] = {}

    def _note_horizon(self, h: int) -> None:
        if self.next_horizon is None or h < self.next_horizon:
            self.next_horizon = h

    def _marker(self, v: Any, raw: memoryview, last: bool, out: bytearray) -> bool:
        """Keep, flag or drop one control batch; True when the payload changed."""
        retained = self.txn_retained.pop(v.producer_id, False)
        if retained or not v.attributes & TRANSACTIONAL_MASK:
            out += raw                           # its transaction still has data here
            return False
        if v.attributes & DELETE_HORIZON_MASK:
            if v.base_timestamp <= self.now and not last:
                self.markers_removed.append((v.producer_id, v.base_offset))
                return True                      # delete.retention.ms has passed
            self._note_horizon(v.base_timestamp)
            out += raw
            return False
        recs = decode_records(v)
        if not recs:
            out += raw                           # an empty control batch: nothing to flag
            return False
        out += rebuild_batch(v, recs, self.horizon)
        self._note_horizon(self.horizon)
        return True

    def __call__(self, base: int, count: int, data: memoryview, must_keep: bool
                 ) -> bytes | memoryview | None:
        if base >= self.m.end:
            return data                      # past the mapped section: not cleaned yet
        out = bytearray()
        changed = False
        views = list(iter_batches(data))
        for i, v in enumerate(views):
            raw = data[v.pos:v.pos + v.size]
            last = must_keep and i == len(views) - 1
            if v.attributes & CONTROL_MASK:
                changed |= self._marker(v, raw, last, out)
                continue
            transactional = bool(v.attributes & TRANSACTIONAL_MASK)
            pid_last = self.m.producer_last.get(v.producer_id)
            keep_empty = last or (v.producer_id != NO_PRODUCER and pid_last == v.base_offset)
            if transactional and self.m.is_aborted(v.producer_id, v.base_offset):
                # aborted data: removed (read_uncommitted readers stop seeing it too)
                self.txn_retained[v.producer_id] = self.txn_retained.get(v.producer_id,
                                                                         False) or keep_empty
                if v.record_count == 0 and keep_empty:
                    out += raw
                    continue
                self.aborted_dropped += v.record_count
                self.dropped += v.record_count
                changed = True
                if keep_empty:
                    out += rebuild_batch(v, [], None)
                continue
            recs = decode_records(v)
            self.records += len(recs)
            kept = []
            has_horizon = bool(v.attributes & DELETE_HORIZON_MASK)
            tombstones = False
            for r in recs:
                if r.key is not None:
                    latest = self.m.latest.get(hash(r.key))
                    if latest is not None and r.offset < latest:
                        continue             # a later value of the key exists
                    if r.value is None:
                        if has_horizon and v.base_timestamp <= self.now:
                            self.tombstones += 1
                            continue         # delete.retention.ms has passed
                        tombstones = True
                        self._note_horizon(v.base_timestamp if has_horizon else self.horizon)
                kept.append(r)
            self.dropped += len(recs) - len(kept)
            if transactional:
                self.txn_retained[v.producer_id] = self.txn_retained.get(v.producer_id, False) \
                    or bool(kept) or keep_empty
            new_horizon = self.horizon if tombstones and not has_horizon else None
            if len(kept) == len(recs) and new_horizon is None:
                out += raw
                continue
            changed = True
            if kept or keep_empty:
                out += rebuild_batch(v, kept, new_horizon)
        if not changed:
            return data
        return bytes(out) if out else None


class LogCleaner:
    """Background compaction of every compacted partition of a broker."""

    def __init__(self, broker: Any) -> None:
        cfg = getattr(broker, "config", None)
        self.broker = broker
        self.backoff_s = float(getattr(cfg, "log_cleaner_backoff_ms", DEFAULT_BACKOFF_MS)) / 1000
        self.map_bytes = int(getattr(cfg, "log_cleaner_dedupe_buffer_size", DEFAULT_DEDUPE_BUFFER))
        self.io_bytes_per_s = float(getattr(cfg, "log_cleaner_io_max_bytes_per_second",
                                            DEFAULT_IO_BYTES_PER_S))
        self.enabled = bool(getattr(cfg, "log_cleaner_enable", True))
        self.dirty_from: dict[int, int] = {}   # stream id -> first dirty offset
        self.horizons: dict[int, int] = {}     # stream id -> earliest tombstone horizon kept
        data_dir = getattr(cfg, "data_dir", None)
        self.checkpoint_path = (os.path.join(data_dir, CHECKPOINT_FILE)
                                if isinstance(data_dir, str) and data_dir else None)
        self._load_checkpoint()
        self.passes = 0
        self._periodic = Periodic("s3kafka-log-cleaner", lambda: self.backoff_s, self._pass, log)
        self._executor = None

    # -- checkpoint ------------------------------------------------------------------------
    def _load_checkpoint(self) -> None:
        if self.checkpoint_path is None or not os.path.exists(self.checkpoint_path):
            return
        try:
            with open(self.checkpoint_path, encoding="utf-8") as f:
                state = json.load(f)
            for sid, st in state["streams"].items():
                self.dirty_from[int(sid)] = int(st["dirty_from"])
                if st.get("horizon") is not None:
                    self.horizons[int(sid)] = int(st["horizon"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("ignoring %s (the logs are cleaned whole once): %s",
                        self.checkpoint_path, e)
            self.dirty_from.clear()
            self.horizons.clear()

    def _save_checkpoint(self) -> None:
        """Write the checkpoint (small; atomically replaced; losing it costs one full pass)."""
        if self.checkpoint_path is None:
            return
        state = {"version": 1, "streams": {
            str(sid): {"dirty_from": off, "horizon": self.horizons.get(sid)}
            for sid, off in self.dirty_from.items()}}
        tmp = self.checkpoint_path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(state, f)
            os.replace(tmp, self.checkpoint_path)
        except OSError as e:
            log.warning("could not write %s: %s", self.checkpoint_path, e)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self.enabled:
            self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    async def _pass(self) -> None:
        """One pass over the compacted partitions this broker leads."""
        from .retention import broker_partitions  # noqa: PLC0415 - retention imports us
        for p in broker_partitions(self.broker):
            if p.closed or not is_compacted(p.configs):
                continue
            try:
                await self.clean(p)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one partition must not stop the cleaner
                log.exception("log cleaner failed topic=%s partition=%d", p.topic, p.index)

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            # nice 0, not 19: the map is built in Python holding the GIL, and a nice-19
            # thread preempted while holding it stalled the event loop until its next slice
            self._executor = background_executor(1, "s3kafka-cleaner", 0, "idle")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- one partition ---------------------------------------------------------------------
    def dirty_stats(self, p: Partition) -> tuple[int, int, int]:
        """(first dirty offset, clean bytes, dirty bytes) of the uploaded part of the log."""
        s = p.stream
        first_dirty = self.dirty_from.get(s.stream_id, 0)
        if first_dirty > s.end_offset:          # a checkpoint that does not fit this log
            first_dirty = 0
        first_dirty = max(first_dirty, s.start_offset)
        end = s.uploaded_offset
        clean = dirty = 0
        for start, stop, size in s.object_ranges():
            if stop <= s.start_offset or start >= end:
                continue
            if stop <= first_dirty:
                clean += size
            elif start >= first_dirty:
                dirty += size
            else:                             # a range across the first dirty offset
                share = (first_dirty - start) / max(1, stop - start)
                clean += int(size * share)
                dirty += size - int(size * share)
        return first_dirty, clean, dirty

    async def clean(self, p: Partition, now_ms: int | None = None, force: bool = False
                    ) -> CleanResult | None:
        """One cleaning pass of ``p`` if it is due (or ``force``); None when nothing was done."""
        s = p.stream
        if not hasattr(s, "rewrite"):
            return None                       # memory storage: nothing to rewrite
        now = int(time.time() * 1000) if now_ms is None else now_ms
        first_dirty, clean, dirty = self.dirty_stats(p)
        # never past an ongoing transaction: its records may still be aborted
        end = min(s.uploaded_offset, p.last_stable_offset)
        # tombstones whose delete horizon passed are removed even with nothing dirty (KIP-534)
        horizon = self.horizons.get(s.stream_id)
        tombstones_due = horizon is not None and now >= horizon
        if (first_dirty >= end or dirty <= 0) and not tombstones_due:
            return None
        ratio = dirty / max(1, clean + dirty)
        min_ratio = _num(p.configs, "min.cleanable.dirty.ratio", 0.5)
        max_lag = _num(p.configs, "max.compaction.lag.ms", LONG_MAX)
        due = force or tombstones_due or (dirty > 0 and ratio >= min_ratio)
        if not due and max_lag < LONG_MAX:
            first_ts = await self._first_timestamp(p, first_dirty)
            due = first_ts is not None and first_ts >= 0 and now - first_ts > max_lag
        if not due:
            return None
        min_lag = int(_num(p.configs, "min.compaction.lag.ms", 0))
        aborted: dict[int, list[tuple[int, int]]] = {}
        for pid, first, last in list(getattr(getattr(p, "txns", None), "aborted", ())):
            aborted.setdefault(pid, []).append((first, last))
        m = await self._build_map(p, first_dirty, end, now - min_lag, aborted)
        entries = getattr(getattr(p, "producers", None), "entries", {})
        m.producer_last = {pid: e.batches[-1].base_offset for pid, e in list(entries.items())
                           if getattr(e, "batches", None)}
        if m.end <= first_dirty and not tombstones_due:
            return None                       # the dirty section is too recent
        f = _Filter(m, now, int(_num(p.configs, "delete.retention.ms", 86_400_000)))
        res = await s.rewrite(s.start_offset, m.end, f,
                              max_bytes_per_s=self.io_bytes_per_s)
        if res.end <= res.start:
            return None
        if f.markers_removed:
            forget = getattr(getattr(p, "txns", None), "forget_aborted", None)
            if forget is not None:   # the marker is gone: so is its aborted-index entry
                forget(f.markers_removed)
                p._dirty = True      # the producer snapshot holds the index
        if f.next_horizon is not None:
            self.horizons[s.stream_id] = f.next_horizon
        else:
            self.horizons.pop(s.stream_id, None)
        # what lies past the rewritten ranges was mapped but not cleaned: dirty still
        self.dirty_from[s.stream_id] = max(first_dirty, min(res.end, m.end))
        self._save_checkpoint()
        self.passes += 1
        out = CleanResult(res.start, res.end, m.end, len(m.latest), res.bytes_before,
                          res.bytes_after, res.objects_before, res.objects_after, f.records,
                          f.dropped, f.tombstones, f.aborted_dropped, len(f.markers_removed))
        log.info("log cleaner topic=%s partition=%d offsets=%d..%d keys=%d bytes=%d->%d "
                 "objects=%d->%d records_dropped=%d tombstones_dropped=%d aborted_dropped=%d "
                 "markers_dropped=%d dirty_ratio=%.2f",
                 p.topic, p.index, res.start, res.end, len(m.latest), res.bytes_before,
                 res.bytes_after, res.objects_before, res.objects_after, f.dropped,
                 f.tombstones, f.aborted_dropped, len(f.markers_removed), ratio)
        return out

    async def _first_timestamp(self, p: Partition, offset: int) -> int | None:
        try:
            batches = await p.stream.read(offset, 1)
            for v in iter_batches(batches[0].payload) if batches else ():
                return v.max_timestamp
        except Exception:  # noqa: BLE001 - a read error only delays the lag check
            return None
        return None

    async def _build_map(self, p: Partition, start: int, end: int, max_ts: int,
                         aborted: dict[int, list[tuple[int, int]]] | None = None) -> _OffsetMap:
        """Offset map of [start, end), stopping when full or at a too-recent batch; ``end``
        of the result is the first offset not mapped (a payload boundary)."""
        m = _OffsetMap(max(1, self.map_bytes // MAP_ENTRY_BYTES), start, start,
                       aborted=aborted or {})
        while m.end < end:
            t0 = time.monotonic()
            batches = await p.stream.read(m.end, READ_BYTES)
            if not batches:
                break
            chunk = [(b.base_offset, b.next_offset, memoryview(b.payload)) for b in batches]
            try:
                more = await self._in_thread(_map_payloads, m, chunk, end, max_ts)
            except CorruptRecordError as e:
                log.error("log cleaner stopped at an unreadable batch topic=%s partition=%d "
                          "offset=%d: %s", p.topic, p.index, m.end, e)
                break
            if not more:
                break
            if self.io_bytes_per_s > 0:
                size = sum(len(b.payload) for b in batches)
                pause = size / self.io_bytes_per_s - (time.monotonic() - t0)
                if pause > 0:
                    await asyncio.sleep(pause)
        return m
