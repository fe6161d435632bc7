"""Object stores behind one small blocking interface (the engine calls it from a thread pool).

``file://DIR`` (embedded default, atomic publish by rename), ``mem://`` (tests) and
``s3://bucket/prefix`` (boto3, see s3.py) all implement ObjectStore.
"""
from __future__ import annotations

import abc
import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol
from urllib.parse import urlsplit

from ..copycrc import read_pieces
# storage/_copycrc.c's read_span_crcs: a span's read and its blocks' CRCs in one call that
# releases the interpreter lock once (see FileObjectStore.get_ranges_crc); None without the
# extension (or with a stale build of it)
from ..copycrc import read_span_crcs
# storage/_copycrc.c's write_pieces: _write_direct's pieces in one call that releases the
# interpreter lock once. In Python each piece re-took the lock when it returned: an upload
# thread then waited up to a switch interval (5 ms) per 1 MiB piece behind a busy event loop,
# and the loop paid a hand-off each time (224 MiB in 1 MiB pieces beside a Python loop on the
# shared VM: 10.8-17.1 s and 0.38-0.94 s of writer CPU in Python, 2.2-3.1 s and 0.14-0.30 s in
# C; bench/HISTORY.md, session 17). None when the extension is not built (or built before it).
from ..copycrc import write_pieces as _write_pieces
# an io_uring per upload thread for gather puts (GatherSource); None without the extension
from ..copycrc import _copycrc_module
from .buffers import PAGE, BufferPool, fresh_buffer
from .format import GATHER, GATHER_STAGING_MAX, GatherSource
from .release import SMALL as RELEASE_SMALL, Trash, shrink

_uring_setup = getattr(_copycrc_module, "uring_setup", None)
_thread_rings = threading.local()


def _gather_ring() -> object:
    """This thread's io_uring for gather puts, whichever store it writes for (made at its first;
    no eventfd: the put waits on the ring itself; the frame arena's slabs registered with it
    as with the WAL's), or None where the kernel refuses one: the writes then go by pwrite."""
    ring = getattr(_thread_rings, "ring", False)
    if ring is False:
        try:
            ring = _uring_setup(8, -1) if _uring_setup is not None else None
        except OSError:
            ring = None
        _thread_rings.ring = ring
    return ring


Buffer = Any          # a writable buffer: mmap.mmap, or storage._copycrc's MappedBuffer


class PutSource(Protocol):
    """An object produced a window at a time while it is written (storage.objects.format's
    StreamEncoder): what FileObjectStore.put takes besides a buffer (``streams_puts``)."""

    def __len__(self) -> int:
        """The object's size in bytes (known before any is produced)."""

    @property
    def done(self) -> bool:
        """Every byte has been produced."""

    def fill(self, out: Buffer, at: int) -> int:
        """Produce the next bytes into ``out[at:]`` (whole units: as many as fit); return
        where they end, ``at`` when the next unit does not fit."""

    # Optional (StreamEncoder): ``writes_windows`` True and
    # ``fill_writing(out, at, fd, chunk, align) -> (end, written)``, a fill that writes each
    # full window's whole ``align`` units to the O_DIRECT ``fd`` itself (see _write_source).


class ObjectStoreError(Exception):
    """The store failed an operation (network, throttling, missing object...)."""


class ObjectNotFound(ObjectStoreError):
    """The key does not exist."""


class ObjectStore(abc.ABC):
    """put / ranged get / delete / list of opaque objects; all calls block."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store the whole object; readers never see a partial object."""

    @abc.abstractmethod
    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | memoryview:
        """Bytes [start, end) of an object (end None = to the end): a bytes-like object."""

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes | memoryview]:
        """Several (position, size) ranges of one object, sorted and not overlapping, one
        buffer each (the BlockCache: one per data block of a stream). A range past the end of
        the object comes back short or empty; callers check lengths. Default: one ranged get
        from the first range to the end of the last, sliced without copying."""
        if not ranges:
            return []
        start = ranges[0][0]
        data = memoryview(self.get(key, start, ranges[-1][0] + ranges[-1][1]))
        return [data[pos - start:pos - start + n] for pos, n in ranges]

    def get_ranges_crc(self, key: str, ranges: list[tuple[int, int]], skip: int
                       ) -> tuple[list[bytes | memoryview], list[int | None]]:
        """get_ranges, and per range the CRC-32C of its bytes from ``skip`` on where the store
        computed it while reading (None: not computed, the caller checks). Default: none."""
        return self.get_ranges(key, ranges), [None] * len(ranges)

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Object length in bytes."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete objects; missing keys are not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with prefix."""

    def close(self) -> None:
        """Release clients/connections."""

    def check(self) -> None:
        """Write, read back and delete a small object (the broker's start-up check): raises
        ObjectStoreError naming the step that failed."""
        key = f"_s3kafka-check-{uuid.uuid4().hex}"
        data = b"s3kafka start-up check\n"
        self.put(key, data)
        try:
            got = bytes(self.get(key))
        finally:
            self.delete([key])
        if got != data:
            raise ObjectStoreError(f"object {key} read back {len(got)} bytes that differ from "
                                   f"the {len(data)} written")


