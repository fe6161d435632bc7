"""Background upkeep of the object store: delete dead objects, compact small ones.

- Leftovers (start-up): objects prepared but never committed (a crash between put and commit)
  and objects destroyed but not yet deleted are noted at start-up (metadata only) and removed
  from the store and the metadata in the background, so start-up never waits on the store.
- Cleanup: an object whose every range lies below its stream's start offset (retention,
  DeleteRecords) or belongs to a deleted stream is marked destroyed, and its key is deleted one
  pass later (a read that already looked it up can still finish).
- Compaction: stream set objects and small stream objects are merged into one stream object
  per contiguous run of each stream, committed in one transaction that also destroys the inputs.
- Rewrite (``rewrite_stream``): a caller (the broker's log cleaner) filters one stream's
  committed payloads - each kept, replaced or dropped - and the result replaces the old objects
  in one transaction. A stream's offsets may then have gaps (dropped payloads); each object's
  range keeps the bounds of the ranges it replaced, so ranges stay contiguous.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from .crash import crash_point
from .episodes import Episode
from .metastore import NewObject, ObjectRange
from .loop_slices import encode_object_in_slices
from .objects.format import CorruptObjectError, Record, StreamRange, decode_object
from .objects.store import ObjectStoreError
from .thread_priority import background_executor

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)
# the object store's temp files of interrupted puts are swept at start-up and this often
TEMP_SWEEP_INTERVAL_S = 600.0

# keep(base_offset, count, payload, must_keep) -> replacement payload, or None to drop it.
# ``must_keep`` marks the last payload of the rewritten range: it pins the range's end offset
# and may not be dropped (the caller shrinks it instead).
PayloadFilter = Callable[[int, int, memoryview, bool], "bytes | bytearray | memoryview | None"]


@dataclass
class RewriteResult:
    """What one rewrite did; ``start``/``end`` are the offsets actually covered (whole
    object ranges)."""

    start: int = 0
    end: int = 0
    objects_before: int = 0
    objects_after: int = 0
    bytes_before: int = 0        # the stream's payload bytes read
    bytes_after: int = 0         # the stream's payload bytes written
    payloads_dropped: int = 0


_filter_pool: concurrent.futures.ThreadPoolExecutor | None = None


def filter_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The thread a rewrite decodes and filters on: SCHED_BATCH and the idle I/O class, but
    nice 0. It runs Python over every record, holding the GIL most of the time; at nice 19 the
    kernel preempted it while it held the GIL and the event loop waited for its next slice
    (priority inversion: 100-400 ms loop stalls under load, see docs/storage.md)."""
    global _filter_pool
    if _filter_pool is None:
        _filter_pool = background_executor(1, "s3kafka-rewrite", 0, "idle")
    return _filter_pool


