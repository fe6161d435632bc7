"""Background upkeep of the object store: delete dead objects, compact small ones.

- Leftovers (start-up): objects prepared but never committed (a crash between put and commit)
  and objects destroyed but not yet deleted are removed from the store and the metadata.
- Cleanup: an object whose every range lies below its stream's start offset (retention,
  DeleteRecords) or belongs to a deleted stream is marked destroyed, and its key is deleted one
  pass later (a read that already looked it up can still finish).
- Compaction: stream set objects and small stream objects are merged into one stream object
  per contiguous run of each stream, committed in one transaction that also destroys the inputs.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from .crash import crash_point
from .episodes import Episode
from .metastore import NewObject, ObjectRange
from .loop_slices import encode_object_in_slices
from .objects.format import CorruptObjectError, Record, decode_object
from .objects.store import ObjectStoreError

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)


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

    def forget_later(self, objects: list[tuple[int, str]]) -> None:
        """Objects of a failed upload: delete their keys and rows on the next cleanup pass."""
        self._doomed.extend(objects)

    async def delete_leftovers(self) -> None:
        """Remove what a crash left: this node's prepared (never committed) objects (another
        broker sharing the metadata may be uploading its own right now) and destroyed ones."""
        e = self.engine
        left = await e.io(e.meta.objects_in_state, "prepared", e.config.node_id)
        left += await e.io(e.meta.objects_in_state, "destroyed")
        if left:
            await e.io(e.store.delete, [k for _, k in left])
            await e.io(e.meta.forget_objects, [oid for oid, _ in left])
            log.info("deleted %d leftover objects", len(left))

    async def run(self) -> None:
        c = self.engine.config
        while True:
            await asyncio.sleep(min(c.cleanup_interval_s, c.compaction_interval_s))
            try:
                await self.cleanup()
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
        return s is None or s.deleted or r.end_offset <= s.start_offset

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
        e = self.engine
        c = e.config
        ssos = [(oid, rs) for oid, rs in e.reader.objects.items() if rs and rs[0].kind == "sso"]
        in_sso = {r.stream_id for _, rs in ssos for r in rs}
        small: dict[int, list[tuple[int, list[ObjectRange]]]] = {}
        for oid, rs in e.reader.objects.items():
            if rs and rs[0].kind == "so" and rs[0].size < c.small_object_bytes:
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
        for oid, rs in picked:
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
        runs: list[list[Record]] = []
        for sid in sorted(per_stream):
            recs = sorted(per_stream[sid], key=lambda r: r.base_offset)
            run: list[Record] = []
            for rec in recs:
                if run and rec.base_offset < run[-1].end_offset:
                    continue                     # duplicate (should not happen)
                if run and rec.base_offset != run[-1].end_offset:
                    runs.append(run)
                    run = []
                run.append(rec)
            if run:
                runs.append(run)
        new: list[tuple[NewObject, str]] = []
        for run in runs:
            oid, key = await e.io(e.meta.prepare_object, "so", c.node_id)
            data, _index, ranges = await encode_object_in_slices(run, c.object_block_bytes)
            await e.io(e.store.put, key, data)
            new.append((NewObject(oid, len(data), ranges), key))
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