# Objects are written to their file in pieces of this size, each made durable before the next:
# see FileObjectStore.put.
FILE_WRITE_CHUNK = 1 << 20
# ... and of this size while the engine uploads small records in the background
# (FileObjectStore.gentle_writes): a WAL write on the same disk then queues behind at most
# 64 KiB of object data instead of 1 MiB per put in flight (bench/HISTORY.md, sessions 15 and
# 17: on this VM's one-request-at-a-time virtio disk a 4 KiB dsync write that met a 256 KiB
# piece in flight took p50 0.24-1.1 ms, p90 1.7-27 ms; one that met a 64 KiB piece p50
# 0.14-0.22, p90 0.5-2.5 ms, `python -m bench.collide --write`; a piece ~0.09 ms, ~700 MB/s)
GENTLE_WRITE_CHUNK = 64 << 10
# A streamed put (FileObjectStore.put of a PutSource) produces its object into a buffer of this
# size, writes the whole DIRECT_ALIGN units of it (FILE_WRITE_CHUNK pieces) and moves the rest
# (< 4 KiB) to its start: several object blocks (512 KiB-1 MiB each) per window, in four 2 MiB huge
# pages. Each window cost the put thread two takes of the interpreter lock (after the encode, after
# the writes; one since encode_write writes a window in the call that encodes it: the figures below
# are from before that), each a wait for a busy event loop, and leaves this put's device queue empty
# while it encodes: under raw 1 MiB produce (4 puts in flight) 2 MiB rings (one 1 MiB block per
# window) ran 1,250-1,299 MB/s at 0.56-0.62 ms CPU/MiB, 4 MiB 1,297-1,380 / 0.48-0.53, 8 MiB
# 1,359-1,396 / 0.49-0.51 (bench/HISTORY.md, session 30 stream). An object block larger than the
# ring (a record of several MiB) gets a buffer twice as large, for that put only.
PUT_RING_BYTES = 8 << 20
# a gather put stages its non-payload bytes in one of these (format.gather_source keeps them
# within GATHER_STAGING_MAX)
assert GATHER_STAGING_MAX <= PUT_RING_BYTES
# streamed puts' buffers kept for reuse (fresh huge pages cost ~2.3 s of CPU per GiB on the
# test VM: bench/HISTORY.md, session 25 hugeframes): the engine's puts in flight, plus drains
# beside them
PUT_RINGS_KEPT = 6
# ... and read in pieces of this size (see FileObjectStore.get).
FILE_READ_CHUNK = 1 << 20
# most bytes of neighbouring blocks get_ranges reads at once, into one pool buffer
FILE_READ_SPAN = 8 << 20       # = the BlockCache's PREFETCH_PIECE
# ... asked for this much per system call, one call at a time across the cold-read threads,
# while hot traffic runs (FileObjectStore.gentle): a WAL write then queues behind at most one
# such piece on a shared disk instead of two 4 MiB reads (see FileObjectStore._read_block).
# The engine sets it from EngineConfig.cold_read_piece_bytes. On the test VM (virtio disk,
# served one request at a time) a 4 KiB dsync write that found a read in flight took +0.35-0.45
# ms with 256 KiB pieces, +0.08-0.13 ms with 64 KiB (`python -m bench.collide`); 64 KiB pieces
# alone still read ~500-700 MB/s, ten times the paced catch-up rate (bench/HISTORY.md, session 16)
HOT_READ_PIECE = 64 << 10

# Deleted objects' files kept for later puts to overwrite (FileObjectStore.delete / put): on a
# thin-provisioned virtual disk mounted with ``discard`` (the test VM) every new file's blocks
# cost the device a fresh allocation and every unlink a discard, while overwriting blocks that
# were written before is the device's cheapest write (bench/HISTORY.md, session 27 objfile:
# object-like writers beside a WAL-like one 2.1-3.0 GB/s in total with new files and unlinks,
# 3.1-4.0 GB/s overwriting recycled files). The pool is a hidden directory under the root
# that list() and the keys never reach.
RECYCLE_DIR = ".recycle"
# most bytes of deleted objects the pool holds (disk space not given back until reused)
RECYCLE_BYTES = 1 << 30
# smaller deleted objects are unlinked: a few blocks are not worth a pool entry
RECYCLE_MIN = 1 << 20
# a pooled file is overwritten only this long after its delete: a read that opened the
# object just before (this process's cold threads, or another broker sharing the directory)
# holds its descriptor for one span read, never this long; with unlink it would read the old
# inode, with recycling the new object's bytes
RECYCLE_QUARANTINE_S = 0.5
# Deleted objects' files that are not recycled are renamed into this hidden directory and cut
# away there a piece at a time by a background thread (release.Trash): an unlink of a large
# file discards all its blocks in one system call, and the WAL's writes on the same disk wait
# behind it (190-374 ms on the test VM; storage/objects/release.py)
TRASH_DIR = ".trash"
# the store's own directories under its root: never a key, never walked for objects
_HIDDEN_DIRS = (RECYCLE_DIR, TRASH_DIR)
# Temp files of puts that died mid-way (kill -9 between the temp file's creation and its rename)
# are swept (FileObjectStore.sweep_temp_files): a put holds an exclusive flock on its temp file
# from right after creating (or renaming) it until it is published, and the kernel drops the
# lock with the process, so a temp file whose lock can be had belongs to no live put - in this
# process or another broker sharing the directory. The age (since its last change: creation,
# rename, write) covers the moment between a put's create and its flock.
TEMP_MARK = ".tmp-"
TEMP_SWEEP_AGE_S = 60.0