class Maintenance:
    """Cleanup and compaction for one engine (runs on its event loop)."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._doomed: list[tuple[int, str]] = []   # destroyed, key to delete next pass
        self._last_compaction = time.monotonic()
        self.compactions = 0
        self.deleted_objects = 0
        # a store outage fails every round (each cleanup_interval_s): one line per episode
        self.failing = Episode(log, "maintenance_failing", quiet_s=float("inf"))
        self.rewrites = 0
        # compaction and rewrites both replace objects: never at the same time
        self.lock = asyncio.Lock()
        self._leftovers: list[tuple[int, str]] = []  # (object id, key) a crash left behind
        self._last_sweep = 0.0                         # (monotonic) see sweep_temp_files

    def forget_later(self, objects: list[tuple[int, str]]) -> None:
        """Objects of a failed upload: delete their keys and rows on the next cleanup pass."""
        self._doomed.extend(objects)

    async def find_leftovers(self) -> None:
        """Note what a crash left: this node's prepared (never committed) objects (another
        broker sharing the metadata may be uploading its own right now) and destroyed ones.
        Metadata only, so start-up never waits on the object store; called before the first
        upload, so no prepared row of this run is among them; ``run`` deletes them in the
        background."""
        e = self.engine
        left = await e.io(e.meta.objects_in_state, "prepared", e.config.node_id)
        left += await e.io(e.meta.objects_in_state, "destroyed")
        self._leftovers = left

    async def delete_leftovers(self) -> None:
        """Remove the leftovers ``find_leftovers`` noted (raises while the store is down)."""
        e = self.engine
        left = self._leftovers
        if left:
            await e.io(e.store.delete, [k for _, k in left])
            await e.io(e.meta.forget_objects, [oid for oid, _ in left])
            log.info("deleted %d leftover objects", len(left))
        self._leftovers = []

    async def sweep_temp_files(self) -> None:
        """Remove the temp files of puts a crash interrupted (a file:// store's
        ``sweep_temp_files``; other stores have none). Never fails the caller."""
        e = self.engine
        sweep = getattr(e.store, "sweep_temp_files", None)
        if sweep is None:
            return
        self._last_sweep = time.monotonic()
        try:
            n = await e.io(sweep)
        except Exception as ex:  # noqa: BLE001 - a directory that cannot be read: next time
            log.warning("could not sweep the object store's temp files: %s", ex)
            return
        if n:
            log.info("swept %d temp files of interrupted object puts", n)

    async def run(self) -> None:
        c = self.engine.config
        # in the background (start-up never waits on the store), then once in a while: a
        # temp file must be TEMP_SWEEP_AGE_S old to go, so one a crash just left waits
        await self.sweep_temp_files()
        while self._leftovers:          # first, in the background: the store may be down
            try:
                await self.delete_leftovers()
            except asyncio.CancelledError:
                raise
            except Exception as ex:     # store unreachable: the rows stay, retry
                self.failing.hit(f"could not delete leftover objects yet, retrying: {ex}")
                await asyncio.sleep(min(c.cleanup_interval_s, 5.0))
        while True:
            await asyncio.sleep(min(c.cleanup_interval_s, c.compaction_interval_s))
            try:
                await self.cleanup()
                if time.monotonic() - self._last_sweep >= TEMP_SWEEP_INTERVAL_S:
                    await self.sweep_temp_files()
                if time.monotonic() - self._last_compaction >= c.compaction_interval_s:
                    self._last_compaction = time.monotonic()
                    await self.compact()
                self.failing.clear()
            except asyncio.CancelledError:
                raise
            except Exception as ex:        # store down etc.: try again next round
                self.failing.hit(f"maintenance round failed, retrying each round: {ex}")

    def _dead(self, r: ObjectRange) -> bool:
        s = self.engine.streams.get(r.stream_id)
        # a stream another node writes: its start offset here may be stale, never delete
        return s is None or s.deleted or (s.owned and r.end_offset <= s.start_offset)

    async def cleanup(self) -> int:
        """One cleanup pass; returns how many objects were marked destroyed."""
        e = self.engine
        if self._doomed:
            doomed, self._doomed = self._doomed, []
            try:
                await e.io(e.store.delete, [k for _, k in doomed])
            except Exception:
                self._doomed.extend(doomed)       # store still down: next pass
                raise
            await e.io(e.meta.forget_objects, [oid for oid, _ in doomed])
            self.deleted_objects += len(doomed)
        dead = [(oid, rs[0].key) for oid, rs in e.reader.objects.items()
                if rs and all(self._dead(r) for r in rs)]
        if dead:
            await e.io(e.meta.mark_destroyed, [oid for oid, _ in dead])
            e.reader.remove([oid for oid, _ in dead])
            self._doomed.extend(dead)
            log.info("%d objects no longer needed", len(dead))
        return len(dead)

    async def purge(self) -> None:
        """Two cleanup passes back to back: dead objects are gone from the store after it."""
        await self.cleanup()
        await self.cleanup()

    async def compact(self) -> int:
        """One compaction round; returns the number of objects replaced."""
        async with self.lock:
            return await self._compact()

    async def _compact(self) -> int:
        e = self.engine
        c = e.config
        # only objects whose every stream this node writes: another node's reader keeps
        # its own map of the objects of the streams it owns (a shared object store)
        mine = {oid: rs for oid, rs in e.reader.objects.items()
                if rs and all(getattr(e.streams.get(r.stream_id), "owned", False) for r in rs)}
        ssos = [(oid, rs) for oid, rs in mine.items() if rs[0].kind == "sso"]
        in_sso = {r.stream_id for _, rs in ssos for r in rs}
        small: dict[int, list[tuple[int, list[ObjectRange]]]] = {}
        for oid, rs in mine.items():
            if rs[0].kind == "so" and rs[0].size < c.small_object_bytes:
                small.setdefault(rs[0].stream_id, []).append((oid, rs))
        # a lone small stream object is left alone unless new data of its stream arrived:
        # otherwise every round would rewrite it
        cands = sorted(ssos + [o for sid, objs in small.items()
                               if len(objs) >= 2 or sid in in_sso for o in objs])
        if len(cands) < max(c.compaction_min_objects, 2):
            return 0
        picked: list[tuple[int, list[ObjectRange]]] = []
        total = 0
        for oid, rs in cands:
            if picked and total + rs[0].size > c.compaction_max_bytes:
                break
            picked.append((oid, rs))
            total += rs[0].size
        if len(picked) < 2:
            return 0
        per_stream: dict[int, list[Record]] = {}
        old_ranges: dict[int, list[ObjectRange]] = {}
        for oid, rs in picked:
            for r in rs:
                old_ranges.setdefault(r.stream_id, []).append(r)
            try:
                data = await e.io(e.store.get, rs[0].key, 0, None)
                records = list(decode_object(data))
            except (CorruptObjectError, ObjectStoreError) as ex:
                log.error("compaction skipped: object %s unreadable: %s", rs[0].key, ex)
                return 0
            for rec in records:
                s = e.streams.get(rec.stream_id)
                if s is None or s.deleted or rec.end_offset <= s.start_offset:
                    continue
                per_stream.setdefault(rec.stream_id, []).append(rec)
        # a run is a stretch of adjacent old ranges: its new range keeps their bounds, so a
        # rewritten (sparse) stream stays covered without gaps between objects
        runs: list[tuple[StreamRange, list[Record]]] = []
        for sid in sorted(per_stream):
            recs = sorted(per_stream[sid], key=lambda r: r.base_offset)
            spans: list[list[int]] = []
            for r in sorted(old_ranges.get(sid, []), key=lambda r: r.start_offset):
                if spans and r.start_offset == spans[-1][1]:
                    spans[-1][1] = r.end_offset
                else:
                    spans.append([r.start_offset, r.end_offset])
            i = 0
            for lo, hi in spans:
                run: list[Record] = []
                while i < len(recs) and recs[i].base_offset < hi:
                    rec = recs[i]
                    i += 1
                    if rec.base_offset < lo or (run and rec.base_offset < run[-1].end_offset):
                        continue                 # duplicate (should not happen)
                    run.append(rec)
                if run:
                    runs.append((StreamRange(sid, lo, hi), run))
        new: list[tuple[NewObject, str]] = []
        for span, run in runs:
            oid, key = await e.io(e.meta.prepare_object, "so", c.node_id)
            data, _index, ranges = await encode_object_in_slices(run, c.object_block_bytes)
            # the records of a run's tail may lie below a trimmed start: keep the span's end
            span.start_offset = min(span.start_offset, ranges[0].start_offset)
            if ranges[0].end_offset < span.end_offset:
                span.end_offset = ranges[0].end_offset
            await e.io(e.store.put, key, data)
            new.append((NewObject(oid, len(data), [span]), key))
        crash_point("during_compaction")
        old_ids = [oid for oid, _ in picked]
        await e.io(e.meta.commit_objects, [n for n, _ in new], old_ids)
        e.reader.remove(old_ids)
        e.reader.add([ObjectRange(n.object_id, key, "so", n.size, r.stream_id, r.start_offset,
                                  r.end_offset) for n, key in new for r in n.ranges])
        self._doomed.extend((oid, rs[0].key) for oid, rs in picked)
        self.compactions += 1
        e.stats.compacted_objects += len(picked)
        log.info("compacted %d objects into %d", len(picked), len(new))
        return len(picked)

    async def rewrite_stream(self, stream_id: int, start: int, end: int, keep: PayloadFilter,
                             max_object_bytes: int = 64 << 20,
                             max_bytes_per_s: float = 0.0) -> RewriteResult:
        """Rewrite the committed objects holding ``stream_id``'s offsets [start, end) through
        ``keep`` and replace them in one metadata transaction.

        Only whole object ranges are rewritten: from the one holding ``start`` up to the last
        one ending at or before ``end`` (the result says which). Objects are read one at a
        time and ``keep`` runs on a background thread (SCHED_BATCH, idle I/O), so memory stays
        bounded by one input object plus one output object, and the event loop keeps serving;
        with
        ``max_bytes_per_s`` the reads are paced. Other streams' records in a stream set object
        are copied unchanged into a new stream set object. The old objects stay readable
        until the commit, and are deleted one cleanup pass later (reads in progress finish).
        """
        async with self.lock:
            return await self._rewrite(stream_id, start, end, keep, max_object_bytes,
                                       max_bytes_per_s)

    def _rewrite_plan(self, stream_id: int, start: int, end: int) -> list[ObjectRange]:
        picked: list[ObjectRange] = []
        for r in self.engine.reader.stream_ranges(stream_id):
            if r.end_offset <= start:
                continue
            if r.end_offset > end or (picked and r.start_offset != picked[-1].end_offset):
                break
            if sum(1 for x in self.engine.reader.objects.get(r.object_id, [])
                   if x.stream_id == stream_id) != 1:
                break                 # one object, two ranges of the stream: not expected
            picked.append(r)
        return picked

    async def _rewrite(self, stream_id: int, start: int, end: int, keep: PayloadFilter,
                       max_object_bytes: int, max_bytes_per_s: float) -> RewriteResult:
        e = self.engine
        c = e.config
        res = RewriteResult(start, start)
        picked = self._rewrite_plan(stream_id, start, end)
        if not picked:
            return res
        res.start, res.end = picked[0].start_offset, picked[-1].end_offset
        prepared: list[tuple[int, str]] = []
        new: list[tuple[NewObject, str, str]] = []
        out: list[Record] = []
        out_bytes = 0
        rest: list[_Piece] = []         # other streams' records of stream set objects
        rest_bytes = 0
        seg_start = res.start
        loop = asyncio.get_running_loop()

        async def put(kind: str, recs: list[Record], rng: list[StreamRange] | None) -> None:
            oid, key = await e.io(e.meta.prepare_object, kind, c.node_id)
            prepared.append((oid, key))
            data, _index, ranges = await encode_object_in_slices(recs, c.object_block_bytes)
            await e.io(e.store.put, key, data)
            new.append((NewObject(oid, len(data), rng or ranges), key, kind))

        async def put_rest(pieces: list[_Piece]) -> None:
            for recs, rng in _carry_objects(pieces):
                await put("sso", recs, rng)

        def run_filter(data: bytes | memoryview, r: ObjectRange, last_end: int,
                       declared: list[StreamRange]
                       ) -> tuple[list[Record], list[_Piece], int, int, int]:
            """Decode one input object and filter its payloads of the stream (on a thread:
            Python work over every record); other streams' records within the object's
            declared ranges are copied unchanged, one piece per declared range."""
            records = list(decode_object(data))
            recs = [x for x in records if x.stream_id == stream_id
                    and r.start_offset <= x.base_offset < r.end_offset]
            others = [_Piece(d, [Record(x.stream_id, x.base_offset, x.count, bytes(x.payload))
                                 for x in records if x.stream_id == d.stream_id
                                 and x.end_offset > d.start_offset
                                 and x.base_offset < d.end_offset])
                      for d in declared]
            others = [p for p in others if p.records]
            kept: list[Record] = []
            before = after = dropped = 0
            for rec in recs:
                before += len(rec.payload)
                rep = keep(rec.base_offset, rec.count, memoryview(rec.payload),
                           rec.end_offset == last_end)
                if rep is None:
                    if rec.end_offset == last_end:
                        raise ValueError("the last payload of a rewritten range was dropped")
                    dropped += 1
                    continue
                rep = bytes(rep)          # a copy: the input object's buffer can go
                kept.append(Record(rec.stream_id, rec.base_offset, rec.count, rep))
                after += len(rep)
            return kept, others, before, after, dropped

        try:
            for r in picked:
                t0 = time.monotonic()
                data = await e.cold_io(e.store.get, r.key, 0, None)
                declared = [StreamRange(x.stream_id, x.start_offset, x.end_offset)
                            for x in e.reader.objects.get(r.object_id, [])
                            if x.stream_id != stream_id]
                # a background thread (filter_executor): the event loop keeps serving meanwhile
                kept, others, before, after, dropped = await loop.run_in_executor(
                    filter_executor(), run_filter, data, r, res.end, declared)
                res.objects_before += 1
                res.bytes_before += before
                res.bytes_after += after
                res.payloads_dropped += dropped
                rest.extend(others)         # a stream set object: the rest passes unchanged
                rest_bytes += sum(len(x.payload) for p in others for x in p.records)
                del others, data
                if rest_bytes >= max_object_bytes:
                    await put_rest(rest)
                    rest, rest_bytes = [], 0
                for rec in kept:
                    out.append(rec)
                    out_bytes += len(rec.payload)
                    if out_bytes >= max_object_bytes:
                        seg_end = rec.end_offset
                        await put("so", out, [StreamRange(stream_id, seg_start, seg_end)])
                        res.objects_after += 1
                        seg_start, out, out_bytes = seg_end, [], 0
                if max_bytes_per_s > 0:
                    pause = r.size / max_bytes_per_s - (time.monotonic() - t0)
                    if pause > 0:
                        await asyncio.sleep(pause)
            if rest:
                await put_rest(rest)
            if out:
                await put("so", out, [StreamRange(stream_id, seg_start, res.end)])
                res.objects_after += 1
            if seg_start != res.end and not out:
                raise ValueError("rewrite left the end of the range uncovered")
            s = e.streams.get(stream_id)
            old_ids = sorted({r.object_id for r in picked})
            if s is None or s.deleted or any(oid not in e.reader.objects for oid in old_ids):
                raise _Abandoned("stream deleted or objects cleaned up meanwhile")
            crash_point("during_rewrite")
            await e.io(e.meta.commit_objects, [n for n, _, _ in new], old_ids)
        except BaseException as ex:
            self.forget_later(prepared)
            if isinstance(ex, _Abandoned):
                log.info("rewrite of stream %d abandoned: %s", stream_id, ex)
                return RewriteResult(res.start, res.start)
            raise
        # one synchronous step: a read sees either the old objects or the new ones
        doomed = [(oid, e.reader.objects[oid][0].key) for oid in old_ids]
        e.reader.remove(old_ids)
        e.reader.add([ObjectRange(n.object_id, key, kind, n.size, rg.stream_id, rg.start_offset,
                                  rg.end_offset) for n, key, kind in new for rg in n.ranges])
        e.cache.forget_below(stream_id, res.end)
        self._doomed.extend(doomed)
        self.rewrites += 1
        log.info("rewrote stream %d offsets %d..%d: %d objects -> %d, %d -> %d bytes",
                 stream_id, res.start, res.end, res.objects_before, res.objects_after,
                 res.bytes_before, res.bytes_after)
        return res


class _Piece(NamedTuple):
    """Another stream's share of a rewritten stream set object: its declared range and the
    records stored for it."""

    range: StreamRange
    records: list[Record]


def _carry_objects(pieces: list[_Piece]) -> list[tuple[list[Record], list[StreamRange]]]:
    """Group other streams' pieces into new stream set objects, each holding one contiguous
    range per stream.

    The rewritten objects need not hold all of another stream's offsets between them (its
    ranges in objects that held none of the rewritten stream stay where they are), and an
    object's one range per stream spans from its first record to its last: pieces that do
    not touch end to end go to separate objects, or the new range would cover offsets that
    other objects serve and shadow them."""
    runs: dict[int, list[list[_Piece]]] = {}
    for p in sorted(pieces, key=lambda p: (p.range.stream_id, p.range.start_offset)):
        own = runs.setdefault(p.range.stream_id, [])
        if own and own[-1][-1].range.end_offset == p.range.start_offset:
            own[-1].append(p)
        else:
            own.append([p])
    out: list[tuple[list[Record], list[StreamRange]]] = []
    for k in range(max((len(v) for v in runs.values()), default=0)):
        recs: list[Record] = []
        rng: list[StreamRange] = []
        for sid in sorted(runs):
            if k < len(runs[sid]):
                run = runs[sid][k]
                recs.extend(x for p in run for x in p.records)
                rng.append(StreamRange(sid, run[0].range.start_offset, run[-1].range.end_offset))
        if recs:
            out.append((recs, rng))
    return out


class _Abandoned(Exception):
    """A rewrite whose inputs changed under it: nothing is committed."""
