"""Take over a dead node's WAL: fence it, recover it, commit its records, mark it done.

Kafka-free: the cluster layer decides *when* (the node's lease lapsed and its node epoch was
bumped) and *who*; this module does the storage side, blocking (run it in a thread):

1. open the WAL (file or block device) and take its exclusive flock (``force_lock`` proceeds
   without it when the holder is a paused process on this host: the header fence stops it);
2. check it is the WAL asked for (node id, an epoch not newer than the fenced one, never the
   taker's own WAL) and, in the metadata store, take the takeover (compare-and-set on the taker
   epoch: a newer taker wins, a replaced one can no longer commit);
3. write the fence into *both* header slots with a write counter far above the owner's, so the
   owner (a zombie) can neither append after reopening nor overwrite the fence with its next
   header write (it re-reads the header before each one and stops);
4. recover every record after the trim point (the WAL's own recovery scan), drop what each
   stream already has committed, upload the rest as objects and commit them in one
   transaction conditioned on epochs (each stream's owner unchanged, each range starting at
   its stream's committed end, the takeover still this taker's): a second taker after a crash
   commits exactly what the first did not;
5. mark the WAL taken over (done) in its header and in the registry, trim it, release it.

Crash points (``S3KAFKA_CRASH_POINT``, storage/crash.py): takeover_after_fence,
takeover_before_commit, takeover_after_commit, takeover_before_done.
"""
from __future__ import annotations

import logging
import os
import socket
import stat
import time
from dataclasses import dataclass, field

from . import sqldb
from .crash import crash_point
from .metastore import MetaStore, NewObject, TakeoverConflict, WALInfo
from .objects.format import Record, encode_object
from .objects.store import ObjectStore
from .wal.device import Device, aligned_buffer, lock_exclusive
from .wal.errors import FencedError, WALError, WALLockedError, WALPathError
from .wal.format import (HEADER_AREA, HEADER_SLOT_SIZE, RECORD_HEADER_SIZE, TAKEOVER_DONE,
                         TAKEOVER_FENCED, WALHeader, newest_header)
from .wal.recovery import scan

log = logging.getLogger(__name__)

# the engine's WAL record framing (storage/engine.py WAL_RECORD): stream id, base offset, count
from .engine import WAL_RECORD  # noqa: E402

FENCE_COUNTER_JUMP = 1 << 32        # the fence's write counter is this far above the owner's
MAX_OBJECT_BYTES = 64 << 20         # recovered records are uploaded in objects up to this size


class TakeoverError(WALError):
    """The takeover cannot proceed (wrong WAL, a newer owner or taker); nothing was committed
    by this call. The message is one line."""


@dataclass
class TakeoverResult:
    """What one takeover call did (the cluster layer logs it and opens the streams)."""

    path: str
    node_id: int
    node_epoch: int
    already_done: bool = False           # an earlier taker had finished: nothing to do
    records: int = 0                     # records found after the trim point
    committed_records: int = 0           # of those, committed by this call
    skipped_records: int = 0             # already committed (by the owner or an earlier taker)
    objects: int = 0
    bytes: int = 0
    streams: dict[int, int] = field(default_factory=dict)   # stream -> committed end offset
    lost: dict[int, str] = field(default_factory=dict)      # stream -> why records were left
    trim_offset: int = 0                 # the WAL's trim offset when done
    wal_end: int = 0                     # end of the recovered records (WAL offset)