def _read_range(fd: int, start: int, n: int) -> bytes | memoryview:
    """Bytes [start, start + n) of an open file: one pread up to FILE_READ_CHUNK, else an
    anonymous private mmap filled a piece at a time (see FileObjectStore.get)."""
    if n <= FILE_READ_CHUNK:
        return os.pread(fd, n, start)
    buf = memoryview(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE))
    got = 0
    while got < n:
        r = os.preadv(fd, [buf[got:got + FILE_READ_CHUNK]], start + got)
        if r == 0:
            break                     # the file is shorter: callers check the length
        got += r
    return buf[:got] if got < n else buf


@dataclass
class _Pooled:
    """A deleted object's file in the recycle pool."""
    path: str
    size: int
    since: float                  # time.time() of its delete (its ctime after a restart)


class FileObjectStore(ObjectStore):
    """Objects as files under a directory; put writes a temp file durably, then renames."""

    # put() takes a PutSource: the object is produced while it is written (see PUT_RING_BYTES)
    streams_puts = True

    @property
    def gathers_puts(self) -> bool:
        """put() takes a GatherSource (large payloads written from their own memory, with
        O_DIRECT: without it the gather would only move the copy into the page cache)."""
        return GATHER and self.direct_writes and bool(_O_DIRECT)

    def __init__(self, root: str, direct_writes: bool = False,
                 recycle_bytes: int = RECYCLE_BYTES) -> None:
        self.root = os.path.abspath(root)
        self.url = "file://" + self.root
        # page-aligned objects bypass the page cache (see put), and so do block reads (see
        # get_ranges); the engine sets this from EngineConfig.object_direct_writes
        self.direct_writes = direct_writes
        # block buffers of get_ranges: reused once the BlockCache dropped them (buffers.py)
        self.buffers = BufferPool()
        # set by the engine: True while producers append (cold reads must then stay small
        # on the device, see _read_block)
        self.gentle: Callable[[], bool] | None = None
        # set by the engine: True while its uploads are background uploads of small records
        # (latency-sensitive appends beside them; see put)
        self.gentle_writes: Callable[[], bool] | None = None
        self._device = threading.Lock()
        # bytes per device read while ``gentle()`` (see HOT_READ_PIECE)
        self.hot_read_piece = HOT_READ_PIECE
        os.makedirs(self.root, exist_ok=True)
        # the recycle pool (see RECYCLE_DIR): deleted objects' files, oldest first
        self.recycle_bytes = recycle_bytes
        self._pool_dir = os.path.join(self.root, RECYCLE_DIR)
        self._pool: list[_Pooled] = []
        self._pool_size = 0            # bytes in _pool plus renames into it under way
        self._pool_lock = threading.Lock()
        # deleted files given back a piece at a time (TRASH_DIR); a previous run's leftovers
        # are removed from the start
        self._trash = Trash(os.path.join(self.root, TRASH_DIR), RECYCLE_QUARANTINE_S)
        self._trash.resume()
        self._adopt_pool()
        self._rings: list[Buffer] = []          # streamed puts' buffers (PUT_RING_BYTES)
        self._rings_lock = threading.Lock()

    def _path(self, key: str) -> str:
        parts = key.split("/")
        if key.startswith("/") or ".." in parts or parts[0] in _HIDDEN_DIRS:
            raise ObjectStoreError(f"bad key {key!r}")
        return os.path.join(self.root, key)

    def _adopt_pool(self) -> None:
        """Take over the pool a previous run left (deleted objects: content irrelevant, every
        byte is overwritten or cut before a put publishes it), up to ``recycle_bytes``; the
        rest is unlinked. A file with a second link (a rename whose two directory updates a
        crash split, as e2fsck repairs it on ext4 without a journal) is only unlinked there:
        its other name is an object."""
        try:
            names = sorted(os.listdir(self._pool_dir))
        except FileNotFoundError:
            return
        for name in names:
            path = os.path.join(self._pool_dir, name)
            try:
                st = os.lstat(path)
                if st.st_nlink == 1 and st.st_size >= RECYCLE_MIN and \
                        self._pool_size + st.st_size <= self.recycle_bytes:
                    self._pool.append(_Pooled(path, st.st_size, st.st_ctime))
                    self._pool_size += st.st_size
                else:
                    self._release(path)
            except OSError:
                continue                      # another broker sharing the directory took it

    def _take_pooled(self, size: int) -> _Pooled | None:
        """The pooled file to overwrite with an object of ``size`` bytes (out of the pool),
        or None: the one closest in size among those at least as large, else the largest;
        only files deleted RECYCLE_QUARANTINE_S ago or more, and none more than twice the
        size (most of its blocks would be freed, and discarded, by the put's ftruncate). A
        small object (below RECYCLE_MIN) takes none."""
        if size < RECYCLE_MIN:
            return None
        ready = time.time() - RECYCLE_QUARANTINE_S
        with self._pool_lock:
            # (too small, size difference): a large enough file first, the closest one
            best = min((p for p in self._pool if p.since <= ready and p.size <= 2 * size),
                       default=None, key=lambda p: (p.size < size, abs(p.size - size)))
            if best is not None:
                self._pool.remove(best)
                self._pool_size -= best.size
            return best

    def _open_new(self, tmp: str, size: int) -> tuple[int, int]:
        """An fd for writing a put's temp file, locked (see TEMP_SWEEP_AGE_S), and the size
        the file already has: a pooled file renamed to ``tmp`` (its blocks overwritten in
        place: see RECYCLE_DIR), else a new empty file (0)."""
        while (pooled := self._take_pooled(size)) is not None:
            try:
                os.rename(pooled.path, tmp)
            except FileNotFoundError:
                continue                      # another broker sharing the directory took it
            try:
                return _locked(os.open(tmp, os.O_WRONLY | os.O_CLOEXEC)), pooled.size
            except OSError:
                os.unlink(tmp)
                raise
        return _locked(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                               0o644)), 0

    def sweep_temp_files(self, min_age_s: float | None = None) -> int:
        """Remove the temp files of puts that died before their rename (a kill -9 mid-put):
        into the recycle pool when large enough and it has room, else removed. Only names
        this store's puts make (TEMP_MARK) that no live put holds (its flock) and that
        nothing changed for ``min_age_s`` (default TEMP_SWEEP_AGE_S); returns how many went.
        The engine runs it in the background at start-up (and now and then: Maintenance)."""
        min_age_s = TEMP_SWEEP_AGE_S if min_age_s is None else min_age_s
        swept = 0
        for dirpath, dirs, files in os.walk(self.root):
            if dirpath == self.root:
                dirs[:] = [d for d in dirs if d not in _HIDDEN_DIRS]
            for name in files:
                if TEMP_MARK in name:
                    swept += self._sweep_temp(os.path.join(dirpath, name), min_age_s)
        return swept

    def _sweep_temp(self, path: str, min_age_s: float) -> bool:
        """One temp file of sweep_temp_files: recycled or removed while holding its lock,
        by name (a sweeper racing another one finds the name gone)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False                      # gone meanwhile (published, or swept)
        try:
            if time.time() - os.fstat(fd).st_ctime < min_age_s:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False                  # a live put's
            if self.recycle_bytes > 0 and self._recycle(path):
                return True
            return self._release(path)
        finally:
            os.close(fd)

    def _recycle(self, path: str) -> bool:
        """Move a deleted object's file into the pool if it is large enough and the pool has
        room (False: the caller unlinks it). Like an unlink, the rename is not synced: the
        metadata already forgot the object."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return True                       # already gone: nothing to unlink either
        if size < RECYCLE_MIN:
            return False
        with self._pool_lock:
            if self._pool_size + size > self.recycle_bytes:
                return False
            self._pool_size += size           # reserved while renaming
        dest = os.path.join(self._pool_dir, uuid.uuid4().hex)
        try:
            os.makedirs(self._pool_dir, exist_ok=True)
            os.rename(path, dest)
        except OSError as e:
            with self._pool_lock:
                self._pool_size -= size
            return isinstance(e, FileNotFoundError)
        with self._pool_lock:
            self._pool.append(_Pooled(dest, size, time.time()))
        return True

    def put(self, key: str, data: bytes | memoryview | PutSource) -> None:
        """Write ``data`` under a temp name, make it durable, rename it into place and make the
        rename durable (the engine trims the WAL once the object's commit returns).

        The file is written in FILE_WRITE_CHUNK pieces, each followed by fdatasync. One
        write of a whole object (10+ MB) and one fsync make the kernel write it back in a
        single burst that the device serves ahead of the WAL's O_DSYNC writes on the same
        disk: measured here, every upload stalled WAL writes for 20-45 ms (the produce p99
        of every client). With 1 MiB pieces no more than ~1 MiB of upload data is queued in
        front of a WAL write (WAL 4 KiB writes during uploads: max 2.4-4 ms instead of 21-25
        ms), and the upload itself finished sooner (13-15 ms instead of 34-45 ms for 10.7
        MB), bench/HISTORY.md.

        With ``direct_writes``, a page-aligned buffer (the engine encodes into an mmap) is
        written with O_DIRECT, up to its last whole 4 KiB: copying it into the page cache and
        writing that back was 30 % of the broker's CPU under 1 MiB produce (bench/HISTORY.md,
        issue 20). Each direct write returns once the device has it, so still at most one
        piece is queued in front of the WAL, and one fdatasync at the end flushes the device
        cache and the size. The unaligned tail, and every write where O_DIRECT is refused
        (tmpfs), go through the page cache as before. Off by default: cold reads then come
        from the device instead of the page cache (on the shared test VM 3x slower).

        While ``gentle_writes()`` (the engine uploads small records in the background, nothing
        waits for the upload) the pieces are GENTLE_WRITE_CHUNK: with 1 MiB pieces a 4 KiB
        O_DSYNC write beside two puts waited p50 2.8-3.5 ms instead of 0.4 (256 KiB: 0.8-0.9
        ms; put bandwidth ~25 % lower, far more than such an upload needs; 64 KiB since
        session 17, see GENTLE_WRITE_CHUNK).

        The temp file is a deleted object's file from the recycle pool when one is ready
        (see RECYCLE_DIR): renamed to the temp name first (so no other put or store takes
        it), every byte of the new object written over the old ones, the old object's
        longer tail cut before the fdatasync; only then the rename publishes it, exactly as
        a new file. A crash in between leaves a temp file no key names, as before.

        ``data`` may be a PutSource (``streams_puts``): the object is then produced a window
        at a time into a PUT_RING_BYTES buffer and each window written as above (O_DIRECT
        pieces of its whole 4 KiB units, the rest carried into the next window) - the same
        pieces on the device, a few MiB of memory per put instead of the whole object. A put
        that fails (the store, or the source raising) leaves no object and no temp file."""
        chunk = GENTLE_WRITE_CHUNK if self.gentle_writes is not None and \
            self.gentle_writes() else FILE_WRITE_CHUNK
        path = self._path(key)
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}{TEMP_MARK}{uuid.uuid4().hex}"
        size = len(data)
        try:
            fd, old = self._open_new(tmp, size)
            try:
                if old > size:
                    shrink(fd, size)         # a recycled file's longer tail: cut (release.py)
                if isinstance(data, GatherSource):
                    unsynced = self._write_gathered(fd, data, chunk, old)
                elif hasattr(data, "fill"):
                    unsynced = self._write_source(fd, data, chunk)
                else:
                    with memoryview(data) as mv, mv.cast("B") as view:
                        unsynced = self._write_window(fd, view, chunk)
                if unsynced or not size:
                    os.fdatasync(fd)         # the last bytes were written directly (or none)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            _fsync_dir(parent)
        except BaseException as e:
            try:
                os.unlink(tmp)     # a failed put (a full disk, say): its space back at once
            except OSError:
                pass
            if isinstance(e, OSError):
                raise ObjectStoreError(str(e)) from e
            raise

    def _write_window(self, fd: int, view: memoryview, chunk: int) -> bool:
        """Write ``view`` at the fd's position, ``chunk`` bytes at a time: its whole 4 KiB units
        with O_DIRECT (``direct_writes``), the rest through the page cache, each such piece
        followed by fdatasync. True when bytes were written after the last fdatasync (direct
        ones: the caller syncs once at the end)."""
        direct = _write_direct(fd, view, chunk) if self.direct_writes else 0
        for at in range(direct, len(view), chunk):
            _write_all(fd, view[at:at + chunk])
            os.fdatasync(fd)                 # the size too: fdatasync covers what reads need
        return direct == len(view) > 0

    def _write_source(self, fd: int, source: PutSource, chunk: int) -> bool:
        """Produce and write ``source`` a window at a time (see put) through a ring buffer;
        True when the last bytes were written directly (not yet synced).

        With ``direct_writes`` and a source that can (``writes_windows``: StreamEncoder with
        the C encoder's encode_write) the source writes every full window itself, the same
        O_DIRECT pieces, in the C call that encodes it: one take of the interpreter lock per
        window instead of two, and no Python between windows. Here only the last window
        (index and footer) is written, the other windows only when a write of the source's
        came back short (O_DIRECT refused: then the source stops writing)."""
        ring = pooled = self._take_ring()
        at = 0                               # bytes carried over from the previous window
        unsynced = False
        native = self.direct_writes and _O_DIRECT and getattr(source, "writes_windows", False)
        try:
            while True:
                wrote = 0
                native = native and _set_direct(fd, True)
                if native:
                    try:
                        end, wrote = source.fill_writing(ring, at, fd, chunk, DIRECT_ALIGN)
                    finally:
                        _set_direct(fd, False)
                else:
                    end = source.fill(ring, at)
                done = source.done
                if end == at and not wrote and not done:   # the next block is larger than
                    ring = _grown(ring, at)                # the ring
                    continue
                if not done and end >= DIRECT_ALIGN:
                    # a full window the source left unwritten (a write refused, or the index
                    # and footer did not fit): written below, the rest through fill
                    native = False
                n = end if done else end - end % DIRECT_ALIGN
                with memoryview(ring) as mv:
                    if n:
                        with mv[:n] as view:
                            unsynced = self._write_window(fd, view, chunk)
                    if done:
                        return unsynced
                    mv[:end - n] = mv[n:end]     # < 4 KiB: whole pages were written
                at = end - n
        finally:
            self._give_ring(pooled)

    def _write_gathered(self, fd: int, source: GatherSource, chunk: int, old: int) -> bool:
        """Write a GatherSource (see put): O_DIRECT through this thread's io_uring, the file
        fallocated first unless its blocks exist (a recycled file at least as large): ext4
        does not allocate blocks for an io_uring write at submission, each such write went to
        an io-wq worker thread, 3-6x the CPU of today's put (bench/HISTORY.md, session 39).
        The last page is written whole, then the file cut to the object's size. True: the
        bytes are not synced yet. Where O_DIRECT is refused the same writes go through the
        page cache (pwrite)."""
        size = len(source)
        whole = (size + DIRECT_ALIGN - 1) & -DIRECT_ALIGN
        # the staging buffer: a streamed put's (gather_source keeps the staged regions within
        # PUT_RING_BYTES)
        staging = self._take_ring()
        direct = _set_direct(fd, True)
        try:
            source.write(_gather_ring() if direct else None, fd, staging, chunk,
                         whole if old < whole else 0)
        finally:
            if direct:
                _set_direct(fd, False)
            self._give_ring(staging)
        os.ftruncate(fd, size)
        return True

    def _take_ring(self) -> Buffer:
        """A streamed put's buffer: a kept one, else a fresh one (buffers.fresh_buffer: huge
        pages, its O_DIRECT writes then pin 2 MiB pages instead of 512 small ones each -
        writing from 4 KiB pages cost ~+0.05 ms of CPU per MiB, bench/HISTORY.md, session
        15 - mapped without the interpreter lock)."""
        with self._rings_lock:
            if self._rings:
                return self._rings.pop()
        return fresh_buffer(PUT_RING_BYTES)

    def _give_ring(self, ring: Buffer) -> None:
        """Keep ``ring`` for the next streamed put (at most PUT_RINGS_KEPT; the others are
        unmapped as they go)."""
        with self._rings_lock:
            if len(self._rings) < PUT_RINGS_KEPT:
                self._rings.append(ring)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | memoryview:
        """Bytes [start, end) of the object: ``bytes`` up to FILE_READ_CHUNK, beyond that a
        memoryview over an anonymous mmap filled FILE_READ_CHUNK at a time.

        Cold reads share the disk with the WAL when the store is file://. A plain read of a
        whole range (up to 32 MiB of readahead) lets the kernel queue it as 4 MiB requests plus
        its own readahead (read_ahead_kb is 8 MiB here), and a WAL write queued behind them
        waited milliseconds: WAL write p99 0.45 -> 1.36 ms while a catch-up reader ran
        (bench/HISTORY.md). So kernel readahead is off for these reads (POSIX_FADV_RANDOM:
        the BlockCache does its own) and each syscall asks for at most one piece, waiting
        for it before the next: a WAL write waits behind one piece at most. The mmap keeps a
        large buffer from being zero-filled up front while the GIL is held (see
        format._zeroed_buffer); pages are filled by the kernel inside the read calls."""
        with self._reading(key) as fd:
            if end is None:
                end = os.fstat(fd).st_size
            n = max(end - start, 0)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, start, n, os.POSIX_FADV_RANDOM)
            return _read_range(fd, start, n)

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes | memoryview]:
        """The ranges (data blocks, ~0.5-1 MiB) read into page-aligned buffers from
        ``self.buffers``, neighbouring blocks together up to FILE_READ_SPAN per read and per
        buffer; each range answered as a view of its buffer.

        Buffers of at most a few MiB, not one readahead buffer sliced: a 32 MiB buffer was
        unmapped on the event loop when the BlockCache evicted its last block (0.4-0.7 ms
        stalls). Pool buffers, not fresh ``bytes``: fresh memory costs a page fault per 4 KiB
        (0.4-1.1 ms of CPU per MiB on the test VM against 0.11 ms for the read). With
        ``direct_writes`` the objects are not in the page cache, so the read is O_DIRECT too
        (the aligned span around the blocks, straight into the buffer: 650-1500 MB/s at ~0.1
        ms of CPU per MiB here, where a buffered read that missed the page cache did 150 MB/s
        at ~1 ms per MiB); file systems that refuse O_DIRECT (tmpfs) are read through the page
        cache."""
        return self._get_ranges(key, ranges, None)[0]

    def get_ranges_crc(self, key: str, ranges: list[tuple[int, int]], skip: int
                       ) -> tuple[list[bytes | memoryview], list[int | None]]:
        """get_ranges, and each range's CRC-32C from its byte ``skip`` on (an object block's
        body), computed in the same C call as the span's read (storage._copycrc's
        read_span_crcs) with the interpreter lock released once per span. The cold thread
        then takes the lock back once per span instead of once for the read and once per
        block's CRC: each take waits for the event loop to let go of it (a switch interval,
        0.5 ms, when the loop is busy). None where not computed: a span read while producers
        append (64 KiB pieces, storage._copycrc's read_pieces), without the extension, or
        short (the end of the file)."""
        return self._get_ranges(key, ranges, skip)

    def _get_ranges(self, key: str, ranges: list[tuple[int, int]], skip: int | None
                    ) -> tuple[list[bytes | memoryview], list[int | None]]:
        crcs: list[int | None] = []
        with self._reading(key, direct=self.direct_writes) as fd:
            if ranges and hasattr(os, "posix_fadvise"):
                first = ranges[0][0]
                os.posix_fadvise(fd, first, ranges[-1][0] + ranges[-1][1] - first,
                                 os.POSIX_FADV_RANDOM)
            out: list[bytes | memoryview] = []
            i = 0
            while i < len(ranges):
                # neighbouring blocks are read together, up to FILE_READ_SPAN of blocks per
                # read: the device serves larger reads faster (here 1 MiB 680 MB/s, 8 MiB 1.5
                # GB/s). Counted in block bytes, as the BlockCache's windows are: the gaps of a
                # gather put (< 4 KiB before each large block) split a window of eight 1 MiB
                # blocks into two reads when counted in file bytes, and the cold pass ran at
                # 1,242-1,493 MB/s instead of 1,675-2,028 (bench/HISTORY.md, session 40)
                start, n = ranges[i]
                end = start + n
                j = i + 1
                while j < len(ranges) and 0 <= ranges[j][0] - end <= PAGE \
                        and n + ranges[j][1] <= FILE_READ_SPAN:
                    end = ranges[j][0] + ranges[j][1]
                    n += ranges[j][1]
                    j += 1
                span, got = self._read_block(fd, start, end - start, ranges[i:j], skip)
                for pos, size in ranges[i:j]:
                    out.append(span[pos - start:pos - start + size])
                crcs.extend(got)
                span.release()
                if len(out[-1]) < ranges[j - 1][1]:
                    break                     # past the end: the caller sees a short answer
                i = j
            return out, crcs

    def _read_block(self, fd: int, pos: int, n: int, blocks: list[tuple[int, int]],
                    skip: int | None) -> tuple[memoryview, list[int | None]]:
        """Bytes [pos, pos + n) of the file (fewer past its end) as a view into a pool
        buffer; the read covers whole pages around them (O_DIRECT alignment). With ``skip``
        also the CRC of each of ``blocks`` ((position, size) in the file, within the span)
        from its byte ``skip`` on, where read_span_crcs read the span (else None each)."""
        crcs: list[int | None] = [None] * len(blocks)
        if n > FILE_READ_SPAN * 2:
            return memoryview(_read_range(fd, pos, n)), crcs   # not a block: no pool buffer
        a0 = pos - pos % PAGE
        a1 = -(-(pos + n) // PAGE) * PAGE
        gentle = self.gentle is not None and self.gentle()
        # fresh buffers without the interpreter lock for unpaced reads (BufferPool.take)
        buf = self.buffers.take(a1 - a0, unlocked=not gentle)
        mv = memoryview(buf)
        got = 0
        # While producers append, a span is read hot_read_piece at a time and one piece at a
        # time across the cold threads (the lock): an O_DIRECT read goes to the device, where
        # the WAL's dsync writes (same disk with file://) queue behind whatever is in flight.
        # Two 4 MiB reads in flight (prefetch pieces on both cold threads) put milliseconds in
        # front of a WAL write several times a second: the catch-up bench's produce p99 rose
        # ~2x (bench/HISTORY.md, session 14). Session 5's design (one 1 MiB piece at a time)
        # had been lost when reads became one O_DIRECT read per span (session 12). What a
        # write waits for is the piece's own device time, so the piece is small (64 KiB).
        piece = max(PAGE, self.hot_read_piece - self.hot_read_piece % PAGE) if gentle \
            else a1 - a0
        # (In C when built: the piece loop holds the interpreter lock for none of its reads. Per
        # 64 KiB piece, a Python loop re-took the lock 128 times per 8 MiB span, each time a
        # hand-off with the event loop's thread while producers append.)
        native = gentle and read_pieces is not None
        # the span and its blocks' CRCs in one call (see get_ranges_crc)
        whole = not gentle and skip is not None and read_span_crcs is not None
        try:
            while got < a1 - a0:
                try:
                    if whole:
                        got, crcs = read_span_crcs(fd, mv[:a1 - a0], a0,
                                                   [(p - a0, size) for p, size in blocks], skip)
                        break                 # all of it, or the end of the file
                    if native:
                        got += read_pieces(fd, mv[got:a1 - a0], a0 + got, piece)
                        break                 # all of it, or the end of the file
                    if gentle:
                        with self._device:
                            r = os.preadv(fd, [mv[got:min(a1 - a0, got + piece)]], a0 + got)
                    else:
                        r = os.preadv(fd, [mv[got:a1 - a0]], a0 + got)
                except OSError as e:
                    if e.errno != errno.EINVAL or not _O_DIRECT:
                        raise
                    # O_DIRECT refused for this read: the page cache it is
                    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
                    if not flags & _O_DIRECT:
                        raise
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
                    whole = False             # the loop below, through the page cache
                    continue
                if r == 0:
                    break
                got += r
                if r % PAGE:
                    break                     # the end of the file
        except BaseException:
            mv.release()
            self.buffers.give_back(buf)
            raise
        start = pos - a0
        view = mv[start:max(start, min(got, start + n))]
        mv.release()
        return view, crcs

    @contextlib.contextmanager
    def _reading(self, key: str, direct: bool = False) -> Iterator[int]:
        """An fd of the object's file (``direct``: opened with O_DIRECT where the file system
        takes it); a missing file is ObjectNotFound, any other OS error (opening or reading)
        ObjectStoreError."""
        path = self._path(key)
        flags = os.O_RDONLY | os.O_CLOEXEC
        try:
            try:
                fd = os.open(path, flags | (_O_DIRECT if direct else 0))
            except OSError as e:
                if not direct or not _O_DIRECT or e.errno != errno.EINVAL:
                    raise
                fd = os.open(path, flags)         # O_DIRECT refused (tmpfs)
        except FileNotFoundError as e:
            raise ObjectNotFound(key) from e
        except OSError as e:
            raise ObjectStoreError(str(e)) from e
        try:
            yield fd
        except OSError as e:
            raise ObjectStoreError(str(e)) from e
        finally:
            os.close(fd)

    def size(self, key: str) -> int:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError as e:
            raise ObjectNotFound(key) from e

    def delete(self, keys: list[str]) -> None:
        """Move the objects' files into the recycle pool (see RECYCLE_DIR) while it has room,
        else remove them (``_release``: a large one a piece at a time, see TRASH_DIR)."""
        for key in keys:
            path = self._path(key)
            if self.recycle_bytes > 0 and self._recycle(path):
                continue
            self._release(path)

    def _release(self, path: str) -> bool:
        """Remove a file no key names any more: a small one unlinked, a larger one moved into
        the trash, whose thread gives its blocks back a piece at a time (TRASH_DIR). False:
        it was gone already."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return False
        if size > RELEASE_SMALL and self._trash.put(path):
            return True
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> list[str]:
        out = []
        for dirpath, dirs, files in os.walk(self.root):
            if dirpath == self.root:              # deleted objects: kept for reuse, or going
                dirs[:] = [d for d in dirs if d not in _HIDDEN_DIRS]
            for name in files:
                if TEMP_MARK in name:
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)


# O_DIRECT: buffer address, file offset and length in multiples of this (covers 512 B devices)
DIRECT_ALIGN = 4096
# smaller objects are not worth the fcntl calls
DIRECT_MIN = 256 << 10


def _aligned(view: memoryview) -> bool:
    """Whether the buffer under ``view`` starts on a DIRECT_ALIGN boundary (False when its
    address cannot be had: a read-only buffer such as bytes)."""
    if view.readonly or not view.contiguous:
        return False
    try:
        c = ctypes.c_char.from_buffer(view)
    except (TypeError, ValueError, BufferError):
        return False
    try:
        return ctypes.addressof(c) % DIRECT_ALIGN == 0
    finally:
        del c


def _write_direct(fd: int, view: memoryview, chunk: int = FILE_WRITE_CHUNK) -> int:
    """Write the leading whole DIRECT_ALIGN units of ``view`` with O_DIRECT, ``chunk`` bytes
    at a time; returns how many bytes were written (0: not aligned, too small, or O_DIRECT
    refused by the file system - the caller writes the rest through the page cache). The
    fd is left without O_DIRECT, at the returned position."""
    n = len(view) // DIRECT_ALIGN * DIRECT_ALIGN
    if not _O_DIRECT or n < DIRECT_MIN or not _aligned(view) or not _set_direct(fd, True):
        return 0
    done = 0
    try:
        if _write_pieces is not None:        # the same pieces, the GIL released once
            return _write_pieces(fd, view[:n], chunk, DIRECT_ALIGN)
        while done < n:
            try:
                w = os.write(fd, view[done:min(done + chunk, n)])
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                break                        # refused (alignment the fs wants is larger)
            done += w
            if w % DIRECT_ALIGN:
                break                        # a short write left the rest unaligned
    finally:
        _set_direct(fd, False)
    return done


_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _grown(ring: Buffer, keep: int) -> Buffer:
    """A ring twice the size of ``ring`` holding its first ``keep`` bytes (a streamed put's
    block larger than its ring: rare, so not kept after the put)."""
    bigger = fresh_buffer(2 * len(ring))
    with memoryview(bigger) as dst, memoryview(ring) as src:
        dst[:keep] = src[:keep]
    return bigger


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False when the file system refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
    except OSError:
        return False
    return True


def _locked(fd: int) -> int:
    """``fd`` with an exclusive flock held (a put's temp file: see TEMP_SWEEP_AGE_S); closed
    if the lock cannot be had (another process swept it between open and lock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, view: memoryview) -> None:
    """os.write until every byte is written (a write may be short)."""
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (the directory entry lives in the directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MemObjectStore(ObjectStore):
    """A dict; ``mem://name`` stores of the same name share contents within one process."""

    _shared: dict[str, dict[str, bytes]] = {}

    def __init__(self, name: str = "") -> None:
        self.url = "mem://" + name
        self._lock = threading.Lock()
        self.objects = self._shared.setdefault(name, {}) if name else {}

    def put(self, key: str, data: bytes | memoryview) -> None:
        with self._lock:
            self.objects[key] = bytes(data)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        with self._lock:
            try:
                data = self.objects[key]
            except KeyError as e:
                raise ObjectNotFound(key) from e
        return data[start:end]

    def size(self, key: str) -> int:
        with self._lock:
            try:
                return len(self.objects[key])
            except KeyError as e:
                raise ObjectNotFound(key) from e

    def delete(self, keys: list[str]) -> None:
        with self._lock:
            for k in keys:
                self.objects.pop(k, None)

    def list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in self.objects if k.startswith(prefix))


def open_object_store(url: str, probe: bool = False,
                      recycle_bytes: int = RECYCLE_BYTES) -> ObjectStore:
    """Build a store from ``file://DIR``, ``mem://[name]`` or ``s3://bucket/prefix?...``.
    ``probe``: short timeouts and few retries (the start-up check must not hang);
    ``recycle_bytes``: a file store's recycle pool bound (see RECYCLE_DIR)."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return FileObjectStore(parts.netloc + parts.path if parts.netloc not in ("", "localhost")
                               else parts.path, recycle_bytes=recycle_bytes)
    if parts.scheme == "mem":
        return MemObjectStore(parts.netloc + parts.path)
    if parts.scheme == "s3":
        from .s3 import S3ObjectStore
        return S3ObjectStore(url, probe=probe)
    if parts.scheme == "" and url:
        return FileObjectStore(url, recycle_bytes=recycle_bytes)
    raise ValueError(f"unsupported object store URL {url!r}")
