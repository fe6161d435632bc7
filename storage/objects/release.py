"""Giving a file's blocks back a piece at a time, so the WAL's writes never queue behind it.

On a filesystem mounted with ``discard`` (ext4 here, the test VM: ``-o discard``, no journal)
every block an unlink or a truncate frees is discarded inside that system call, and a
thin-provisioned virtual disk serves the discard ahead of the writes queued behind it.
Measured on the test VM (bench/HISTORY.md, session 52): unlinking a 512 MiB object file took
424 ms, and 4 KiB O_DIRECT|O_DSYNC writes (the WAL's acks=all writes) paced at 1000/s beside
it completed 3 in that time, at 190-233 ms each; a 2 GiB file, 9 writes at up to 374 ms.
Cut from its end 1 MiB at a time with a pause after each cut, the same delete took 1.1 s and
the writes beside it stayed at p50 0.24 ms, p99 1.69 ms (1 MiB cuts without a pause: p99 6.7
ms; 16 MiB: 45 ms).

``shrink`` cuts a file down that way. The pause after a cut is as long as the cut took (the
device's discard time, capped at PAUSE_MAX_S): the device is never given more than half of
its time to discards, and on a device whose discards are cheap (or a filesystem without
``discard``) the pauses vanish with them. ``Trash`` is the background thread that does it
for deleted files, so the thread that deleted them (an upload thread: retention and
compaction deletes) never waits for it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Callable

log = logging.getLogger(__name__)

# bytes freed per ftruncate: one discard the device serves in about a millisecond here
CHUNK = 1 << 20
# files no larger than this are unlinked at once (a single cut's worth)
SMALL = CHUNK
# most time to rest after one cut (a stalled device must not make a delete take minutes)
PAUSE_MAX_S = 0.01


def shrink(fd: int, size: int, chunk: int = CHUNK, pause_max_s: float = PAUSE_MAX_S,
           sleep: Callable[[float], None] = time.sleep) -> None:
    """Cut the open file ``fd`` down to ``size`` bytes from its end, ``chunk`` bytes per
    ftruncate, resting (``sleep``) after each cut but the last as long as it took, at most
    ``pause_max_s``."""
    end = os.fstat(fd).st_size
    while end > size:
        end = max(size, end - chunk)
        t0 = time.monotonic()
        os.ftruncate(fd, end)
        if end > size:
            sleep(min(pause_max_s, time.monotonic() - t0))


def remove(path: str, chunk: int = CHUNK, pause_max_s: float = PAUSE_MAX_S) -> None:
    """Unlink ``path`` after cutting it to nothing (``shrink``); a small file at once.
    Missing: nothing to do."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if os.fstat(fd).st_nlink == 1:   # a second name is another file's: only unlink this one
            shrink(fd, 0, chunk, pause_max_s)
    finally:
        os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Trash:
    """A directory of deleted files and the thread that removes them with ``remove``, one at
    a time, each no sooner than ``quarantine_s`` after it came (a reader that opened the file
    just before its delete keeps its descriptor for one read; a cut would shorten that read,
    where an unlink leaves the inode whole). Files left by a previous run (a crash before
    their turn) are removed once ``resume`` is called. The thread starts with the first file
    and stops with the process (a daemon): what it did not reach is removed by the next
    run."""

    def __init__(self, directory: str, quarantine_s: float = 0.5,
                 name: str = "s3kafka-trash") -> None:
        self.directory = directory
        self.quarantine_s = quarantine_s
        self._name = name
        self._queue: list[tuple[float, str]] = []       # (ready at, path), in arrival order
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False

    def put(self, path: str) -> bool:
        """Move ``path`` into the trash (a rename: its name is gone at once) for the thread to
        remove. False when it could not be moved (missing, or another filesystem)."""
        dest = os.path.join(self.directory, uuid.uuid4().hex)
        try:
            os.makedirs(self.directory, exist_ok=True)
            os.rename(path, dest)
        except OSError:
            return False
        self._add(dest, time.monotonic() + self.quarantine_s)
        return True

    def resume(self) -> None:
        """Queue what a previous run left in the directory (call once, before any ``put``);
        they wait the quarantine too: another process sharing the directory may have put
        them there just now."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return
        ready = time.monotonic() + self.quarantine_s
        for name in names:
            self._add(os.path.join(self.directory, name), ready)

    def pending(self) -> int:
        """Files not yet removed (queued or being cut)."""
        with self._cond:
            return len(self._queue) + self._busy

    def wait_empty(self, timeout: float | None = None) -> bool:
        """Wait until every queued file is removed (tests, orderly shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _add(self, path: str, ready: float) -> None:
        with self._cond:
            self._queue.append((ready, path))
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                ready, path = self._queue[0]
                wait = ready - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                self._queue.pop(0)
                self._busy = True
            try:
                remove(path)
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one file
                log.warning("could not remove deleted object file %s: %s", path, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