def wal_identity(path: str, node_id: int, node_epoch: int, capacity: int) -> WALInfo:
    """The registry row for a WAL path (st_rdev identifies a block device, st_dev+inode a
    file): what Engine.start registers and a controller looks up."""
    st = os.stat(path)
    dev = st.st_rdev if stat.S_ISBLK(st.st_mode) else st.st_dev
    return WALInfo(node_id, node_epoch, os.path.abspath(path), socket.gethostname(), dev,
                   st.st_ino, capacity)


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    if stat.S_ISBLK(sa.st_mode) and stat.S_ISBLK(sb.st_mode):
        return sa.st_rdev == sb.st_rdev
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def read_header(dev: Device) -> WALHeader | None:
    """The newest valid header on an open device."""
    buf = aligned_buffer(HEADER_AREA)
    try:
        dev.read_into(buf, 0)
        return newest_header(memoryview(buf)[:HEADER_SLOT_SIZE],
                             memoryview(buf)[HEADER_SLOT_SIZE:HEADER_AREA])
    finally:
        buf.close()


def write_both_slots(dev: Device, hdr: WALHeader) -> None:
    """Write hdr into both slots (counter, counter+1) and make it durable: a racing write of
    the old owner can tear or replace at most one of them."""
    buf = aligned_buffer(HEADER_SLOT_SIZE)
    try:
        for _ in range(2):
            hdr.write_counter += 1
            buf[:] = hdr.encode()
            dev.write(buf, WALHeader.slot_position(hdr.write_counter))
        dev.sync()
    finally:
        buf.close()


def _open_target(path: str, own_wal_path: str | None, force_lock: bool) -> Device:
    if not os.path.exists(path):
        raise WALPathError(f"WAL {path} to take over does not exist")
    st = os.stat(path)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        raise WALPathError(f"WAL {path} to take over is neither a file nor a block device")
    if own_wal_path and _same_file(path, own_wal_path):
        raise TakeoverError(f"refusing to take over {path}: it is this node's own WAL")
    size = st.st_size
    if stat.S_ISBLK(st.st_mode):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
    dev = Device(path, size, sync_mode="dsync")    # an existing path: never created or grown
    try:
        lock_exclusive(dev.fd, path, "WAL being taken over")
    except WALLockedError as e:
        if not force_lock:
            dev.close()
            raise
        log.warning("takeover: %s; proceeding on the header fence alone", e)
    return dev


def take_over_wal(path: str, *, node_id: int, node_epoch: int, taker: int, taker_epoch: int,
                  meta: MetaStore, store: ObjectStore, own_wal_path: str | None = None,
                  force_lock: bool = False, object_block_bytes: int = 512 << 10
                  ) -> TakeoverResult:
    """Take over node ``node_id``'s WAL at ``path`` (fenced at ``node_epoch``: its owner may
    hold no newer epoch) for node ``taker`` at ``taker_epoch`` (the controller's takeover
    epoch: a later taker of the same WAL must use a higher one). Idempotent and restartable;
    see the module docstring. Raises TakeoverError / FencedError / WALLockedError /
    WALPathError (one line) or TakeoverConflict (metadata moved on; nothing committed)."""
    dev = _open_target(path, own_wal_path, force_lock)
    try:
        return _take_over(dev, path, node_id, node_epoch, taker, taker_epoch, meta, store,
                          object_block_bytes)
    finally:
        dev.close()                                  # releases the flock


def _take_over(dev: Device, path: str, node_id: int, node_epoch: int, taker: int,
               taker_epoch: int, meta: MetaStore, store: ObjectStore,
               block_bytes: int) -> TakeoverResult:
    hdr = read_header(dev)
    if hdr is None:
        raise TakeoverError(f"{path} holds no s3kafka WAL header; refusing to take it over")
    res = TakeoverResult(path, node_id, node_epoch)
    if hdr.node_id != node_id:
        raise TakeoverError(f"WAL {path} belongs to node {hdr.node_id}, not node {node_id}; "
                            "refusing to take over (or trim) the wrong WAL")
    if hdr.node_epoch > node_epoch:
        raise FencedError(f"WAL {path} was re-registered by node {node_id} at epoch "
                          f"{hdr.node_epoch} > the fenced epoch {node_epoch}: not taking it over")
    if hdr.takeover_state == TAKEOVER_DONE:
        res.already_done = True
        res.trim_offset = hdr.trim_offset
        meta.finish_wal_takeover(node_id, hdr.taken_over_by, hdr.taken_over_epoch)
        log.info("takeover: WAL %s of node %d already %s", path, node_id,
                 hdr.describe_takeover())
        return res
    if hdr.takeover_state == TAKEOVER_FENCED and (
            (hdr.taken_over_epoch, hdr.taken_over_by != taker) > (taker_epoch, False)):
        raise TakeoverError(f"WAL {path} is being taken over by node {hdr.taken_over_by} at "
                            f"epoch {hdr.taken_over_epoch} (>= {taker_epoch}): one taker per "
                            "epoch")
    if not meta.begin_wal_takeover(node_id, node_epoch, taker, taker_epoch):
        raise TakeoverError(f"the registry refuses node {taker}'s takeover of node {node_id}'s "
                            f"WAL at epoch {taker_epoch}: {meta.wal(node_id)}")
    # 3. the fence, before anything is read: the owner can write nothing after this
    hdr.takeover_state, hdr.taken_over_by, hdr.taken_over_epoch = (TAKEOVER_FENCED, taker,
                                                                   taker_epoch)
    hdr.write_counter += FENCE_COUNTER_JUMP
    write_both_slots(dev, hdr)
    crash_point("takeover_after_fence")
    ring = hdr.capacity - HEADER_AREA
    result = scan(dev, ring, hdr.trim_offset, hdr.window_max_length, ring)
    res.records = len(result.records)
    res.wal_end = result.records[-1][0] + RECORD_HEADER_SIZE + len(result.records[-1][1]) \
        if result.records else hdr.trim_offset
    # 4. what each stream still lacks, contiguous from its committed end
    todo, owners = _plan(result.records, meta, node_id, taker, res)
    if todo:
        _upload_and_commit(todo, owners, meta, store, node_id, taker, taker_epoch,
                           block_bytes, res)
    crash_point("takeover_before_done")
    # 5. done: header first (the owner's fate), then the registry (the controller's view)
    hdr.takeover_state = TAKEOVER_DONE
    hdr.trim_offset = max(hdr.trim_offset, res.wal_end)
    write_both_slots(dev, hdr)
    meta.finish_wal_takeover(node_id, taker, taker_epoch)
    res.trim_offset = hdr.trim_offset
    log.info("takeover of node %d's WAL %s by node %d (epoch %d): %d records, %d committed in "
             "%d objects (%d bytes), %d already committed%s", node_id, path, taker, taker_epoch,
             res.records, res.committed_records, res.objects, res.bytes, res.skipped_records,
             f", NOT recovered: {res.lost}" if res.lost else "")
    return res


def _plan(records: list[tuple[int, bytes]], meta: MetaStore, node_id: int, taker: int,
          res: TakeoverResult) -> tuple[list[Record], dict[int, tuple[int, int] | None]]:
    """The records to commit, per stream in order from its committed end, and the owner each
    stream must still have at commit. Records of deleted streams, already committed ranges
    and anything after a gap are left (a gap or a foreign owner is reported in res.lost)."""
    ends: dict[int, int] = {}
    owners: dict[int, tuple[int, int] | None] = {}
    stopped: set[int] = set()
    todo: list[Record] = []
    for _off, body in records:
        if len(body) < WAL_RECORD.size:
            continue
        sid, base, count = WAL_RECORD.unpack_from(body)
        if sid in stopped or count <= 0:
            continue
        if sid not in ends:
            m = meta.stream(sid)
            if m is None or m.deleted:
                stopped.add(sid)
                continue
            ends[sid] = m.end_offset
            owners[sid] = meta.stream_owner(sid)
        end = ends[sid]
        if base + count <= end:
            # already committed (by the owner, an earlier taker, or before the stream moved
            # to another node: a release commits its records, the WAL still holds them)
            res.skipped_records += 1
            continue
        owner = owners[sid]
        if owner is not None and owner[0] not in (node_id, taker):
            res.lost[sid] = f"stream owned by node {owner[0]} at epoch {owner[1]}"
            log.error("takeover: stream %d is owned by node %d (epoch %d): its WAL records "
                      "from offset %d (committed end %d) are not committed", sid, owner[0],
                      owner[1], base, end)
            stopped.add(sid)
            continue
        if base != end:
            res.lost[sid] = f"gap: committed end {end}, WAL continues at {base}"
            log.error("[BUG] takeover: stream %d ends at %d but its WAL records continue at %d",
                      sid, end, base)
            stopped.add(sid)
            continue
        todo.append(Record(sid, base, count, memoryview(body)[WAL_RECORD.size:]))
        ends[sid] = base + count
    todo.sort(key=lambda r: (r.stream_id, r.base_offset))     # stable: per stream in order
    res.streams = dict(ends)
    return todo, {sid: owners[sid] for sid in {r.stream_id for r in todo}}


def _upload_and_commit(todo: list[Record], owners: dict[int, tuple[int, int] | None],
                       meta: MetaStore, store: ObjectStore, node_id: int, taker: int,
                       taker_epoch: int, block_bytes: int, res: TakeoverResult) -> None:
    """Upload todo as stream set objects of up to MAX_OBJECT_BYTES and commit them all in one
    conditioned transaction; on a refused commit the uploaded objects are marked destroyed
    (the cleanup deletes their keys) and TakeoverConflict propagates."""
    chunks: list[list[Record]] = [[]]
    size = 0
    for r in todo:
        if size >= MAX_OBJECT_BYTES and chunks[-1][-1].stream_id != r.stream_id:
            chunks.append([])
            size = 0
        chunks[-1].append(r)
        size += len(r.payload)
    new: list[NewObject] = []
    prepared: list[int] = []
    try:
        for recs in chunks:
            oid, key = meta.prepare_object("sso", taker)
            prepared.append(oid)
            data, _index, ranges = encode_object(recs, block_bytes)
            store.put(key, data)
            new.append(NewObject(oid, len(data), ranges))
            res.bytes += len(data)
        crash_point("takeover_before_commit")
        meta.commit_takeover(new, owners, node_id, taker, taker_epoch)
    except BaseException as exc:
        state = _outcome(meta, exc, prepared)
        if state == "committed":
            # its COMMIT landed, the answer was lost: destroying them would lose the
            # records the stream's committed ranges now point to
            log.warning("takeover: the commit answered an error after it reached the "
                        "database; its %d objects are committed", len(prepared))
        else:
            if state == "failed":
                try:
                    meta.mark_destroyed(prepared)
                except Exception as e:        # the taker's start-up cleanup gets them
                    log.warning("takeover: could not mark uploaded objects destroyed: %s", e)
            else:
                log.warning("takeover: commit outcome unknown, objects kept: %s", exc)
            raise
    crash_point("takeover_after_commit")
    res.objects = len(new)
    res.committed_records = len(todo)


def _outcome(meta: MetaStore, exc: BaseException, object_ids: list[int]) -> str:
    """"committed", "failed" or "unknown" for a takeover commit that raised (one whose COMMIT
    was sent may have committed: the objects' state is read back)."""
    if not object_ids or not isinstance(exc, Exception) or not sqldb.commit_outcome_unknown(exc):
        return "failed"
    for attempt in range(3):
        try:
            states = meta.object_states(object_ids)
        except Exception:  # noqa: BLE001 - still unreachable: try again, then unknown
            time.sleep(0.2 * (attempt + 1))
            continue
        if all(states.get(o) == "committed" for o in object_ids):
            return "committed"
        return "failed" if all(states.get(o) == "prepared" for o in object_ids) else "unknown"
    return "unknown"


__all__ = ["TakeoverConflict", "TakeoverError", "TakeoverResult", "take_over_wal",
           "wal_identity", "read_header", "FENCE_COUNTER_JUMP"]
